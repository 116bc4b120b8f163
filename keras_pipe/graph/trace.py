"""Subclassed models and composite layers as graphs: their ``call()`` run by Keras on symbolic tensors.

A subclassed model's graph is its Python code, but Keras 3 can run that
code on ``KerasTensor``s: every sub-layer ``__call__`` and every
``keras.ops`` op on them records a node, over the same layer objects. So
``keras.Model(inputs, model.call(inputs))`` (``call``, not ``__call__``, so
that the calls inside are recorded) is a Functional view of the model that
:mod:`keras_pipe.graph.graph` walks as any nested Functional model. A layer whose
``call()`` runs other layers in turn (keras_hub's ``ViTEncoder``, all of ViT's
blocks) is traced the same way where the cut needs to fall inside it.

What cannot be traced is refused, never traced wrongly:

- Python that needs a tensor's value (``if tensor > 0``), a raw ``tf.*`` op on
  a symbolic tensor, ``add_loss`` in ``call``: Keras raises while tracing; the
  refusal names the line of the user's file it raised in;
- state changed in ``call`` (an attribute set on a layer, a variable
  assigned): the hooks below stop it at that line, before it happens;
- a path that depends on ``training`` in Python (traced with ``training=True``
  and ``training=False``: the two must call the same layers, each with the
  ``training`` it is given), a variable used directly in ``call`` (an op on
  ``self.kernel``: the pipeline places weights with the layers that call them);
- whatever else makes the traced graph compute something other than the
  real ``call()``: both run on a small real batch in inference mode
  (:func:`check_on_batch`), and a difference is refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import traceback
import warnings

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError


class Untraceable(Exception):
    """A ``call()`` that Keras cannot run symbolically, or whose trace would not be the real ``call()``."""

    def __init__(self, reason: str, where: str | None = None):
        super().__init__(f"{reason} (at {where})" if where else reason)
        self.reason = reason
        self.where = where


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple:
    import tensorflow as tf

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # keras_pipe/ (no upward import)
    # (keras_hub's files count as the model's code: a refusal inside one of its layers names its line)
    dirs = [_package_dir(keras), _package_dir(tf), package, _package_dir(inspect)]
    if "optree" in sys.modules:
        dirs.append(_package_dir(sys.modules["optree"]))
    real = [os.path.realpath(d) + os.sep for d in dirs]
    return tuple(dirs + real)


def _is_user(filename: str) -> bool:
    """Whether a frame's file is the model's code (not Keras', TensorFlow's, keras_pipe's or Python's)."""
    path = os.path.abspath(filename)
    return not path.startswith(_library_dirs()) and not filename.startswith("<frozen")


def _where(filename: str, line: int, text: str | None = None) -> str:
    return f'File "{filename}", line {line}' + (f": {text.strip()}" if text else "")


def _user_line(error: BaseException) -> str | None:
    """The last frame of ``error``'s traceback in the model's code: ``File "...", line N: code``."""
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if _is_user(frame.filename):
            found = _where(frame.filename, frame.lineno, frame.line)
    return found


def _frame_line(frame) -> str:
    info = inspect.getframeinfo(frame)
    return _where(info.filename, info.lineno, info.code_context[0] if info.code_context else None)


@contextlib.contextmanager
def _no_state_changes():
    """While tracing: a layer attribute set or a variable assigned by the model's code raises at that line."""
    layer_class = keras.layers.Layer
    variable_class = keras.Variable
    setattr_ = layer_class.__setattr__
    assigns = {name: getattr(variable_class, name) for name in ("assign", "assign_add", "assign_sub")}
    own = {name for name in assigns if name in vars(variable_class)}  # (the others are inherited: deleted after)

    def watched_setattr(self, name, value):
        caller = sys._getframe(1)
        if _is_user(caller.f_code.co_filename):
            raise Untraceable(
                f"call() changes the state of {type(self).__name__} {self.name!r} (sets its attribute {name!r}), "
                "which a graph cannot record",
                _frame_line(caller),
            )
        return setattr_(self, name, value)

    def watched(name):
        original = assigns[name]

        def assign(self, *args, **kwargs):
            caller = sys._getframe(1)
            if _is_user(caller.f_code.co_filename):
                raise Untraceable(
                    f"call() changes the variable {self.path!r} ({name}), which a graph cannot record",
                    _frame_line(caller),
                )
            return original(self, *args, **kwargs)

        return assign

    layer_class.__setattr__ = watched_setattr
    for name in assigns:
        setattr(variable_class, name, watched(name))
    try:
        yield
    finally:
        layer_class.__setattr__ = setattr_
        for name, original in assigns.items():
            if name in own:
                setattr(variable_class, name, original)
            else:
                delattr(variable_class, name)


