"""pipeline -> .keras -> plain Keras -> pipeline on another number of ranks."""

import json
import subprocess
import sys

import pytest
from mpi import SCRIPTS, require_keras_hub, run_mpi


def test_save_on_four_ranks_resume_on_three_and_open_in_plain_keras(tmp_path):
    saved = run_mpi(4, "saving.py", str(tmp_path), "save", timeout=240)
    assert saved.returncode == 0, saved.output
    assert saved.output.count("SAVED rank") == 4
    written = sorted(p.name for p in tmp_path.iterdir() if "_stage" not in p.name)
    assert written == [
        "exported",
        "model.keras",
        "model.weights.h5",
        "predictions.npy",
        "sharded.weights.json",
        "sharded_00000.weights.h5",
        "small.weights.json",
        "small_00000.weights.h5",
    ], written
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sharded_stage"))
    assert [name.split(".")[0] for name in shards] == [f"sharded_stage0000{s}-00000" for s in range(4)], shards
    assert saved.output.count("Params per stage") == 1, "summary() prints one table, on rank 0"
    assert saved.output.count(f"Saved artifact at '{tmp_path}/exported'") == 1, "export prints once, its own path"

    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / "plain_load.py"), str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert "PLAIN KERAS OK" in plain.stdout, plain.stdout + plain.stderr

    resumed = run_mpi(3, "saving.py", str(tmp_path), "resume", timeout=240)
    assert resumed.returncode == 0, resumed.output
    assert resumed.output.count("RESUMED rank") == 3

    replicas = run_mpi(4, "saving.py", str(tmp_path), "replicas", timeout=240)
    assert replicas.returncode == 0, replicas.output
    assert replicas.output.count("REPLICAS RESUMED rank") == 4, replicas.output


def test_a_keras_hub_gpt2_saved_on_four_ranks_opens_in_plain_keras_and_resumes_on_two(tmp_path):
    require_keras_hub()
    saved = run_mpi(4, "graph_saving.py", str(tmp_path), "save", timeout=300)
    assert saved.returncode == 0, saved.output
    assert saved.output.count("SAVED rank") == 4, saved.output
    assert "pending" not in saved.output, "every communicator is freed before MPI finalizes"
    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / "plain_load_graph.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "PLAIN KERAS OK" in plain.stdout, plain.stdout + plain.stderr
    resumed = run_mpi(2, "graph_saving.py", str(tmp_path), "resume", timeout=300)
    assert resumed.returncode == 0, resumed.output
    assert resumed.output.count("RESUMED rank") == 2, resumed.output


def test_a_save_that_fails_part_way_leaves_the_previous_file_loadable(tmp_path):
    launch = run_mpi(2, "save_faults.py", str(tmp_path), "errors", timeout=240)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("SAVE FAULTS OK") == 2, launch.output
    for what in ("an exception part way", "a full disk"):
        assert f"PREVIOUS FILES INTACT after {what}" in launch.output, launch.output


@pytest.mark.parametrize("target", ["model", "weights", "sharded"])
def test_killing_a_rank_while_it_saves_leaves_the_previous_file(tmp_path, target):
    """Whichever rank writes the failing layer's values: sending them to rank 0 for a one-file save (rank 0's
    partial file is left, or removed as rank 0 unwinds), writing its own shard of a sharded one (left, named by
    no index)."""
    killed = run_mpi(2, "save_faults.py", str(tmp_path), "kill", target, timeout=240)
    assert killed.returncode != 0, killed.output
    assert "the save completed" not in killed.output, killed.output
    assert "killed while it writes the weights" in killed.output, killed.output
    if target == "sharded":
        committed = json.loads((tmp_path / "model.weights.json").read_text())["metadata"]["keras_pipe"]["save"]
        partial = [p.name for p in tmp_path.glob("model_stage*") if f".{committed}." not in p.name]
        assert partial, f"no rank was killed in the middle of writing its shard: {sorted(tmp_path.iterdir())}"
    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / "plain_check.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=SCRIPTS,
    )
    assert "PREVIOUS FILES LOAD IN PLAIN KERAS" in plain.stdout, plain.stdout + plain.stderr


def test_a_file_saved_before_the_packages_loads_with_its_weights_and_optimizer_state():
    """tests/data/saved_before_packages.keras: saved by the code before keras_pipe/ became packages (issue 40).

    A DeferredBatchNormalization in it is stored under its old module path
    (``keras_pipe.batchnorm``); Keras finds the class by its registered name.
    """
    import json
    from pathlib import Path

    import keras
    import numpy as np

    import keras_pipe

    data = Path(__file__).parent.parent / "data"
    expected = json.loads((data / "saved_before_packages.json").read_text())
    x = np.asarray(expected["x"], "float32")
    for load in (keras_pipe.load_model, keras.saving.load_model):
        model = load(str(data / "saved_before_packages.keras"))
        assert int(model.optimizer.iterations.numpy()) == 1, load  # (fit one step before saving)
        assert any(isinstance(layer, keras_pipe.DeferredBatchNormalization) for layer in model.layers), load
        np.testing.assert_allclose(model.predict(x, verbose=0), expected["predictions"], rtol=1e-5, atol=1e-6)
