"""``keras_pipe.timeline`` (the path before the packages) is :mod:`keras_pipe.engine.timeline`."""

import sys

from keras_pipe.engine import timeline as _module

sys.modules[__name__] = _module  # (one module under both names: what one sets, the other sees)
