"""Recording what every rank does on chosen steps: Chrome trace, Gantt chart, bubble.

``PipelineTimeline`` is a Keras callback. On the chosen training steps each
rank's stage records the start and end of every forward, backward, send,
receive (which is where a rank waits) and optimizer update, per
micro-batch; at the end of training rank 0 gathers the spans and writes

- a Chrome trace JSON (open it in https://ui.perfetto.dev or
  ``chrome://tracing``), one row per rank, and
- a PNG Gantt chart (matplotlib, the ``timeline`` extra), next to it: without
  matplotlib the callback warns when it is created and writes the trace alone
  (``png=True`` makes it an error at creation instead),

and prints the measured bubble fraction next to the theoretical
``(P - 1) / (m + P - 1)``. Without the callback nothing is recorded.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import keras
from mpi4py import MPI

from keras_pipe.engine.tracing import SpanRecorder
from keras_pipe.mpi.comm import Communicator

COMPUTE = ("forward", "backward", "forward+backward", "weights")
COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "forward+backward": "#8172b3",
    "weights": "#937860",
    "optimizer": "#55a868",
    "receive activation": "#dddddd",
    "receive gradient": "#bbbbbb",
    "send activation": "#c44e52",
    "send gradient": "#c44e52",
    "share logs": "#999999",
}


class PipelineTimeline(keras.callbacks.Callback):
    """Records the pipeline on the given training steps and writes a trace and a chart.

    Example:

    ```python
    timeline = PipelineTimeline("timeline.json", steps=[3, 4])
    model.fit(x, y, epochs=1, callbacks=[timeline])
    # rank 0 wrote timeline.json and timeline.png
    print(timeline.bubble)  # measured bubble fraction of the recorded steps
    ```

    Args:
        path: where rank 0 writes the Chrome trace (``.json``); the chart goes
            to the same path with ``.png``.
        steps: global training step numbers to record (counted from 0 over
            all epochs of this ``fit``).
        png: whether to draw the chart: ``None`` (default) draws it where
            matplotlib is installed and warns at creation where it is not;
            ``True`` raises :class:`~keras_pipe.PipelineConfigError` at creation
            without matplotlib; ``False`` writes the trace alone.
    """

    def __init__(self, path, steps: Iterable[int] = (2,), png: bool | None = None):
        super().__init__()
        from keras_pipe import optional

        if png is None:
            png = optional.missing("matplotlib") is None
            if not png and MPI.COMM_WORLD.Get_rank() == 0:  # (said once, by the rank that writes)
                warnings.warn(
                    f"PipelineTimeline: matplotlib is not installed, so only the trace ({path}) will be written, "
                    f"not the chart: {optional.install_line('matplotlib')}",
                    stacklevel=2,
                )
        elif png:
            optional.require("matplotlib", "PipelineTimeline(png=True)")
        self.png = bool(png)
        self.path = Path(path)
        self.steps = set(int(s) for s in steps)
        self.events: list = []
        self.bubble: float | None = None
        self.theoretical_bubble: float | None = None
        self._step = 0

    def on_train_begin(self, logs=None):
        self._step = 0
        self.events = []

    def on_train_batch_begin(self, batch, logs=None):
        if self._step in self.steps:
            self.model.tracer = SpanRecorder()
            self.model.engine.world.barrier()  # line the ranks up, so one step's spans do not overlap another's
            self._began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        recorder = self.model.tracer
        if isinstance(recorder, SpanRecorder):
            ended = time.perf_counter()
            self.events.append({"step": self._step, "began": self._began, "ended": ended, "spans": recorder.take()})
            self.model.tracer = None
        self._step += 1

    def on_train_end(self, logs=None):
        comm: Communicator = self.model.engine.world
        everyone = comm.allgather_json(self.events)
        model = self.model
        m = model.num_microbatches
        picker = model.engine.picker  # ("auto": what it runs now, after its first timed steps)
        name = model.schedule if picker is None else f"auto, {picker.current()}"
        if self.events and self.events[-1]["spans"]:
            m = 1 + max(span[2] for event in self.events for span in event["spans"])
        self.theoretical_bubble, formula = _theoretical_bubble(model.engine, m)
        self.bubble = bubble_fraction(everyone)
        if comm.rank == 0 and any(everyone):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(chrome_trace(everyone)))
            if self.png:
                gantt_chart(everyone, self.path.with_suffix(".png"), name, m)
            print(
                f"PipelineTimeline: {model.num_stages} stages, {m} micro-batches, {name}: bubble "
                f"{100 * self.bubble:.1f}% measured, {100 * self.theoretical_bubble:.1f}% in theory "
                f"({formula}); trace in {self.path}",
                flush=True,
            )


def _theoretical_bubble(engine, m: int) -> tuple[float, str]:
    """The bubble a schedule has in theory, and how it is found (one chunk a rank: as 1F1B and GPipe have it)."""
    p, v = engine.num_stages, engine.num_chunks
    if v == 1:
        return (p - 1) / (m + p - 1), "(P - 1) / (m + P - 1)"
    name = engine.actions.training_schedule()  # ("auto": the schedule it picked, ZB-V among them)
    from keras_pipe.schedules import schedule, simulator

    theory = schedule.kind_of(name).bubble
    if theory is not None:
        formula, text = theory
        return formula(p, m, v), text

    plan = schedule.make_schedule(name, p, m, True, num_chunks=v)
    return simulator.bubble(plan, simulator.DURATIONS, engine.placement), "the simulator's, F = I = W"


def chrome_trace(per_rank: list[list[dict]]) -> dict:
    """Chrome trace events, one thread (row) per rank, times in microseconds from the first step's start."""
    origin = min(step["began"] for steps in per_rank for step in steps)
    events = []
    for rank, steps in enumerate(per_rank):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for step in steps:
            for name, step_number, microbatch, start, end in step["spans"]:
                events.append(
                    {
                        "name": name if microbatch < 0 else f"{name} {microbatch}",
                        "cat": name,
                        "ph": "X",
                        "pid": 0,
                        "tid": rank,
                        "ts": (start - origin) * 1e6,
                        "dur": max(end - start, 0.0) * 1e6,
                        "args": {"step": step_number, "microbatch": microbatch},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def bubble_fraction(per_rank: list[list[dict]]) -> float | None:
    """1 - compute time / (ranks x step time), over the recorded steps."""
    ranks = [steps for steps in per_rank if steps]
    if not ranks:
        return None
    wall = sum(max(s["ended"] for s in group) - min(s["began"] for s in group) for group in zip(*ranks))
    busy = sum(
        end - start for steps in ranks for step in steps for name, _, _, start, end in step["spans"] if name in COMPUTE
    )
    return max(0.0, 1.0 - busy / (len(ranks) * wall)) if wall > 0 else None


def gantt_chart(per_rank: list[list[dict]], path, schedule: str = "", microbatches: int = 0) -> None:
    """A PNG with one row per rank and a bar per span, coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(step["began"] for steps in per_rank for step in steps)
    figure, axes = plt.subplots(figsize=(12, 1 + 0.6 * len(per_rank)))
    for rank, steps in enumerate(per_rank):
        for step in steps:
            for name, _, microbatch, start, end in step["spans"]:
                axes.barh(rank, (end - start) * 1e3, left=(start - origin) * 1e3, color=COLORS.get(name, "#999999"))
                if name in COMPUTE and (end - start) * 1e3 > 0:
                    axes.text(
                        ((start + end) / 2 - origin) * 1e3,
                        rank,
                        "all" if microbatch < 0 else str(microbatch),
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
    axes.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    axes.invert_yaxis()
    axes.set_xlabel("ms")
    axes.set_title(f"{schedule} schedule, {len(per_rank)} stages, {microbatches} micro-batches")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    axes.legend(handles, list(COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
