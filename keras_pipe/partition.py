"""Splitting a list of layers into contiguous stages, one per rank.

Every rank knows the whole model's shapes without creating the weights of
layers it does not own: each layer's output shape and parameter count come
from a throw-away copy built symbolically inside a ``StatelessScope`` whose
variables are never allocated (:func:`keras_pipe.compat.unallocated_scope`),
so no memory is spent on other stages' weights, not even for a moment.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import keras

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.microbatch import bounds_of


@dataclass(frozen=True)
class LayerSpec:
    """What every rank knows about one layer, without owning it."""

    name: str
    class_name: str
    input_shape: tuple
    input_dtype: str
    output_shape: tuple
    output_dtype: str
    num_params: int
    weight_shapes: tuple  # ((shape, dtype), ...) in ``layer.weights`` order
    trainable_shapes: tuple  # the same for ``layer.trainable_weights``
    output_mask_shape: tuple | None = None  # the Keras mask the output carries (it crosses a boundary with it)
    # Where a layer takes or returns several tensors (a tuple, list or dict): their structure, as
    # KerasTensors (the shapes above are then the structure's shapes, for display); None for one tensor.
    input_template: object = None
    output_template: object = None


def infer_specs(layers: Sequence[keras.layers.Layer], input_shape: tuple, input_dtype: str) -> list[LayerSpec]:
    """Output shape, dtype and weights of every layer of a chain, allocating nothing.

    Args:
        layers: the chain, in order.
        input_shape: the model's input shape, batch dimension included (``None``).
        input_dtype: the model's input dtype.

    Returns:
        One :class:`LayerSpec` per layer.
    """
    specs = []
    x = keras.KerasTensor(tuple(input_shape), input_dtype)
    mask = None
    for index, layer in enumerate(layers):
        probe = shadow_copy(layer)
        try:
            # Symbolic, and the probe's weights are never allocated: a rank must
            # not hold the whole model's weights, even for a moment.
            with compat.unallocated_scope():
                y = probe(x) if probe is not None else layer.compute_output_spec(x)
                if probe is not None:
                    mask = compat.get_mask(y)
                else:
                    mask = layer.compute_mask(x, mask) if layer.supports_masking and mask is not None else None
        except Exception as error:  # noqa: BLE001 - re-raised with context
            raise PipelineConfigError(
                f"layer {index} ({layer.name}, {type(layer).__name__}) cannot be called on an input of "
                f"shape {_shapes(x)} and dtype {_dtype(x)}: {error}"
            ) from error
        leaves = keras.tree.flatten(y)
        if not leaves or not all(isinstance(leaf, keras.KerasTensor) for leaf in leaves):
            raise PipelineConfigError(
                f"layer {index} ({layer.name}, {type(layer).__name__}) returns {type(y).__name__}; "
                "a pipeline stage boundary needs a tensor, or a tuple, list or dict of tensors."
            )
        several = not isinstance(y, keras.KerasTensor)
        if several and index == len(layers) - 1:
            raise PipelineConfigError(
                f"the last layer ({layer.name}, {type(layer).__name__}) returns {len(leaves)} tensors; a "
                "PipelineModel has one output, as keras.Sequential: end the chain with a layer that returns one."
            )
        if several:
            mask = None  # (masks ride on single tensors)
        weights = probe.weights if probe is not None and (probe is not layer or layer.built) else []
        trainable = probe.trainable_weights if probe is not None and (probe is not layer or layer.built) else []
        specs.append(
            LayerSpec(
                name=layer.name,
                class_name=type(layer).__name__,
                input_shape=_shapes(x),
                input_dtype=_dtype(x),
                output_shape=_shapes(y),
                output_dtype=_dtype(y),
                num_params=int(sum(_size(w.shape) for w in weights)),
                weight_shapes=tuple((tuple(w.shape), str(w.dtype)) for w in weights),
                trainable_shapes=tuple((tuple(w.shape), str(w.dtype)) for w in trainable),
                output_mask_shape=None if mask is None else tuple(mask.shape),
                input_template=None if isinstance(x, keras.KerasTensor) else x,
                output_template=y if several else None,
            )
        )
        x = keras.tree.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype), y)
        if mask is not None:
            compat.set_mask(x, mask)
    return specs


def _shapes(x) -> tuple:
    """A tensor's shape; for several tensors, their shapes (for messages and ``summary``)."""
    if isinstance(x, keras.KerasTensor):
        return tuple(x.shape)
    return tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(x))


def _dtype(x) -> str:
    return str(keras.tree.flatten(x)[0].dtype)


