"""Internal: Keras' Functional model's internals: its nodes in order, calling one, and its inputs as it takes them.

The pipeline runs a Functional model's graph node by node (``execution_order``,
``call_operation``); every rank checks a batch's inputs as the model's call
would (``check_input_shapes``), so that every rank raises Keras' own error.
"""

from __future__ import annotations

import keras


def execution_order(functional) -> list:
    """A Functional model's nodes in the order ``Functional._run_through_graph`` runs them (Keras 3.0-3.15).

    ``_nodes_by_depth``, deepest first, input nodes left out. Why: the
    pipeline cuts this order into stages and runs each stage's part of it.
    """
    order = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                order.append(node)
    return order


def call_operation(operation, args, kwargs, training):
    """Calls a graph node's operation as ``Functional.call`` does (``functional.operation_fn``, Keras 3.9-3.15).

    ``training`` goes to the operations whose call takes it (their
    ``_call_context_args``); everything else as the node recorded it.
    """
    from keras.src.models.functional import operation_fn

    return operation_fn(operation, training=training)(*args, **kwargs)


def is_functional(model) -> bool:
    """Whether ``model`` is a Functional model, a subclass (keras_hub's task models) included
    (``keras.src.models.functional.Functional``, Keras 3.0-3.15; the class is not exported)."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def sequential_functional(model):
    """The Functional graph a built ``Sequential`` runs (``Sequential._functional``, Keras 3.0-3.15), or ``None``."""
    return getattr(model, "_functional", None)


def standardize_inputs(functional, x) -> list:
    """A batch's model inputs, flat, as ``Functional.call`` converts them (``_standardize_inputs``, Keras 3.0-3.15).

    Why: a dict, a list or one array, converted to each input's dtype, with
    Keras' rank adjustments, exactly as the unsplit model takes them.
    """
    return list(functional._standardize_inputs(x))


def input_shape_argument(layer):
    """A layer's legacy ``input_shape=``/``input_dim=`` (``Layer._input_shape_arg``, Keras 3.0-3.15)."""
    return getattr(layer, "_input_shape_arg", None) if isinstance(layer, keras.layers.Layer) else None


def flat_inputs(functional, inputs) -> list:
    """``inputs`` flat, in the order of ``functional.inputs``, as ``Functional._standardize_inputs`` orders them.

    Why: a dict given to a model whose inputs are a list (keras_hub's
    Gemma3n task calls its backbone, built on ``[token_ids,
    padding_mask]``, with a dict) is read by the inputs' names, not in the
    dict's sorted order (Keras 3.15).
    """
    struct = functional._inputs_struct
    if isinstance(inputs, dict) and not isinstance(struct, dict):
        names = [t.name for t in keras.tree.flatten(struct)]
        if set(names) <= set(inputs):
            return [inputs[name] for name in names]
    return keras.tree.flatten(inputs)


def check_input_structure(functional, x, name: str | None = None) -> None:
    """Raises as a Functional model's call does for inputs of another structure (Keras 3.15).

    A dict without one of the inputs' names, more or fewer arrays than
    inputs, something that is not an array, ``None`` for an input that is
    not ``optional=True`` (``Functional._assert_input_compatibility`` and
    ``keras.src.layers.input_spec.assert_input_compatibility``), and the
    structure's own error (``Functional._standardize_inputs``,
    ``_maybe_warn_inputs_struct_mismatch``): on every rank, where only the
    first stage standardizes the inputs (see :func:`check_input_shapes`;
    the structure's warning is the first stage's alone).
    """
    from keras.src.layers.input_spec import assert_input_compatibility

    name = name or functional.name
    if isinstance(x, (dict, list, tuple)) or hasattr(x, "shape"):
        for given, tensor in zip(flat_inputs(functional, x), functional.inputs):
            layer = tensor._keras_history.operation
            if given is None and not getattr(layer, "optional", False):
                raise ValueError(
                    f"The input '{tensor.name}' is not optional, but None was passed. Please provide a valid tensor."
                )
    _check_structure_as_keras_does(functional, x)
    assert_input_compatibility(functional.input_spec, x, name)


