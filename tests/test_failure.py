"""A rank that fails ends the whole job, non-zero, within seconds, naming itself."""

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
