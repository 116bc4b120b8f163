"""``keras_pipe.devices`` (the path before the packages) is :mod:`keras_pipe.mpi.devices`."""

import sys

from keras_pipe.mpi import devices as _module

sys.modules[__name__] = _module  # (one module under both names: what one sets, the other sees)
