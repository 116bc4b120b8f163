"""``keras_pipe.cost`` (the path before the packages) is :mod:`keras_pipe.schedules.cost`."""

import sys

from keras_pipe.schedules import cost as _module

sys.modules[__name__] = _module  # (one module under both names: what one sets, the other sees)
