"""The whole model's weights across stages and replicas: gather, assign, copy between replicas.

Each rank holds only its stage's weights; these helpers give the
``Sequential``-ordered view (``get_weights``/``set_weights``) and keep a
stage's replicas identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_pipe import partition
from keras_pipe.errors import PipelineConfigError
from keras_pipe.failure import mark_collective


def gather(model) -> list[np.ndarray]:
    """Every layer's weights in layer order, on every rank, from the first replica's stages (collective)."""
    weights = []
    for stage, (start, stop) in enumerate(partition.stage_bounds(model.balance)):
        layouts = [w for spec in model._specs[start:stop] for w in spec.weight_shapes]
        if stage == model.stage_index and model.replica_index == 0:
            local = [np.asarray(v.numpy()) for v in _stage_weights(model)]
        else:
            local = [np.empty(shape, dtype) for shape, dtype in layouts]
        if model._comm.size > 1:
            owner = model._layout.rank_of(0, stage)
            local = [model._comm.bcast_array(array, root=owner) for array in local]
        weights.extend(local)
    return weights


def assign(model, weights: Sequence[np.ndarray]) -> None:
    """Sets this rank's stage from ``Sequential``-ordered ``weights`` (checked against the model's shapes)."""
    layouts = [w for spec in model._specs for w in spec.weight_shapes]
    if len(weights) != len(layouts):
        raise mark_collective(
            PipelineConfigError(f"set_weights got {len(weights)} arrays but the model has {len(layouts)} weights.")
        )
    for index, ((shape, _), value) in enumerate(zip(layouts, weights)):
        if tuple(np.shape(value)) != tuple(shape):
            raise mark_collective(
                PipelineConfigError(
                    f"set_weights: weight {index} has shape {tuple(np.shape(value))}, expected {tuple(shape)}."
                )
            )
    start, _ = partition.stage_bounds(model.balance)[model.stage_index]
    offset = sum(len(spec.weight_shapes) for spec in model._specs[:start])
    for variable in _stage_weights(model):
        variable.assign(weights[offset])
        offset += 1


def copy_from_first_replica(model, optimizer: bool = False) -> None:
    """Gives every replica of this stage the first replica's weights (collective; no-op with one replica).

    With ``optimizer=True``, the optimizer's state too (after loading).
    """
    replicas = model._replicas
    if replicas is None or model._stage is None:
        return
    model._comm.activity = "copying the first replica's weights to the other replicas"
    variables = _stage_weights(model)
    if optimizer and replicas.bcast_json(
        bool(model.compiled and model.optimizer is not None and model.optimizer.built), root=0
    ):
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        variables += list(model.optimizer.variables)
    for variable in variables:
        value = replicas.bcast_array(np.array(variable.numpy()), root=0)
        if model.replica_index:
            variable.assign(value)


def _stage_weights(model) -> list:
    return [v for layer in model._stage.layers for v in layer.weights]
