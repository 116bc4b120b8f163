"""A rank fails before its first PipelineModel, or every rank raises the same error.

Usage: early_failure.py before-mpi|script|import|after-import|config

``before-mpi``: rank 1 raises before importing mpi4py (it never joins MPI).
``script``: rank 1 raises in the first lines of its script, after mpi4py,
before keras_pipe. ``import``: rank 1's ``import keras_pipe`` fails (as on a
host whose TensorFlow install is broken). ``after-import``: rank 1 raises
after importing keras_pipe, before its model (a bad path). The other ranks
build a model and train: they must end within a minute, with the default
timeouts, naming rank 1. ``config``: every rank raises the same
``PipelineConfigError``, uncaught: it is printed once, by rank 0.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
mode = sys.argv[1]
if mode == "before-mpi" and os.environ.get("PMI_RANK") == "1":  # (Hydra's rank, before MPI exists)
    raise RuntimeError("rank 1 failed before importing mpi4py")

from mpi4py import MPI  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()
if mode == "script" and RANK == 1:
    raise RuntimeError("rank 1 failed in the first lines of its script")
if mode == "import" and RANK == 1:
    sys.modules["tensorflow"] = None  # importing TensorFlow now raises ImportError

from common import compile_args, data, layers  # noqa: E402

import keras_pipe  # noqa: E402

if mode == "after-import" and RANK == 1:
    open("/nonexistent/rank-1/data.npz")  # a typo in a path: FileNotFoundError
x, y, _ = data(n=64)
model = keras_pipe.PipelineModel(layers(), num_microbatches=0 if mode == "config" else 2)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
print(f"rank {RANK} finished without noticing the failure", flush=True)
