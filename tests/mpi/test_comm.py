"""Communication: raw buffers, clear size errors, and waiting without spinning."""

import re

import pytest
from mpi import run_mpi


@pytest.mark.alone  # CPU seconds (see conftest.py)
def test_waiting_ten_seconds_costs_well_under_a_second_of_cpu():
    launch = run_mpi(2, "idle_wait.py", timeout=120, env={"KERAS_PIPE_DEBUG": "1"})
    assert launch.returncode == 0, launch.output
    # KERAS_PIPE_DEBUG=1 prints every send and receive, prefixed with the rank.
    assert "[keras_pipe rank 0] send float32[3, 4] tag 11 -> rank 1" in launch.output, launch.output
    assert "[keras_pipe rank 1] recv float32[3, 4] tag 11 <- rank 0" in launch.output, launch.output
    wall, cpu = map(float, re.search(r"WAITED wall ([0-9.]+) s cpu ([0-9.]+) s", launch.output).groups())
    assert wall > 9, launch.output
    assert cpu < 0.5, f"a waiting rank used {cpu:.2f} s of CPU in {wall:.1f} s"


def test_the_stall_timeout_from_the_environment_is_checked_naming_the_variable():
    from keras_pipe.errors import PipelineConfigError
    from keras_pipe.mpi.stall import DEFAULT_STALL_TIMEOUT, stall_timeout_from_env

    assert stall_timeout_from_env(environ={"KERAS_PIPE_STALL_TIMEOUT": "30"}) == 30.0
    assert stall_timeout_from_env(environ={"KERAS_PIPE_STALL_TIMEOUT": "inf"}) == float("inf")
    assert stall_timeout_from_env(environ={}) == DEFAULT_STALL_TIMEOUT
    for bad in ("0", "-5", "abc", "nan"):
        with pytest.raises(PipelineConfigError, match=f"KERAS_PIPE_STALL_TIMEOUT='{bad}': give the seconds"):
            stall_timeout_from_env(environ={"KERAS_PIPE_STALL_TIMEOUT": bad})


def test_examples():
    import doctest

    from keras_pipe.mpi import stall

    assert doctest.testmod(stall).failed == 0
