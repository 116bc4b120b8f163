"""A rank fails before keras_pipe is imported, or every rank raises the same error.

Usage: early_failure.py script|import|config

``script``: rank 1 raises in the first lines of its script, before importing
keras_pipe. ``import``: rank 1's ``import keras_pipe`` fails (as on a host whose
TensorFlow install is broken). The other ranks build a model and train: they must
end within the stall timeout, naming rank 1. ``config``: every rank raises the
same ``PipelineConfigError``, uncaught: it is printed once, by rank 0.
"""

import os
import sys

from mpi4py import MPI

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
RANK = MPI.COMM_WORLD.Get_rank()
mode = sys.argv[1]
if mode == "script" and RANK == 1:
    raise RuntimeError("rank 1 failed in the first lines of its script")
if mode == "import" and RANK == 1:
    sys.modules["tensorflow"] = None  # importing TensorFlow now raises ImportError

from common import compile_args, data, layers  # noqa: E402

import keras_pipe  # noqa: E402

x, y, _ = data(n=64)
model = keras_pipe.PipelineModel(layers(), num_microbatches=0 if mode == "config" else 2)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
print(f"rank {RANK} finished without noticing the failure", flush=True)
