"""A missing optional package is an error (or a warning) before training, never after it.

The ranks the tests launch cannot import matplotlib (tests/site/sitecustomize.py).
"""

import json

from mpi import run_mpi

from keras_pipe import optional


def test_missing_is_checked_without_importing(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert optional.missing("matplotlib") == "matplotlib"
    assert optional.missing("json") is None
    assert optional.install_line("matplotlib") == 'pip install "keras_pipe[timeline]"'


def test_a_timeline_without_matplotlib_warns_when_created_and_writes_the_trace(tmp_path):
    launch = run_mpi(2, "optional_packages.py", "timeline", str(tmp_path), timeout=180)
    assert launch.returncode == 0, launch.output
    assert launch.output.count('pip install "keras_pipe[timeline]"') == 1, launch.output  # (rank 0 alone)
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert not (tmp_path / "trace.png").exists()
    assert "rank 1 trained" in launch.output, launch.output


def test_a_timeline_that_must_draw_is_an_error_when_created(tmp_path):
    launch = run_mpi(2, "optional_packages.py", "timeline-png", str(tmp_path), timeout=180)
    assert launch.returncode != 0, launch.output
    assert "PipelineConfigError: PipelineTimeline(png=True) needs matplotlib" in launch.output, launch.output
    assert 'pip install "keras_pipe[timeline]"' in launch.output, launch.output
    assert "every rank of 2 raised this error" in launch.output and "aborting" not in launch.output, launch.output
    assert "trained" not in launch.output, launch.output


def test_tensorboard_without_tensorboard_is_an_error_before_the_first_step(tmp_path):
    launch = run_mpi(2, "optional_packages.py", "tensorboard", str(tmp_path), timeout=180)
    assert launch.returncode != 0, launch.output
    assert "keras.callbacks.TensorBoard needs tensorboard" in launch.output, launch.output
    assert 'pip install "keras_pipe[tensorboard]"' in launch.output, launch.output
    assert "every rank of 2 raised this error" in launch.output and "aborting" not in launch.output, launch.output
    assert not (tmp_path / "logs").exists()
