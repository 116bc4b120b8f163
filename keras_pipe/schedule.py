"""``keras_pipe.schedule`` (the path before the packages) is :mod:`keras_pipe.schedules.schedule`."""

import sys

from keras_pipe.schedules import schedule as _module

sys.modules[__name__] = _module  # (one module under both names: what one sets, the other sees)
