"""The tutorial notebook runs from top to bottom, so it cannot go stale (in the slow tier: `pytest --slow`)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


# (the slow tier: its launches, train_digits.py on four ranks and timeline_demo.py on two, run in test_readme.py and
# test_timeline.py; benchmarks/throughput.py --smoke, its last cell, only here)
@pytest.mark.slow
@pytest.mark.mpi  # (its cells launch mpirun)
def test_tutorial_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(ROOT / "notebooks" / "tutorial.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()
    outputs = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "upstream gradient shape: (16, 128)" in outputs
    assert "test accuracy, pipeline:" in outputs
    assert outputs.count("PipelineTimeline:") == 2
    assert "samples/s" in outputs
