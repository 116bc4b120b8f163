"""A rank fails before its first PipelineModel, or every rank raises the same error.

Usage: early_failure.py before-mpi|script|import|after-import|first-collective|later|config|raised-anew

``before-mpi``: rank 1 raises before importing mpi4py (it never joins MPI).
``script``: rank 1 raises in the first lines of its script, after mpi4py,
before keras_pipe. ``import``: rank 1's ``import keras_pipe`` fails (as on a
host whose TensorFlow install is broken). ``after-import``: rank 1 raises
after importing keras_pipe, before its model (a bad path). The other ranks
build a model and train: they must end within a minute, with the default
timeouts, naming rank 1. ``first-collective``: rank 1's callback raises as
its first ``fit`` begins (inside the first collective method, while the others
enter it). ``later``: rank 1's callback raises after a batch of the second
epoch (the others are in the next step). ``config``: every rank raises the same
``PipelineConfigError``, uncaught: it is printed once, by rank 0.
``raised-anew``: every rank's callback catches ``load_weights``' error (a
missing file, found by rank 0 and raised on every rank) and raises another
in its place, as ``BackupAndRestore`` does: two failures announced one after
the other. Rank 0 hears the first late (as when the OS deschedules it), so the
second has arrived too; it must still be printed once, never waited on until
the stall timeout.

Rank 1 prints ``FAILING AT <time.time()>`` as it fails, and rank 0 ``FIRST
MODEL AT <time.time()>`` as it makes its first model (where the first
rendezvous's timeout starts), for the tests to measure from: a launch's
whole duration counts TensorFlow's import, which a loaded machine slows.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
mode = sys.argv[1]


def failing():
    print(f"FAILING AT {time.time()}", flush=True)


if mode == "before-mpi" and os.environ.get("PMI_RANK") == "1":  # (Hydra's rank, before MPI exists)
    failing()
    raise RuntimeError("rank 1 failed before importing mpi4py")

if mode == "before-mpi":
    # first, as a plain-python script must for this: MPI starts under keras_pipe's deadline (mpi/start.py)
    import keras_pipe  # noqa: E402, F401

from mpi4py import MPI  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()
if mode == "script" and RANK == 1:
    failing()
    raise RuntimeError("rank 1 failed in the first lines of its script")
if mode == "import" and RANK == 1:
    failing()
    sys.modules["tensorflow"] = None  # importing TensorFlow now raises ImportError

import keras  # noqa: E402
from common import compile_args, data, layers  # noqa: E402

import keras_pipe  # noqa: E402

if mode == "after-import" and RANK == 1:
    failing()
    open("/nonexistent/rank-1/data.npz")  # a typo in a path: FileNotFoundError
if mode == "raised-anew" and RANK == 0:
    from keras_pipe.mpi import stall

    hear_failures, heard_late = stall.note_failures, []

    def note_failures_late():
        if stall.PROCESS.failing and not heard_late:
            heard_late.append(True)
            time.sleep(2.0)  # the others' second announcement arrives meanwhile
        hear_failures()

    stall.note_failures = note_failures_late


class ResumeOrExplain(keras.callbacks.Callback):
    """Loads a checkpoint that is not there; says what to do instead (a second error, raised from the first)."""

    def on_train_begin(self, logs=None):
        try:
            self.model.load_weights("/nonexistent/checkpoint.weights.h5")
        except keras_pipe.PipelineIOError as error:
            raise RuntimeError("could not resume: start without --resume") from error


x, y, _ = data(n=64)
print(f"FIRST MODEL AT {time.time()}", flush=True) if RANK == 0 else None
model = keras_pipe.PipelineModel(layers(), num_microbatches=0 if mode == "config" else 2)
model.compile(**compile_args())


class FailOnRank1(keras.callbacks.Callback):
    """Raises on rank 1 as fit begins (``first-collective``) or after a batch of the second epoch (``later``)."""

    def on_train_begin(self, logs=None):
        self.epoch = 0
        if mode == "first-collective" and RANK == 1:
            failing()
            raise RuntimeError("rank 1 failed as its fit began")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if mode == "later" and RANK == 1 and self.epoch == 1:
            failing()
            raise RuntimeError("rank 1 failed in its second epoch")


callbacks = [ResumeOrExplain()] if mode == "raised-anew" else [FailOnRank1()]
model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=callbacks)
print(f"rank {RANK} finished without noticing the failure", flush=True)