def shadow_copy(layer: keras.layers.Layer) -> keras.layers.Layer | None:
    """An unbuilt copy of ``layer`` to probe shapes on; the layer itself if it has no weights to create.

    ``None`` for a layer that cannot be copied but creates no weights (no
    ``build()`` of its own): its output spec is computed without building it.
    """
    if layer.built and not layer.weights:
        return layer
    if type(layer).build is keras.layers.Layer.build:
        try:
            return copy_layer(layer)
        except PipelineConfigError:
            return None
    return copy_layer(layer)


def copy_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A new layer like ``layer``, with the same trainable flag: from its config, else a deep copy.

    A ``Lambda`` holding a Python lambda, or a custom layer whose
    ``__init__`` takes no ``**kwargs``, cannot be re-created from its config
    (Keras refuses the first, the second's constructor rejects ``name``);
    a deep copy of the object works for both.
    """
    try:
        clone = type(layer).from_config(layer.get_config())
    except Exception as config_error:  # noqa: BLE001 - the deep copy is the fallback
        try:
            clone = copy.deepcopy(layer)
        except Exception as copy_error:  # noqa: BLE001
            raise PipelineConfigError(
                f"layer {layer.name!r} ({type(layer).__name__}) can be neither re-created from its config "
                f"({config_error}) nor deep-copied ({copy_error}); keras_pipe copies a layer to infer shapes on "
                "the ranks that do not own it. Give the layer a get_config() whose keys its __init__ accepts."
            ) from copy_error
    clone.trainable = layer.trainable
    return clone


def copy_unless_weightless(layer: keras.layers.Layer) -> keras.layers.Layer:
    """``layer`` itself if it holds no weights or cannot be copied, else an unbuilt copy (for ``from_sequential``)."""
    if layer.built and not layer.weights:
        return layer
    try:
        return copy_layer(layer)
    except PipelineConfigError:
        return layer  # its weights stay alive on every rank; correct, if not frugal


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def balance_by_params(specs: Sequence[LayerSpec], num_stages: int) -> list[int]:
    """Layers per stage so that the stages' parameter counts are as even as possible.

    Contiguous split minimising the largest stage's cost, where a layer costs
    its parameters plus one (so that layers without weights still spread out).
    Every stage gets at least one layer.

    Example: four equal layers on two stages give ``[2, 2]``.
    """
    costs = [spec.num_params + 1 for spec in specs]
    return min_max_partition(costs, num_stages)


def min_max_partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous sizes, each at least 1, minimising the largest stage's summed cost."""
    n = len(costs)
    check_num_stages(n, num_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-cost splitting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def check_num_stages(num_layers: int, num_stages: int) -> None:
    """Raises unless every stage can get at least one layer."""
    if num_stages > num_layers:
        raise PipelineConfigError(
            f"{num_stages} ranks but the model has only {num_layers} layers; every stage needs at least "
            f"one layer. Run with at most {num_layers} ranks (mpirun -n {num_layers}) or add layers."
        )


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validates a user-given ``balance`` (layers per stage) and returns it as a list."""
    if isinstance(balance, str) or not hasattr(balance, "__len__"):
        raise PipelineConfigError(
            f"balance={balance!r}: give None (balance parameters), 'time' (balance measured time) "
            "or a list with the number of layers of each stage."
        )
    balance = list(balance)
    if len(balance) != num_stages:
        raise PipelineConfigError(
            f"balance {balance} has {len(balance)} stages but the job has {num_stages} ranks; "
            f"give one entry per rank (mpirun -n {len(balance)}) or use balance=None."
        )
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in balance):
        raise PipelineConfigError(f"balance {balance} must hold positive integers: every stage needs a layer.")
    if sum(balance) != num_layers:
        raise PipelineConfigError(
            f"balance {balance} covers {sum(balance)} layers but the model has {num_layers} "
            "(a leading keras.Input is not a layer)."
        )
    return balance


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, stop)`` layer indices of each stage.

    >>> stage_bounds([2, 3])
    [(0, 2), (2, 5)]
    """
    return bounds_of(balance)


def summary_lines(specs: Sequence[LayerSpec], balance: Sequence[int]) -> list[str]:
    """A table of every layer with its stage, output shape and parameters, and the parameters per stage."""
    bounds = stage_bounds(balance)
    rows = [("Layer (type)", "Stage", "Output Shape", "Param #")]
    for stage, (start, stop) in enumerate(bounds):
        for spec in specs[start:stop]:
            rows.append(
                (f"{spec.name} ({spec.class_name})", str(stage), str(spec.output_shape), f"{spec.num_params:,}")
            )
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    rule = "-" * (sum(widths) + 6)
    lines = [rule]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append(rule)
    per_stage = [sum(spec.num_params for spec in specs[a:b]) for a, b in bounds]
    lines += [rule, f"Total params: {sum(per_stage):,}"]
    lines.append("Params per stage: " + ", ".join(f"{s}: {n:,}" for s, n in enumerate(per_stage)))
    return lines
