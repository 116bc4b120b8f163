"""The whole model's weights across stages and replicas: gather, assign, copy between replicas.

Each rank holds only its stage's weights; these helpers give the
``Sequential``-ordered view (``get_weights``/``set_weights``) and keep a
stage's replicas identical. All of them are collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_pipe import partition
from keras_pipe.errors import PipelineConfigError


def gather(engine) -> list[np.ndarray]:
    """Every layer's weights in layer order, on every rank, from the first replica's stages."""
    weights = []
    for stage, (start, stop) in enumerate(partition.stage_bounds(engine.balance)):
        shapes = [w for spec in engine.specs[start:stop] for w in spec.weight_shapes]
        if stage == engine.stage and engine.replica == 0:
            local = [np.asarray(v.numpy()) for v in engine.stage_weights()]
        else:
            local = [np.empty(shape, dtype) for shape, dtype in shapes]
        if engine.world.size > 1:
            owner = engine.layout.rank_of(0, stage)
            local = [engine.world.bcast_array(array, root=owner) for array in local]
        weights.extend(local)
    return weights


def assign(engine, weights: Sequence[np.ndarray]) -> None:
    """Sets this rank's stage from rank 0's ``Sequential``-ordered ``weights`` (checked against the model's shapes).

    Rank 0's list is the model, as Horovod's broadcast makes it: an unseeded
    script whose ranks each built their own random ``Sequential`` trains
    rank 0's.
    """
    shapes = [w for spec in engine.specs for w in spec.weight_shapes]
    if len(weights) != len(shapes):
        raise PipelineConfigError(f"set_weights got {len(weights)} arrays but the model has {len(shapes)} weights.")
    for index, ((shape, _), value) in enumerate(zip(shapes, weights)):
        if tuple(np.shape(value)) != tuple(shape):
            raise PipelineConfigError(
                f"set_weights: weight {index} has shape {tuple(np.shape(value))}, expected {tuple(shape)}."
            )
    offset = engine.weight_offset()
    mine = engine.stage_weights()
    for index, (_, dtype) in enumerate(shapes):
        value = np.array(weights[index], dtype=dtype)  # (ascontiguousarray makes a scalar 1-d)
        if engine.world.size > 1:
            value = engine.world.bcast_array(value, root=0)
        if offset <= index < offset + len(mine):
            mine[index - offset].assign(value)


def copy_from_first_replica(engine, optimizer=None) -> None:
    """Gives every replica of this stage the first replica's weights (no-op with one replica).

    With an ``optimizer``, its state too (after loading).
    """
    replicas = engine.replicas
    if replicas is None or not engine.built:
        return
    engine.world.doing = "copying the first replica's weights to the other replicas"
    variables = engine.stage_weights()
    if optimizer is not None and replicas.bcast_json(bool(optimizer.built), root=0):
        if not optimizer.built:
            optimizer.build(engine.compute.trainable_variables)
        variables += list(optimizer.variables)
    for variable in variables:
        value = replicas.bcast_array(np.array(variable.numpy()), root=0)
        if engine.replica:
            variable.assign(value)
