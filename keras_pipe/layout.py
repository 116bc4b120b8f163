"""``keras_pipe.layout`` (the path before the packages) is :mod:`keras_pipe.mpi.layout`."""

import sys

from keras_pipe.mpi import layout as _module

sys.modules[__name__] = _module  # (one module under both names: what one sets, the other sees)
