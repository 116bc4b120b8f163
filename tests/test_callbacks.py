"""Built-in callbacks behave as for Sequential, the same on every rank, under mpirun."""

import pytest
from mpi import run_mpi


@pytest.mark.parametrize("nprocs", [2, 4])
def test_callbacks_match_sequential(tmp_path, nprocs):
    launch = run_mpi(nprocs, "callbacks.py", str(tmp_path), timeout=400)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("CALLBACKS OK") == nprocs, launch.output


@pytest.mark.parametrize("nprocs", [2, 4])
def test_backup_and_restore_resumes_a_killed_run(tmp_path, nprocs):
    crashed = run_mpi(nprocs, "backup.py", str(tmp_path), "crash", timeout=180)
    assert crashed.returncode != 0 and "simulated crash on rank 1" in crashed.output, crashed.output
    assert (tmp_path / "backup" / "training_metadata.json").exists()
    resumed = run_mpi(nprocs, "backup.py", str(tmp_path), "resume", timeout=180)
    assert resumed.returncode == 0, resumed.output
    assert resumed.output.count("RESUMED OK") == nprocs, resumed.output
