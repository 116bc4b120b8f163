"""balance="time" under mpirun: every rank computes the same split, and it follows time, not parameters."""

import pytest
from mpi import run_mpi

pytestmark = pytest.mark.alone  # measures speed (see conftest.py)


def test_balance_by_time_moves_work_off_the_convolution_stage():
    launch = run_mpi(2, "balance_time.py", timeout=180)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("BALANCE rank") == 2, launch.output
