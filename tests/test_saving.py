"""pipeline -> .keras -> plain Keras -> pipeline on another number of ranks."""

import subprocess
import sys

from mpi import SCRIPTS, run_mpi


def test_save_on_four_ranks_resume_on_two_and_open_in_plain_keras(tmp_path):
    saved = run_mpi(4, "saving.py", str(tmp_path), "save", timeout=240)
    assert saved.returncode == 0, saved.output
    assert saved.output.count("SAVED rank") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras", "model.weights.h5", "predictions.npy"]
    assert saved.output.count("Params per stage") == 1, "summary() prints one table, on rank 0"

    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / "plain_load.py"), str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert "PLAIN KERAS OK" in plain.stdout, plain.stdout + plain.stderr

    resumed = run_mpi(2, "saving.py", str(tmp_path), "resume", timeout=240)
    assert resumed.returncode == 0, resumed.output
    assert resumed.output.count("RESUMED rank") == 2