def _containers(layer) -> dict:
    """The lengths of the lists, dicts and sets that ``layer`` and its sub-layers hold in public attributes."""
    found = {}
    for sub in compat.sublayers(layer):
        for name, value in vars(sub).items():
            if not name.startswith("_") and isinstance(value, (list, dict, set)):
                found[(id(sub), name)] = (sub, len(value))
    return found


def _check_containers(layer, before: dict) -> None:
    """Raises where ``call()`` added to or removed from a list, dict or set a layer holds (``self.cache.append``)."""
    for key, (sub, length) in before.items():
        value = vars(sub).get(key[1])
        if value is not None and len(value) != length:
            reason = (
                f"call() changes the state of {type(sub).__name__} {sub.name!r} (its {key[1]!r} went from {length} "
                f"to {len(value)} items), which a graph cannot record"
            )
            if isinstance(value, list) and len(value) > length:
                del value[length:]  # (what was appended: symbolic tensors, which must not stay in the model)
            lines, first = inspect.getsourcelines(type(layer).call)
            raise Untraceable(reason, _where(inspect.getsourcefile(type(layer).call), first, lines[0]))


def _takes(layer, argument: str) -> bool:
    try:
        parameters = inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        return False
    return argument in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _fresh_input(kt):
    return keras.Input(batch_shape=tuple(kt.shape), dtype=kt.dtype, sparse=kt.sparse, ragged=kt.ragged)


class Traced:
    """A layer's call traced: ``functional`` (a Functional model) whose inputs stand for ``given``, in order.

    ``fixed``: ``{id(node): training}`` of the calls in ``call()`` that pass
    a ``training`` of their own whatever the model is given
    (``self.base(x, training=False)``, the fine-tuning guide's inference-mode
    backbone): Keras' ``__call__`` keeps an argument its caller passes, so
    the graph runs those nodes (and every node nested in them) with it.
    """

    def __init__(self, layer, functional, given: list, args, kwargs):
        self.layer = layer
        self.functional = functional
        self.given = given
        self.args = args
        self.kwargs = kwargs
        self.fixed: dict = {}


