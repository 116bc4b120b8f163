"""``keras_pipe.tracing`` (the path before the packages) is :mod:`keras_pipe.engine.tracing`."""

import sys

from keras_pipe.engine import tracing as _module

sys.modules[__name__] = _module  # (one module under both names: what one sets, the other sees)
