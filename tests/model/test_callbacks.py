"""Built-in callbacks behave as for Sequential, the same on every rank, under mpirun."""

import json

import pytest
from mpi import run_mpi


@pytest.mark.parametrize("nprocs", [pytest.param(2, marks=pytest.mark.slow), 4])  # (2: the slow tier)
def test_callbacks_match_sequential(tmp_path, nprocs):
    """Four ranks: callback_families.py too, in the same launch (test_callback_families_match_sequential's four)."""
    families = ["--families"] if nprocs == 4 else []
    launch = run_mpi(nprocs, "callbacks.py", str(tmp_path), *families, timeout=700)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("CALLBACKS OK") == nprocs, launch.output
    assert launch.output.count("FAMILIES OK") == (nprocs if families else 0), launch.output


def test_backup_and_restore_resumes_a_killed_run_on_another_number_of_ranks(tmp_path):
    """Four stages write the backup, a stage each (a sharded checkpoint); two ranks resume from it."""
    crashed = run_mpi(4, "backup.py", str(tmp_path), "crash", timeout=180)
    assert crashed.returncode != 0 and "simulated crash on rank 1" in crashed.output, crashed.output
    backup = tmp_path / "backup"
    assert (backup / "training_metadata.json").exists()
    assert len(list(backup.glob("latest_stage*.weights.h5"))) == 4, sorted(backup.iterdir())
    resumed = run_mpi(2, "backup.py", str(tmp_path), "resume", timeout=180)
    assert resumed.returncode == 0, resumed.output
    assert resumed.output.count("RESUMED OK") == 2, resumed.output


def test_backup_and_restore_killed_while_writing_its_backup_resumes_from_the_last_good_one(tmp_path):
    killed = run_mpi(2, "backup.py", str(tmp_path), "kill-in-backup", timeout=180)
    assert killed.returncode != 0, killed.output
    backup = tmp_path / "backup"
    committed = json.loads((backup / "latest.weights.json").read_text())["metadata"]["keras_pipe"]["save"]
    unnamed = [p.name for p in backup.glob("latest_stage*.weights.h5") if f".{committed}." not in p.name]
    assert unnamed, f"not killed mid-write: {sorted(backup.iterdir())}"
    resumed = run_mpi(2, "backup.py", str(tmp_path), "resume", timeout=180)
    assert resumed.returncode == 0, resumed.output
    assert resumed.output.count("RESUMED OK") == 2, resumed.output

    # a backup damaged by other means is reported once, with its path, and how to go on
    assert run_mpi(2, "backup.py", str(tmp_path), "kill-in-backup", timeout=180).returncode != 0
    index = backup / "latest.weights.json"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    damaged = run_mpi(2, "backup.py", str(tmp_path), "resume", timeout=180)
    assert damaged.returncode != 0, damaged.output
    assert damaged.output.count(f"the backup in {backup} cannot be read") == 1, damaged.output
    assert "written only in part" in damaged.output and "Delete" in damaged.output, damaged.output


# (2: the slow tier; four ranks run it in test_callbacks_match_sequential's launch, after callbacks.py)
@pytest.mark.parametrize("nprocs", [pytest.param(2, marks=pytest.mark.slow)])
def test_callback_families_match_sequential(tmp_path, nprocs):
    """Issue 47: monitors on val_accuracy (mode auto), custom layers Keras cannot rebuild, TensorBoard histograms and
    embeddings, effects once per job, tf.distribute refused; see tests/mpi_scripts/callback_families.py."""
    launch = run_mpi(nprocs, "callback_families.py", str(tmp_path), timeout=400)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("FAMILIES OK") == nprocs, launch.output
