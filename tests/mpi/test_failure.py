"""A rank that fails ends the whole job, non-zero, within seconds, naming itself.

Each bound is measured from the failure (``Launch.seconds_after`` the failing
rank's marker), not from the launch's start: TensorFlow's import on a loaded
machine takes several times as long as on an idle one, while what follows a
failure (an announcement, a poll, an abort) is mostly waiting. So these run
beside other tests; the bounds are several times what they take alone. The
killed rank's test too: stall.py cuts its stall timeout to 15 s only after a
first fit has traced every rank's programs (the first step on two loaded
cores can take longer than that, the later ones a fraction of a second).
"""

import re

import pytest
from mpi import run_mpi

# Seconds from a failure to the job's end: about 1 alone on 2 cores (9 from the start of the fit that meets
# the bad label, 4 to the bad validation data, 21 from the first model with a start timeout of 15 s). Run
# three at a time beside a 4-rank benchmark, the launches took 2 to 4 times as long and these bounds held.
AFTER_FAILURE = 30


@pytest.mark.parametrize(
    "where, rank, message",
    [
        ("callback", 2, "boom from a callback on rank 2"),
        ("layer", 2, "a layer failed on rank 2"),
        # (only the first stage reads the data: the other ranks never call the generator)
        ("data", 0, "the data reader failed on rank 0"),
        ("label", 2, "label 3, which is outside the valid range [0, 3)"),
    ],
)
def test_rank_failure_ends_every_rank(where, rank, message):
    launch = run_mpi(4, "fail_rank.py", str(rank), where, timeout=120)
    assert launch.returncode != 0, launch.output
    # (label: from the start of the fit whose fourth batch has the bad label)
    assert launch.seconds_after("FAILING AT") < AFTER_FAILURE + (15 if where == "label" else 0), launch.output
    failing = 3 if where == "label" else rank  # (the last stage computes the loss)
    if where == "data":  # (a reader's failure is agreed, not aborted: the same error on every rank, naming it)
        assert "every rank of 4 raised this error" in launch.output, launch.output
        assert "rank 0, which reads the data, could not read its batch" in launch.output, launch.output
    else:
        assert f"rank {failing} of 4" in launch.output, launch.output
    assert message in launch.output, launch.output
    assert "finished without noticing" not in launch.output, launch.output


def test_validation_data_of_the_wrong_shape_is_the_same_error_on_every_rank_at_once():
    # Only the first stage converts the inputs, but every rank checks the batch's shapes: the
    # error is raised everywhere (printed once), never left to the first stage while the others wait.
    launch = run_mpi(4, "fail_rank.py", "2", "validation", timeout=120)
    assert launch.returncode != 0, launch.output
    assert launch.seconds_after("FAILING AT") < AFTER_FAILURE + 15, launch.output  # from the fit's start
    assert "every rank of 4 raised this error" in launch.output, launch.output
    # (Keras' words: its InputSpec check's, which every rank runs now before the shapes' own check)
    assert launch.output.count("is incompatible with the layer: expected shape=(None, 12)") == 1, launch.output
    assert "aborting" not in launch.output, launch.output


# (a rank failing in its script's first lines, after the import, and under `python -m keras_pipe` before MPI or in
# its first lines: tests/mpi/test_failure_matrix.py, on 2 ranks and 4; these three-rank launches repeated them)
def test_a_rank_failing_before_keras_pipe_is_imported_is_named_within_a_minute():
    # The failed rank never joined MPI (its import of a missing module failed), so the launcher never ends the
    # job: the others must, naming the rank that is missing, at the first rendezvous's own timeout (not the
    # stall timeout's 600 s; 15 s here instead of the default 30 s, to keep the suite short).
    launch = run_mpi(3, "early_failure.py", "import", timeout=120, env={"KERAS_PIPE_START_TIMEOUT": "15"})
    assert launch.returncode != 0, launch.output
    assert launch.seconds_after("FIRST MODEL AT") < 15 + AFTER_FAILURE, launch.output
    assert "ModuleNotFoundError" in launch.output, launch.output
    assert re.search(r"  rank 1: no answer within .*failed before its first PipelineModel", launch.output)
    assert "KERAS_PIPE_START_TIMEOUT" in launch.output, launch.output
    assert launch.output.count("What each rank was doing") <= 2, "one report (its traceback repeats it)"
    assert "finished without noticing" not in launch.output, launch.output


def test_an_error_raised_alike_on_every_rank_is_printed_once():
    launch = run_mpi(3, "early_failure.py", "config", timeout=120)
    assert launch.returncode != 0, launch.output
    assert launch.output.count("PipelineConfigError: num_microbatches=0") == 1, launch.output
    assert "every rank of 3 raised this error" in launch.output, launch.output


def test_an_error_caught_and_raised_anew_on_every_rank_is_printed_once_not_waited_on():
    # Two collective failures in a row (load_weights' error on every rank, then the callback's own,
    # as BackupAndRestore raises on a damaged backup); rank 0 hears the first late, when the second
    # has arrived too. Each round of the check takes one announcement a rank: had rank 0 taken the
    # second as the first, it would wait for a second that had come already, until the stall
    # timeout (this hung a CI run), then abort.
    launch = run_mpi(3, "early_failure.py", "raised-anew", timeout=180, env={"KERAS_PIPE_STALL_TIMEOUT": "60"})
    assert launch.returncode != 0, launch.output
    assert launch.output.count("RuntimeError: could not resume: start without --resume") == 1, launch.output
    assert "every rank of 3 raised this error" in launch.output, launch.output
    assert "aborting" not in launch.output, launch.output


def test_a_killed_rank_is_named_by_the_survivors():
    # Hydra kills every rank at once when one is killed (nothing can speak then); under
    # a launcher that lets the others run (srun without --kill-on-bad-exit, a wrapper
    # script per rank, as here) the survivors notice the process is gone and say which.
    launch = run_mpi(4, "stall.py", "kill", timeout=180, wrapper=("sh", "-c", '"$0" "$@"; sleep 20'))
    assert launch.returncode != 0, launch.output
    # found by the check for dead processes, the job ended before the wrappers' 20 s sleep
    assert launch.seconds_after("STALLING AT") < 20, launch.output
    assert re.search(r"rank 2 \(pid \d+ on \S+\) stopped: its process no longer exists", launch.output)
    assert "  rank 2: dead: its process no longer exists" in launch.output, launch.output
    assert len(re.findall(r"\[keras_pipe\] rank \d is aborting", launch.output)) == 1, launch.output