def _check_structure_as_keras_does(functional, inputs) -> None:
    """The part of ``Functional._standardize_inputs`` before conversion: its structure error, on every rank."""
    struct, raise_exception = functional._inputs_struct, False
    array = hasattr(inputs, "shape") and not isinstance(inputs, (dict, list, tuple))  # (NumPy too: Keras sees tensors)
    if isinstance(struct, list) and len(struct) == 1 and array:
        inputs = [inputs]
    elif isinstance(inputs, dict) and not isinstance(struct, dict):
        if hasattr(struct, "__len__") and all(isinstance(i, keras.KerasTensor) for i in struct):
            if {i.name for i in struct} <= set(inputs):
                inputs = [inputs[i.name] for i in struct]
            else:
                raise_exception = True
        elif isinstance(struct, keras.KerasTensor):
            if struct.name in inputs:
                inputs = [inputs[struct.name]]
            else:
                raise_exception = True
        else:
            raise_exception = True
    if isinstance(struct, dict) and not isinstance(inputs, dict) and list(struct) != sorted(struct):
        raise_exception = True
    if raise_exception:  # (the warning alone is left to the first stage's standardization: Keras' count of them)
        functional._maybe_warn_inputs_struct_mismatch(inputs, raise_exception=True)


def check_input_shapes(functional, x) -> list:
    """Raises, in Keras' words (``InputSpec``'s check, ``Functional._adjust_input_rank``), for inputs that do not fit.

    Keras 3.15: the inputs' structure as :func:`check_input_structure` checks
    it; the same shapes as the model's input spec (the fixed sizes equal), or
    one more or one less trailing axis of size 1. Returns the inputs, flat.

    Why: only the first stage converts a batch (``standardize_inputs``), so
    only it would find out; every rank checks the shapes alone (no
    conversion), so that every rank raises the same error.
    """
    check_input_structure(functional, x)
    flat = flat_inputs(functional, x)
    struct = functional._inputs_struct
    for index, (given, ref) in enumerate(zip(flat, functional.inputs)):
        if given is None or not hasattr(given, "shape"):
            continue
        shape, ref_shape = tuple(given.shape), tuple(ref.shape)
        if len(shape) == len(ref_shape):
            fixed = [(a, b) for a, b in zip(shape[1:], ref_shape[1:]) if a is not None and b is not None]
            if all(a == b for a, b in fixed):
                continue
            # (Keras' words, as its InputSpec check says them)
            raise ValueError(
                f"Input {index} with name '{ref.name}' of layer '{functional.name}' is incompatible with the layer: "
                f"expected shape={ref_shape}, found shape={shape}"
            )
        if len(shape) == len(ref_shape) + 1 and shape[-1] == 1:
            continue
        if len(shape) == len(ref_shape) - 1 and ref_shape[-1] == 1:
            continue
        path = ".".join(str(p) for p in keras.tree.flatten_with_path(struct)[index][0])
        raise ValueError(  # (as _adjust_input_rank says it, less the whole array)
            f"Invalid input shape for input with name '{ref.name}' and path '{path}'. Expected shape {ref_shape}, "
            f"but input has incompatible shape {shape}"
        )
    return flat


def known_input_structure(model):
    """A model's ``_inputs_struct`` if Keras recorded one (Keras 3.0-3.15: a Functional model's, or a subclassed
    model's after its first call), else ``None``."""
    return getattr(model, "_inputs_struct", None)


def build_shapes(model) -> dict | None:
    """``_build_shapes_dict`` (Keras 3.0-3.15): the shapes a layer was built with, by argument name, or ``None``."""
    return getattr(model, "_build_shapes_dict", None)


def input_structure(functional):
    """A Functional model's ``_inputs_struct`` (Keras 3.0-3.15): the structure its call takes its inputs in."""
    return functional._inputs_struct


def output_structure(functional):
    """A Functional model's ``_outputs_struct`` (Keras 3.0-3.15): the structure of its outputs."""
    return functional._outputs_struct
