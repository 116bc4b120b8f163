"""Internal: compiled programs — XLA where it compiles, a plain graph where not, traced once per shape.

Every per-micro-batch computation of a stage runs as a :class:`Program`.
Calls go straight to the traced graph of the arguments' shapes (see
:func:`keras_pipe.compat.call_concrete`): a ``tf.function`` call spends
100-200 us matching its arguments to a trace, more than a small
micro-batch's compute. A new shape (a batch padded to another length) is a
new trace; :data:`SHAPES_WARNED` distinct shapes of one program get a
warning, as each costs a compilation.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_pipe import compat

_XLA_REFUSALS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, NotImplementedError)
# Distinct argument shapes after which a program warns that it keeps recompiling (a text pipeline
# padding each batch to its own length: bucket the lengths).
SHAPES_WARNED = 16


class Program:
    """A compiled function: XLA if it compiles, else a plain ``tf.function``; eager when asked.

    Args:
        function: the Python function to trace.
        jit: try XLA first.
        eager: run ``function`` op by op (``compile(run_eagerly=True)``).
        name: how warnings name the program.
    """

    def __init__(self, function, jit: bool, eager: bool = False, name: str = "a program", strict: bool = False):
        self.python = function
        self.eager = eager
        self.name = name
        self.strict = strict  # XLA or nothing: the program draws random numbers its twin programs must redraw
        self.xla = tf.function(function, jit_compile=True) if jit and not eager else None
        self.graph = tf.function(function)
        self.compiled_with_xla: bool | None = None  # known after the first call
        self._concrete: dict = {}
        self._warned = False

    def __call__(self, *args):
        if self.eager:
            return self.python(*args)
        key = signature(args)
        concrete = self._concrete.get(key)
        if concrete is None:
            concrete = self._trace(key, args)
        flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(args, expand_composites=True) if a is not None]
        if self.xla is None:
            return compat.call_concrete(concrete, flat)
        try:
            result = compat.call_concrete(concrete, flat)
        except _XLA_REFUSALS as error:
            # XLA refuses the stage's layers: on the first call, or on the first under a gradient
            # tape (TensorFlow then compiles the forward with what its gradient needs, an LSTM's
            # TensorList say). Plain graphs from now on.
            if self.compiled_with_xla and not _refused_by_xla(error):
                raise
            if self.strict:
                from keras_pipe.errors import PipelineConfigError

                raise PipelineConfigError(
                    f"XLA cannot compile {self.name} ({type(error).__name__}: {str(error)[:300]}), and the stage "
                    "draws random numbers (dropout): XLA and TensorFlow draw different ones, so a backward that "
                    "replays the forward would not see its masks. Use compile(jit_compile='auto') (XLA where "
                    "nothing random runs) or jit_compile=False."
                ) from error
            self.xla, self.compiled_with_xla = None, False
            self._concrete.clear()
            return compat.call_concrete(self._trace(key, args), flat)
        self.compiled_with_xla = True
        return result

    def _trace(self, key, args):
        function = self.xla if self.xla is not None else self.graph
        self._concrete[key] = concrete = function.get_concrete_function(*args)
        if len(self._concrete) > SHAPES_WARNED and not self._warned:
            self._warned = True
            warnings.warn(
                f"keras_pipe compiled {self.name} for {len(self._concrete)} different input shapes; each new "
                "shape costs a compilation. Pad batches to a few lengths (bucketing) instead of each to its own.",
                stacklevel=3,
            )
        return concrete


def _refused_by_xla(error) -> bool:
    """Whether an error of a program that compiled before is XLA's refusal, not the computation's own error."""
    return isinstance(error, tf.errors.UnimplementedError) or "XLA" in str(error)


def signature(value):
    """What selects a trace: the structure, shapes and dtypes of the arguments (hashable)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((key, signature(value[key])) for key in sorted(value))
    if value is None:
        return None
    if isinstance(value, tf.IndexedSlices):
        return ("slices", signature(value.values), signature(value.indices))
    if isinstance(value, (int, float, bool, str)):
        return (type(value).__name__, value)
    return (tuple(value.shape), str(value.dtype))
