"""keras_pipe: pipeline model parallelism for Keras over MPI.

Write a model as a list of layers, run the script under ``mpirun -n P``,
and each rank trains one contiguous stage of it.
"""

from keras_pipe.errors import PipelineConfigError, PipelineStallError, RankMismatchError, RemoteRankError
from keras_pipe.model import PipelineModel
from keras_pipe.saving import load_model

__version__ = "0.1.0"

__all__ = [
    "PipelineModel",
    "load_model",
    "PipelineConfigError",
    "PipelineStallError",
    "RankMismatchError",
    "RemoteRankError",
    "__version__",
]
