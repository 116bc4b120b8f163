"""PipelineTimeline writes a valid Chrome trace (one row per rank, every micro-batch) and a chart.

On ZB-V (two chunks a rank): every chunk's spans are on its rank's row; the
notebook draws 1F1B's and GPipe's.
"""

import json

import numpy as np
from mpi import ROOT, run_mpi


def test_trace_has_every_microbatch_on_every_rank(tmp_path):
    out = tmp_path / "trace.json"
    launch = run_mpi(
        2, str(ROOT / "examples" / "timeline_demo.py"), "--schedule", "zb-v", "--microbatches", "4", "--out", str(out)
    )
    assert launch.returncode == 0, launch.output
    assert "bubble" in launch.output and "in theory" in launch.output
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert rows == {"rank 0", "rank 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert "zb-v" in launch.output and "simulator" in launch.output, launch.output  # (its bubble in theory)
    for rank in range(2):
        for step in (3, 4):
            mine = [e for e in spans if e["tid"] == rank and e["args"]["step"] == step]
            for microbatch in range(4):
                kinds = {e["cat"] for e in mine if e["args"]["microbatch"] == microbatch}
                assert any("forward" in k for k in kinds) and any("backward" in k for k in kinds), (rank, step, kinds)
    import matplotlib.image

    image = matplotlib.image.imread(out.with_suffix(".png"))
    assert image.shape[0] > 100 and image.shape[1] > 300
    assert np.std(image[..., :3]) > 0.05, "the chart is blank"
