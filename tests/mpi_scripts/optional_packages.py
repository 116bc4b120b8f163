"""Callbacks that need an optional package that is missing: found when created or when fit starts, not at its end.

Usage: optional_packages.py timeline|timeline-png|tensorboard OUT_DIR

The ranks the tests launch cannot import matplotlib (tests/site/sitecustomize.py),
as on a machine without the ``timeline`` extra. ``timeline``: ``PipelineTimeline``
warns when created and writes the trace alone. ``timeline-png``: ``png=True``
raises at creation, on every rank. ``tensorboard``: with tensorboard hidden too,
``fit`` raises on every rank before the first step, with the install line.
"""

import sys
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
if mode == "tensorboard":
    sys.modules["tensorboard"] = None  # (as on a machine without it)

import keras  # noqa: E402
from common import RANK, compile_args, data, layers  # noqa: E402

from keras_pipe import (
    PipelineModel,  # noqa: E402
    PipelineTimeline,  # noqa: E402
)

x, y, _ = data(n=64)
if mode == "tensorboard":
    callbacks = [keras.callbacks.TensorBoard(str(out / "logs"))]
else:
    callbacks = [PipelineTimeline(out / "trace.json", steps=[1], png=True if mode == "timeline-png" else None)]
model = PipelineModel(layers(), num_microbatches=2)
model.compile(**compile_args())
model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
print(f"rank {RANK} trained", flush=True)
