"""Internal: compiled programs — XLA where it compiles, a plain graph where not, traced once per shape.

Every per-micro-batch computation of a stage runs as a :class:`Program`.
Calls go straight to the traced graph of the arguments' shapes (see
:func:`keras_pipe.compat.call_concrete`): a ``tf.function`` call spends
100-200 us matching its arguments to a trace, more than a small
micro-batch's compute. A new shape (a batch padded to another length) is a
new trace; :data:`SHAPES_WARNED` distinct shapes of one program get a
warning, as each costs a compilation.

A program returns each tensor once, and none it was given: a tensor it
returns twice, or one of its own arguments returned (a kept input passed
on for a later pass), would be a copy of its own under XLA, measured at a
whole extra buffer each. The returned structure is rebuilt around the
unique outputs, with the very tensors the caller passed in.

Programs are traced without AutoGraph, as Keras 3's own trainer traces its
steps (``tf.autograph.experimental.do_not_convert``). AutoGraph never reached
a layer's ``call`` anyway (it leaves the ``keras`` package alone, and every
layer is called through ``Layer.__call__``): a Python ``if`` that reads a
tensor fails under ``Sequential`` and here alike. Converting keras_pipe's own
functions at each trace only cost time: a fifth of a small model's first
fits (``tests/mpi_scripts/equivalence.py`` on one rank, 48 -> 38 s of CPU).
"""

from __future__ import annotations

import warnings

import numpy as np
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
        self.xla = tf.function(self._unique, jit_compile=True, autograph=False) if jit and not eager else None
        self.graph = tf.function(self._unique, autograph=False)
        self.compiled_with_xla: bool | None = None  # known after the first call
        self._concrete: dict = {}
        self._layouts: dict = {}  # a trace's key -> (the result's structure, where each leaf comes from)
        self._traced_layout = None
        self._warned = False

    def _unique(self, *args):
        """The traced function: returns its result's tensors once each, none of them an argument."""
        result = self.python(*args)
        given = {}
        _walk(args, (), lambda leaf, path: given.setdefault(id(leaf), path) if isinstance(leaf, tf.Tensor) else None)
        unique, seen, sources = [], {}, []

        def slot(leaf, path):
            if isinstance(leaf, tf.Tensor) and id(leaf) in given:
                sources.append((_ARGUMENT, given[id(leaf)]))
            elif not isinstance(leaf, (tf.Tensor, tf.IndexedSlices, tf.SparseTensor)):
                sources.append((_CONSTANT, leaf))
            else:
                if id(leaf) not in seen:
                    seen[id(leaf)] = len(unique)
                    unique.append(leaf)
                sources.append((_OUTPUT, seen[id(leaf)]))
            return len(sources) - 1

        self._traced_layout = (_walk(result, (), slot), sources)
        return unique

    def _rebuild(self, key, args, unique):
        skeleton, sources = self._layouts[key]
        values = [
            unique[where] if kind is _OUTPUT else _at(args, where) if kind is _ARGUMENT else where
            for kind, where in sources
        ]
        return _fill(skeleton, values)

    def __call__(self, *args):
        if self.eager:
            return self.python(*args)
        key = signature(args)
        concrete = self._concrete.get(key)
        if concrete is None:
            concrete = self._trace(key, args)
        flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(args, expand_composites=True) if a is not None]
        if self.xla is None:
            return self._rebuild(key, args, compat.call_concrete(concrete, flat))
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
            return self._rebuild(key, args, compat.call_concrete(self._trace(key, args), flat))
        self.compiled_with_xla = True
        return self._rebuild(key, args, result)

    def _trace(self, key, args):
        function = self.xla if self.xla is not None else self.graph
        self._traced_layout = None
        self._concrete[key] = concrete = function.get_concrete_function(*args)
        if self._traced_layout is not None:
            self._layouts[key] = self._layouts[id(concrete)] = self._traced_layout
        else:  # (a trace tf.function had already made)
            self._layouts[key] = self._layouts[id(concrete)]
        if len(self._concrete) > SHAPES_WARNED and not self._warned:
            self._warned = True
            warnings.warn(
                f"keras_pipe compiled {self.name} for {len(self._concrete)} different input shapes; each new "
                "shape costs a compilation. Pad batches to a few lengths (bucketing) instead of each to its own.",
                stacklevel=3,
            )
        return concrete


_OUTPUT, _ARGUMENT, _CONSTANT = "output", "argument", "constant"


def _walk(value, path: tuple, leaf):
    """A skeleton of ``value`` (lists, tuples, named tuples, dicts) with ``leaf(x, path)`` at each leaf."""
    if isinstance(value, (list, tuple)):
        children = [_walk(v, path + (i,), leaf) for i, v in enumerate(value)]
        kind = type(value) if hasattr(value, "_fields") else list if isinstance(value, list) else tuple
        return ("sequence", kind, children)
    if isinstance(value, dict):
        keys = list(value)
        return ("dict", keys, [_walk(value[k], path + (k,), leaf) for k in keys])
    return ("leaf", leaf(value, path))


def _fill(skeleton, values: list):
    kind = skeleton[0]
    if kind == "leaf":
        return values[skeleton[1]]
    if kind == "dict":
        return {k: _fill(child, values) for k, child in zip(skeleton[1], skeleton[2])}
    children = [_fill(child, values) for child in skeleton[2]]
    cls = skeleton[1]
    return cls(*children) if hasattr(cls, "_fields") else cls(children)


def _at(value, path: tuple):
    for step in path:
        value = value[step]
    return value


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


class StageProgram:
    """A stage's :class:`~keras_pipe.stage.programs.Program`, with the value checks XLA would skip.

    Where XLA may compile the program, each id an ``Embedding`` looks up and
    each label of a sparse cross-entropy is checked against its range, as
    TensorFlow's own kernels check them without XLA (XLA reads past a table,
    or gives NaN, silently): the program returns each one's smallest and
    largest value beside its result, and a value out of range is an
    ``InvalidArgumentError`` naming it, as the unsplit model's.
    """

    def __init__(self, compute, key, function, random: bool):
        self.python = function
        self.notes: list = []
        self.checked = compute.jit is not False and not compute.eager
        jit = compute.jit is True or (compute.jit == "auto" and not (random and compute.draws_random))

        def traced(*args):
            compute._checks = [] if self.checked else None
            try:
                result = function(*args)
            finally:
                checks, compute._checks = compute._checks, None
            if not self.checked:
                return result
            self.notes = [note for note, _ in checks]
            return result, [value for _, value in checks]

        name = key[0] if isinstance(key, tuple) else key
        strict = random and compute.draws_random and compute.jit is True
        self.program = Program(
            traced,
            jit and compute.jit is not False,
            compute.eager,
            f"the {name} program of stage {compute.stage.index}",
            strict,
        )

    def __call__(self, *args):
        result = self.program(*args)
        if not self.checked:
            return result
        result, values = result
        for (note, low, high), value in zip(self.notes, values):
            smallest, largest = (int(v) for v in np.asarray(value))
            if smallest < low or largest >= high:
                bad = smallest if smallest < low else largest
                raise tf.errors.InvalidArgumentError(
                    None, None, f"{note} {bad}, which is outside the valid range [{low}, {high})."
                )
        return result
