"""keras_pipe: pipeline model parallelism for Keras over MPI.

Write a model as a list of layers, run the script under ``mpirun -n P``,
and each rank trains one contiguous stage of it.

The public API is what this module exports (``__all__``), plus
``keras_pipe.timeline.PipelineTimeline``, ``keras_pipe.tracing``,
``keras_pipe.schedule`` (schedules as plain data), ``keras_pipe.layout`` and
``keras_pipe.cost`` (planning without MPI). Modules whose docstring starts
with "Internal:" may change in any release.

Importing keras_pipe communicates with no other rank (see
:mod:`keras_pipe.runtime`).
"""

from keras_pipe.batchnorm import DeferredBatchNormalization
from keras_pipe.devices import try_configure_gpus as _configure_gpus
from keras_pipe.errors import (
    CollectiveError,
    PipelineConfigError,
    PipelineIOError,
    PipelineStallError,
    RankMismatchError,
)
from keras_pipe.loading import load_model
from keras_pipe.model import PipelineModel
from keras_pipe.runtime import init
from keras_pipe.threads import configure_threads as _configure_threads

# Before the script creates any tensor: TensorFlow's pools can only be sized,
# and its GPUs chosen, before its first op. No MPI call: the launcher's
# environment says how many ranks share this host, and which one this is.
_configure_threads(warn=False)
_configure_gpus()

__version__ = "0.2.0"

__all__ = [
    "PipelineModel",
    "DeferredBatchNormalization",
    "load_model",
    "init",
    "CollectiveError",
    "PipelineConfigError",
    "PipelineIOError",
    "PipelineStallError",
    "RankMismatchError",
    "__version__",
]
