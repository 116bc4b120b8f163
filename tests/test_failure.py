"""A rank that fails ends the whole job, non-zero, within seconds, naming itself."""

import re

import pytest
from mpi import run_mpi


@pytest.mark.parametrize(
    "where, message",
    [
        ("callback", "boom from a callback on rank 2"),
        ("layer", "a layer failed on rank 2"),
        ("data", "the data reader failed on rank 2"),
    ],
)
def test_rank_failure_ends_every_rank(where, message):
    launch = run_mpi(4, "fail_rank.py", "2", where, timeout=120)
    assert launch.returncode != 0, launch.output
    assert launch.seconds < 60, launch.output
    assert "rank 2 of 4" in launch.output, launch.output
    assert message in launch.output, launch.output
    assert "finished without noticing" not in launch.output, launch.output


@pytest.mark.parametrize(
    "mode, message",
    [("script", "rank 1 failed in the first lines of its script"), ("import", "ModuleNotFoundError")],
)
def test_a_rank_failing_before_keras_pipe_is_imported_ends_the_job_naming_it(mode, message):
    # The failed rank sits in MPI_Finalize (mpi4py's exit), so the launcher never ends
    # the job: the others must, within the stall timeout, naming the rank that is missing.
    launch = run_mpi(3, "early_failure.py", mode, timeout=120, env={"KERAS_PIPE_STALL_TIMEOUT": "10"})
    assert launch.returncode != 0, launch.output
    assert launch.seconds < 10 + 40, launch.output
    assert message in launch.output, launch.output
    assert re.search(r"  rank 1: no answer within .*failed before its first PipelineModel", launch.output)
    assert launch.output.count("What each rank was doing") <= 2, "one report (its traceback repeats it)"
    assert "finished without noticing" not in launch.output, launch.output


def test_an_error_raised_alike_on_every_rank_is_printed_once():
    launch = run_mpi(3, "early_failure.py", "config", timeout=120)
    assert launch.returncode != 0, launch.output
    assert launch.output.count("PipelineConfigError: num_microbatches=0") == 1, launch.output
    assert "every rank of 3 raised this error" in launch.output, launch.output


def test_a_killed_rank_is_named_by_the_survivors():
    # Hydra kills every rank at once when one is killed (nothing can speak then); under
    # a launcher that lets the others run (srun without --kill-on-bad-exit, a wrapper
    # script per rank, as here) the survivors notice the process is gone and say which.
    launch = run_mpi(4, "stall.py", "kill", timeout=120, wrapper=("sh", "-c", '"$0" "$@"; sleep 20'))
    assert launch.returncode != 0, launch.output
    assert launch.seconds < 5 + 30, launch.output  # found by the check for dead processes, not the 5 s timeout
    assert re.search(r"rank 2 \(pid \d+ on \S+\) stopped: its process no longer exists", launch.output)
    assert "  rank 2: dead: its process no longer exists" in launch.output, launch.output
    assert len(re.findall(r"\[keras_pipe\] rank \d is aborting", launch.output)) == 1, launch.output
