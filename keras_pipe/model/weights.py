"""The whole model's weights across stages and replicas: gather, assign, copy between replicas.

Each rank holds only its stage's weights; these helpers give the view of
the unsplit model (``get_weights``/``set_weights``, in the order of its
``weights``) and keep a stage's replicas identical. A weight several stages
hold (a layer called on each of them) appears once, answered for by the
first stage holding it. All of them are collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError, PipelineIOError


def ordered(engine) -> list[tuple]:
    """``(variable, owner stage, held here)`` for each weight of the model, in ``model.weights`` order."""
    held = set(engine.stage_units())
    result = []
    for unit, index in engine.graph.weight_order:
        variable = engine.graph.units[unit].weights[index]
        result.append((variable, engine.owner_of(unit), unit in held))
    return result


def stage_weights(engine) -> list:
    """This stage's variables, in the model's order (a weight held by several stages, on each of them)."""
    return [variable for variable, _, here in ordered(engine) if here]


def gather(engine) -> list[np.ndarray]:
    """Every weight of the model in ``model.weights`` order, on every rank, from the first replica's stages."""
    return [_bcast_from_owner(engine, variable, owner) for variable, owner, _ in ordered(engine)]


def gather_variables(engine, variables: list) -> list[np.ndarray]:
    """The values of some of the model's ``variables``, on every rank, from the first replica's stages holding them."""
    owners = {id(variable): owner for variable, owner, _ in ordered(engine)}  # (in the model's order, as gather)
    missing = [v.path for v in variables if id(v) not in owners]
    if missing:
        raise PipelineConfigError(f"{missing[:3]} are not weights of the pipeline's model.")
    return [_bcast_from_owner(engine, variable, owners[id(variable)]) for variable in variables]


def _bcast_from_owner(engine, variable, owner: int) -> np.ndarray:
    """``variable``'s value on every rank, from the first replica's rank of stage ``owner`` (collective)."""
    if owner == engine.stage and engine.replica == 0:
        array = np.asarray(variable.numpy())
    else:
        array = np.empty(tuple(variable.shape), np.dtype(variable.dtype))
    if engine.world.size > 1:
        array = engine.world.bcast_array(array, root=engine.layout.rank_of(0, owner))
    return array


def assign(engine, weights: Sequence[np.ndarray]) -> None:
    """Sets this rank's stage from rank 0's ``weights`` (in ``model.weights`` order, checked against the shapes).

    Rank 0's list is the model, as Horovod's broadcast makes it: an unseeded
    script whose ranks each built their own random model trains rank 0's.
    """
    entries = ordered(engine)
    if len(weights) != len(entries):
        raise PipelineConfigError(f"set_weights got {len(weights)} arrays but the model has {len(entries)} weights.")
    for index, ((variable, _, _), value) in enumerate(zip(entries, weights)):
        if tuple(np.shape(value)) != tuple(variable.shape):
            raise PipelineConfigError(
                f"set_weights: weight {index} ({variable.path}) has shape {tuple(np.shape(value))}, expected "
                f"{tuple(variable.shape)}."
            )
    for (variable, _, here), value in zip(entries, weights):
        value = np.array(value, dtype=np.dtype(variable.dtype))  # (ascontiguousarray makes a scalar 1-d)
        if engine.world.size > 1:
            value = engine.world.bcast_array(value, root=0)
        if here:
            variable.assign(value)


def copy_from_first_replica(engine, optimizer=None) -> None:
    """Gives every replica of this stage the first replica's weights (no-op with one replica).

    With an ``optimizer``, its state too (after loading).
    """
    replicas = engine.replicas
    if replicas is None or not engine.built:
        return
    engine.world.doing = "copying the first replica's weights to the other replicas"
    variables = stage_weights(engine)
    if optimizer is not None and replicas.bcast_json(bool(optimizer.built), root=0):
        if not optimizer.built:
            optimizer.build(engine.trainable_variables)
        variables += list(optimizer.variables)
    for variable in variables:
        value = replicas.bcast_array(np.array(variable.numpy()), root=0)
        if engine.replica:
            variable.assign(value)


def copy_between_holders(engine) -> None:
    """A weight several stages hold starts alike on each: the first holder's value (collective over the pipeline).

    ``cut.shared`` names the virtual stages holding a unit; with several
    chunks a rank those are not the ranks (interleaved 1F1B on 2 ranks puts
    virtual stage 3 on rank 1), so the holders are counted in ranks. Where one
    rank holds every copy (ZB-V's first and last chunk) nothing travels.
    """
    shared = engine.cut.shared
    if not shared or engine.num_stages == 1:
        return
    holders = engine.holder_ranks()
    # (ordered() lists the weights in graph.weight_order's order: each weight's unit is that entry's)
    for (unit, _), (variable, owner, here) in zip(engine.graph.weight_order, ordered(engine)):
        if unit not in shared or holders[unit] == {owner}:
            continue
        array = (
            np.asarray(variable.numpy())
            if engine.stage == owner
            else np.empty(tuple(variable.shape), np.dtype(variable.dtype))
        )
        array = engine.pipeline.bcast_array(array, root=owner)
        if here and engine.stage != owner and engine.stage in holders[unit]:
            variable.assign(array)


def load_deferred(engine, model) -> None:
    """The weights files loaded into ``model`` (or a model nested in it) while it had no memory, now read (collective).

    A keras_hub ``from_preset`` (or a ``load_weights``) inside
    :func:`keras_pipe.unallocated` is recorded, not run (see
    :func:`keras_pipe.compat.unallocated_scope`). Once each rank holds its own
    stage, each rank runs Keras' own load of each file over the whole model,
    reading and assigning only the variables it holds; an error on any rank
    (a missing file, a shape that differs) is raised on every rank, naming it.
    """
    loads = [(sub, load) for sub in compat.sublayers(model) for load in sub.__dict__.get(compat.DEFERRED_LOADS, [])]
    if not loads:
        return

    def load():
        for sub, (filepath, skip_mismatch, objects_to_skip) in loads:
            compat.load_weights_only(sub, filepath, skip_mismatch, objects_to_skip)

    read_held(engine, load, f"loading the weights recorded while {model.name!r} was created unallocated")
    for sub, _ in loads:
        object.__setattr__(sub, compat.DEFERRED_LOADS, [])


def read_held(engine, load, what: str) -> None:
    """``load()`` (Keras reading a file into the model) on every rank, each reading only what it holds (collective).

    An error on any rank (a missing file, a shape that differs) is raised
    on every rank, naming the rank.
    """
    problem = None
    try:
        with compat.held_only_loading():
            load()
    except Exception as error:  # noqa: BLE001 - every rank raises the first rank's error
        problem = f"rank {engine.world.rank}: {type(error).__name__}: {error}"
    problems = [problem] if engine.world.size == 1 else engine.world.allgather_json(problem)
    problems = [p for p in problems if p]
    if problems:
        raise PipelineIOError(f"{what} failed: {problems[0]}")
