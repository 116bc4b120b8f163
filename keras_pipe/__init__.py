"""keras_pipe: pipeline model parallelism for Keras over MPI.

Write a model as a list of layers, run the script under ``mpirun -n P``,
and each rank trains one contiguous stage of it.

The public API is what this module exports (``__all__``), and what
:mod:`keras_pipe.schedules` (schedules as plain data, the simulator, the cost
model of a step) and :mod:`keras_pipe.mpi` (the layout of stages and
replicas, the GPU a rank uses: planning without MPI) export in theirs;
every other name may change in any release. 0.2's module paths
(``keras_pipe.timeline``, ``.tracing``, ``.schedule``, ``.layout``,
``.cost``, ``.devices``, ``keras_pipe.engine.timeline``) still import, with a
DeprecationWarning, until 0.4 (:mod:`keras_pipe.moved`). The code is in six
packages, one a layer (``model``, ``engine``, ``stage``, ``graph``,
``schedules``, ``mpi``: each package's docstring says what it holds and may
import).

Importing keras_pipe starts MPI and communicates with no other rank (see
:mod:`keras_pipe.mpi.runtime`). Run a script as ``mpirun -n P python -m
keras_pipe train.py`` to have MPI started, and a failure on any rank end the
job, before the script's first line (see :mod:`keras_pipe.__main__`).
"""

# First of all, once: MPI under its start deadline, the hook that makes an uncaught error on one rank
# end the whole job, and TensorFlow's thread pools and GPU, before its first op (keras_pipe.mpi.runtime).
from keras_pipe.mpi.runtime import start_process as _start_process

_start_process()

from keras_pipe.engine.tracing import SpanRecorder, Tracer  # noqa: E402
from keras_pipe.errors import (  # noqa: E402
    CollectiveError,
    PipelineConfigError,
    PipelineDataError,
    PipelineIOError,
    PipelineStallError,
    RankMismatchError,
)
from keras_pipe.graph.graph import unallocated  # noqa: E402
from keras_pipe.model.callbacks import ModelCheckpoint, is_writer, writer_only  # noqa: E402
from keras_pipe.model.loading import load_model  # noqa: E402
from keras_pipe.model.model import PipelineModel  # noqa: E402
from keras_pipe.model.timeline import PipelineTimeline  # noqa: E402
from keras_pipe.moved import install as _install_moved_paths  # noqa: E402
from keras_pipe.mpi.runtime import init  # noqa: E402
from keras_pipe.stage.batchnorm import DeferredBatchNormalization  # noqa: E402

_install_moved_paths()  # (0.2's module paths, each with a DeprecationWarning: keras_pipe.moved)

__version__ = "0.3.0"

__all__ = [
    "PipelineModel",
    "DeferredBatchNormalization",
    "PipelineTimeline",
    "SpanRecorder",
    "Tracer",
    "load_model",
    "ModelCheckpoint",
    "unallocated",
    "is_writer",
    "writer_only",
    "init",
    "CollectiveError",
    "PipelineConfigError",
    "PipelineDataError",
    "PipelineIOError",
    "PipelineStallError",
    "RankMismatchError",
    "__version__",
]