def _trace_once(layer, args, kwargs, training, top: bool):
    given = [leaf for leaf in keras.tree.flatten((args, kwargs)) if isinstance(leaf, keras.KerasTensor)]
    fresh = {id(kt): _fresh_input(kt) for kt in given}
    converted = {}
    for kt in given:  # (as its own __call__ converts its inputs: a mixed precision policy's cast, an op node)
        value = fresh[id(kt)]
        if compat.converts_input_args(layer):
            value = layer.dtype_policy.convert_input(value, layer.autocast, layer.input_dtype)
        converted[id(kt)] = value
    new_args, new_kwargs = keras.tree.map_structure(lambda v: converted.get(id(v), v), (tuple(args), dict(kwargs)))
    new_kwargs = {k: v for k, v in new_kwargs.items() if k != "training"}
    if training is not None:
        new_kwargs["training"] = training
    before = _containers(layer)
    try:
        with _no_state_changes():
            outputs = layer.call(*new_args, **new_kwargs)
        _check_containers(layer, before)
    except Untraceable:
        raise
    except Exception as error:  # noqa: BLE001 - refused, with the reason and the line
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if len(message) > 160 and ". " in message:
            message = message.split(". ")[0]
        raise Untraceable(
            f"call() cannot run on symbolic tensors: {type(error).__name__}: {message}", _user_line(error)
        ) from error
    leaves = keras.tree.flatten(outputs)
    if not leaves or not all(isinstance(leaf, keras.KerasTensor) for leaf in leaves):
        raise Untraceable(
            "call() returns something other than tensors computed from its inputs "
            f"({[type(leaf).__name__ for leaf in leaves]})"
        )
    inputs = (
        keras.tree.map_structure(lambda v: fresh.get(id(v), v), args[0]) if top else [fresh[id(kt)] for kt in given]
    )
    try:
        functional = keras.Model(inputs, outputs, name=layer.name)
    except Exception as error:  # noqa: BLE001
        raise Untraceable(f"its traced graph is not a model of its inputs: {error}") from error
    return Traced(layer, functional, given, args, kwargs)


def _signature(functional) -> list:
    """What a trace calls, in order: each layer (by identity) or op (by type), and the ``training`` it was given."""
    rows = []
    for node in compat.execution_order(functional):
        operation = node.operation
        key = id(operation) if isinstance(operation, keras.layers.Layer) else type(operation).__name__
        rows.append((key, operation.name, node.arguments.kwargs.get("training")))
    return rows


def _captured_variables(functional) -> list:
    """Variables handed to a node as arguments (an op on ``self.kernel``): weights the graph would not train."""
    found = []
    for node in compat.execution_order(functional):
        for leaf in keras.tree.flatten((node.arguments.args, node.arguments.kwargs)):
            if isinstance(leaf, keras.Variable):
                found.append(leaf.path)
    return found


def trace_call(layer, args, kwargs, top: bool = False) -> Traced:
    """``layer.call(*args, **kwargs)`` on fresh symbolic inputs, as a Functional model; raises :class:`Untraceable`.

    ``args``/``kwargs`` hold ``KerasTensor``s (and any other values, passed
    as they are). A call taking ``training`` is traced with ``False`` and
    with ``True``, and refused where the two differ.
    """
    if layer.activity_regularizer is not None:
        raise Untraceable("it has an activity regularizer, applied to its outputs by its own __call__")
    for kt in keras.tree.flatten((args, kwargs)):
        if isinstance(kt, keras.KerasTensor) and compat.get_mask(kt) is not None:
            raise Untraceable("its input carries a Keras mask, which its own __call__ hands to call()")
    if _takes(layer, "training"):
        traced = _trace_once(layer, args, kwargs, False, top)
        trained = _trace_once(layer, args, kwargs, True, top)
        inference, training = _signature(traced.functional), _signature(trained.functional)
        if [row[0] for row in inference] != [row[0] for row in training]:
            raise Untraceable(
                "call() runs other layers or ops with training=True than with training=False (Python code on "
                "`training`), which one graph cannot hold"
            )
        nodes = compat.execution_order(traced.functional)
        for node, (_, name, off), (_, _, on) in zip(nodes, inference, training):
            if off == on and off is not None:
                traced.fixed[id(node)] = bool(off)  # (a training of its own, whatever the model's)
            elif off not in (None, False) or on not in (None, True):
                raise Untraceable(
                    f"call() calls {name!r} with training={off!r} when given training=False and training={on!r} "
                    "when given True; the graph runs a layer with the model's flag or with one of its own"
                )
    else:
        traced = _trace_once(layer, args, kwargs, None, top)
    captured = _captured_variables(traced.functional)
    if captured:
        raise Untraceable(
            f"call() uses the variables {captured[:3]} directly (not through the layer that holds them); keras_pipe "
            "places weights with the layers that call them"
        )
    own = _own_variables(layer)
    if own:
        raise Untraceable(f"it holds variables of its own ({own[:3]}), not in a sub-layer")
    return traced


