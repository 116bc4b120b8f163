"""One rank raises in an eager call, the script catches it: the ranks never go on out of step.

Calling the model is a collective method (agreed on entry, with each rank's
count of collective calls): a rank that went on to another method meets the
others at the next entry, and every rank raises at once, naming where each
is; an error inside the call on one rank ends the job naming it. Before, the
ranks waited on different collectives until the stall timeout, or read each
other's messages ("Unable to allocate 6.88 EiB").
"""

from mpi import run_mpi


def test_ranks_in_different_collective_methods_raise_at_once_naming_both():
    launch = run_mpi(2, "out_of_step.py", "before", timeout=180, env={"KERAS_PIPE_STALL_TIMEOUT": "120"})
    assert launch.returncode != 0, launch.output
    assert launch.seconds_after("FAILING AT") < 30, launch.output
    assert "ranks [0]: 'predict()'; ranks [1]: 'call()' (the call's number" in launch.output, launch.output
    assert "collective calls: rank 0: 2, rank 1: 2)" in launch.output, launch.output
    assert "went on" not in launch.output and "allocate" not in launch.output, launch.output


def test_an_error_inside_a_call_on_one_rank_ends_the_job_naming_it():
    launch = run_mpi(2, "out_of_step.py", "inside", timeout=180, env={"KERAS_PIPE_STALL_TIMEOUT": "120"})
    assert launch.returncode != 0, launch.output
    assert launch.seconds_after("FAILING AT") < 30, launch.output
    assert "[keras_pipe] rank 0 of 2" in launch.output and "failed in call()" in launch.output, launch.output
    assert "a layer failed on rank 0 inside the call" in launch.output, launch.output
    assert "went on" not in launch.output, launch.output
