"""keras_pipe: pipeline model parallelism for Keras over MPI.

Write a model as a list of layers, run the script under ``mpirun -n P``,
and each rank trains one contiguous stage of it.

The public API is what this module exports (``__all__``), plus
``keras_pipe.engine.timeline.PipelineTimeline``, ``keras_pipe.engine.tracing``,
``keras_pipe.schedules.schedule`` (schedules as plain data), ``keras_pipe.mpi.layout`` and
``keras_pipe.schedules.cost`` (planning without MPI); their paths before the
packages (``keras_pipe.timeline``, ``.tracing``, ``.schedule``, ``.layout``,
``.cost``, ``.devices``) are the same modules. The code is in six packages, one
a layer (``model``, ``engine``, ``stage``, ``graph``, ``schedules``, ``mpi``: each
package's docstring says what it holds and may import). Modules whose
docstring starts with "Internal:" may change in any release.

Importing keras_pipe communicates with no other rank (see
:mod:`keras_pipe.mpi.runtime`). Run a script as ``mpirun -n P python -m
keras_pipe train.py`` to have MPI started, and a failure on any rank end the
job, before the script's first line (see :mod:`keras_pipe.__main__`).
"""

# First, before TensorFlow (whose import may fail on a broken host): MPI (under a deadline: a rank
# that failed before starting MPI would leave this one in MPI_Init for ever), and the hook that makes
# an uncaught error on one rank end the whole job. Neither communicates.
from keras_pipe.mpi.start import start_mpi as _start_mpi

_start_mpi()

from keras_pipe.mpi.failure import install_excepthook as _install_excepthook  # noqa: E402

_install_excepthook()

from keras_pipe.errors import (  # noqa: E402
    CollectiveError,
    PipelineConfigError,
    PipelineIOError,
    PipelineStallError,
    RankMismatchError,
)
from keras_pipe.graph.graph import unallocated  # noqa: E402
from keras_pipe.model.loading import load_model  # noqa: E402
from keras_pipe.model.model import PipelineModel  # noqa: E402
from keras_pipe.mpi.devices import try_configure_gpus as _configure_gpus  # noqa: E402
from keras_pipe.mpi.runtime import init  # noqa: E402
from keras_pipe.stage.batchnorm import DeferredBatchNormalization  # noqa: E402

# Before the script creates any tensor: TensorFlow's pools can only be sized,
# and its GPUs chosen, before its first op; and from here on an uncaught
# error on one rank ends the job. No MPI call: the launcher's environment
# says how many ranks share this host, and which one this is.
init()
_configure_gpus()

__version__ = "0.2.0"

__all__ = [
    "PipelineModel",
    "DeferredBatchNormalization",
    "load_model",
    "unallocated",
    "init",
    "CollectiveError",
    "PipelineConfigError",
    "PipelineIOError",
    "PipelineStallError",
    "RankMismatchError",
    "__version__",
]