def _own_variables(layer) -> list:
    inner = {id(v) for sub in compat.sublayers(layer) if sub is not layer for v in sub.variables}
    return [v.path for v in layer.variables if id(v) not in inner]


def view_of(model, inputs=None):
    """A subclassed model's Functional view: its ``call()`` traced on ``inputs`` (or its build shapes).

    Raises :class:`~keras_pipe.errors.PipelineConfigError` saying why, and at
    which line of the model's code, where the model cannot be traced.
    """
    if inputs is None:
        inputs = _inputs_of(model)
    try:
        traced = trace_call(model, (inputs,), {}, top=True)
    except Untraceable as error:
        raise PipelineConfigError(
            f"the subclassed model {model.name!r} ({type(model).__name__}) cannot be pipelined: {error.reason}"
            + (f"\n  {error.where}" if error.where else "")
            + "\nkeras_pipe runs call() on symbolic tensors (keras.KerasTensor) to find its graph: write it with "
            "keras.ops and layers, with no Python on tensor values, no tf.* op and no state set in call(), or "
            "build the model with keras.Model(inputs, outputs)."
        ) from error
    view = traced.functional
    object.__setattr__(view, "_keras_pipe_trace", traced)  # (untracked by Keras: see source_of)
    return view


def traced_of(functional) -> Traced | None:
    """The :class:`Traced` a view was made from by :func:`view_of`, or ``None``."""
    return getattr(functional, "_keras_pipe_trace", None)


def source_of(functional):
    """The subclassed model a view was traced from (its weights' order is the model's), or ``None``."""
    traced = traced_of(functional)
    return None if traced is None else traced.layer


def check_view(view) -> str | None:
    """:func:`check_on_batch` of a view made by :func:`view_of`: ``None``, or the refusal's whole message."""
    traced = view._keras_pipe_trace
    if not allocated(traced.layer):
        return None  # (its weights exist nowhere whole, keras_pipe.unallocated(): the symbolic checks alone)
    problem = check_on_batch(traced)
    if problem is None:
        return None
    model = traced.layer
    return (
        f"the subclassed model {model.name!r} ({type(model).__name__}) cannot be pipelined: its call() traced on "
        f"symbolic tensors differs from call() on a real batch ({problem}): it does something a graph cannot record "
        "(Python on tensor values or on its own state). Write call() with keras.ops and layers only, or build the "
        "model with keras.Model(inputs, outputs)."
    )


def _inputs_of(model):
    """Symbolic inputs for a built subclassed model: its ``inputs`` if it has them, else its build shapes."""
    known = compat.known_input_structure(model)
    if known is not None:
        return keras.tree.map_structure(_fresh_input, known)
    shapes = compat.build_shapes(model)
    if not model.built or not shapes or len(shapes) != 1:
        why = (
            "Keras recorded none when it was called (it could not run its call() on symbolic tensors either)"
            if model.built
            else "it is not built"
        )
        raise PipelineConfigError(
            f"the subclassed model {model.name!r} ({type(model).__name__}) has no known input shape ({why}): "
            "build it (model.build(shape)) before from_model, or pass "
            "from_model(model, inputs=keras.Input(shape, dtype=...))."
        )
    shape = next(iter(shapes.values()))
    dtype = model.input_dtype

    def one(s):
        return keras.Input(batch_shape=(None, *tuple(s)[1:]), dtype=dtype)

    if isinstance(shape, dict):
        return {key: one(s) for key, s in shape.items()}
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
        return [one(s) for s in shape]
    return one(shape)


# -- the check on real tensors -------------------------------------------------


