"""Optional dependencies, checked when what needs them is created, never at the end of a run.

``PipelineTimeline`` draws its chart with matplotlib (the ``timeline``
extra) and Keras' ``TensorBoard`` writes with tensorboard: found missing
after the last epoch, or after the first, the error would end a whole
training run on the one rank that writes. Each is checked up front, on
every rank alike, with the line that installs it.

>>> missing("json") is None
True
>>> missing("surely_not_a_module_xyz")
'surely_not_a_module_xyz'
"""

from __future__ import annotations

import importlib.util
import sys

from keras_pipe.errors import PipelineConfigError

# module -> (the extra that installs it, or None: the package itself)
EXTRAS = {"matplotlib": "timeline", "tensorboard": "tensorboard"}


def missing(module: str) -> str | None:
    """``module`` if it cannot be imported here (checked without importing it), else ``None``."""
    if module in sys.modules:
        return module if sys.modules[module] is None else None
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # (a finder that refuses it, a module set to None)
        found = None
    return module if found is None else None


def install_line(module: str) -> str:
    """How to install ``module``: ``pip install "keras_pipe[extra]"``."""
    extra = EXTRAS.get(module)
    return f'pip install "keras_pipe[{extra}]"' if extra else f"pip install {module}"


def require(module: str, what: str) -> None:
    """Raises :class:`PipelineConfigError` (on every rank alike) unless ``module`` can be imported."""
    if missing(module):
        raise PipelineConfigError(f"{what} needs {module}, which is not installed here: {install_line(module)}")


def check_callbacks(callbacks) -> None:
    """Raises on every rank, before training, if a callback needs an optional package that is missing."""
    import keras

    for callback in callbacks or ():
        if isinstance(callback, keras.callbacks.TensorBoard):
            require("tensorboard", "keras.callbacks.TensorBoard")