def _sample(kt, rng):
    shape = tuple(2 if k == 0 else (3 if d is None else d) for k, d in enumerate(kt.shape))
    dtype = keras.backend.standardize_dtype(kt.dtype)
    if "float" in dtype:
        return keras.ops.convert_to_tensor(rng.normal(size=shape).astype(dtype))
    return keras.ops.ones(shape, dtype=dtype)


def allocated(layer) -> bool:
    return all(not compat.unallocated(v) for v in layer.variables)


def check_on_batch(traced: Traced) -> str | None:
    """Runs the traced graph and the real ``call()`` (``__call__``) on one small batch, inference mode.

    Twice where the first input is a sequence (rank 3 or more): as it is,
    and with a Keras mask on it (its last step masked), as an embedding with
    ``mask_zero`` hands it on, since a layer may read its input's mask in
    ``call()``, which the trace (on unmasked symbolic tensors) cannot see.
    Returns ``None`` where they agree (to float round-off), else what differs.
    """
    rng = np.random.default_rng(0)
    real = {id(kt): _sample(kt, rng) for kt in traced.given}
    problem = _compare(traced, real)
    first = traced.given[0] if traced.given else None
    if problem is None and first is not None and len(first.shape) >= 3:
        value = real[id(first)]
        mask = np.ones(tuple(value.shape[:2]), bool)
        mask[:, -1] = False
        compat.set_mask(value, keras.ops.convert_to_tensor(mask))
        problem = _compare(traced, real)
        if problem is not None:
            problem += ", with a Keras mask on its input"
    return problem


def _compare(traced: Traced, real: dict) -> str | None:
    args, kwargs = keras.tree.map_structure(lambda v: real.get(id(v), v), (tuple(traced.args), dict(traced.kwargs)))
    kwargs = {k: v for k, v in kwargs.items() if k != "training"}
    if _takes(traced.layer, "training"):
        kwargs["training"] = False
    try:
        with warnings.catch_warnings():  # (a layer that drops the test's mask says so, once per call)
            warnings.simplefilter("ignore")
            expected = keras.tree.flatten(traced.layer(*args, **kwargs))
            flat = [real[id(kt)] for kt in traced.given]
            structured = keras.tree.pack_sequence_as(compat.input_structure(traced.functional), flat)
            got = keras.tree.flatten(traced.functional(structured, training=False))
    except Exception as error:  # noqa: BLE001 - a difference, said
        return f"running it on a real batch failed: {type(error).__name__}: {str(error)[:200]}"
    if len(got) != len(expected):
        return f"the traced graph returns {len(got)} tensors, call() {len(expected)}"
    for k, (a, b) in enumerate(zip(got, expected)):
        masks = [compat.get_mask(t) for t in (a, b)]
        if (masks[0] is None) != (masks[1] is None) or (
            masks[0] is not None
            and not np.array_equal(keras.ops.convert_to_numpy(masks[0]), keras.ops.convert_to_numpy(masks[1]))
        ):
            return f"output {k}: the traced graph's Keras mask is not call()'s"
        a, b = np.asarray(keras.ops.convert_to_numpy(a)), np.asarray(keras.ops.convert_to_numpy(b))
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {k}: the traced graph gives {a.dtype}{list(a.shape)}, call() {b.dtype}{list(b.shape)}"
        half = "float" in str(b.dtype) and b.dtype.itemsize < 4  # (float16, bfloat16: their own round-off)
        if "float" in str(b.dtype):
            a, b = a.astype("float64"), b.astype("float64")
        if not np.issubdtype(b.dtype, np.number):
            if not np.array_equal(a, b):
                return f"output {k}: the traced graph computes other values than call()"
            continue
        scale = float(np.max(np.abs(b))) if b.size else 1.0
        rtol = 2e-2 if half else 1e-4
        if not np.allclose(a, b, rtol=rtol, atol=rtol * 0.1 * max(1.0, scale), equal_nan=True):
            difference = float(np.max(np.abs(a - b)))
            return f"output {k}: the traced graph computes other values than call() (max difference {difference:.3g})"
    return None
