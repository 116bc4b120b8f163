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
from keras_pipe.mpi.comm import TAG_STATE, aligned_empty


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


def copy_from_first_replica(engine, optimizer=None, loaded=frozenset()) -> None:
    """Gives every replica of this stage the first replica's weights (no-op with one replica).

    With an ``optimizer``, its state too (after loading). ``loaded``: the ids
    of weights every rank has just read from one file (:func:`load_deferred`),
    alike already.
    """
    replicas = engine.replicas
    if replicas is None or not engine.built:
        return
    engine.world.doing = "copying the first replica's weights to the other replicas"
    variables = [variable for variable in stage_weights(engine) if id(variable) not in loaded]
    if optimizer is not None and replicas.bcast_json(bool(optimizer.built), root=0):
        if not optimizer.built:
            optimizer.build(engine.trainable_variables)
        variables += list(optimizer.variables)
    for variable in variables:
        value = replicas.bcast_array(np.array(variable.numpy()), root=0)
        if engine.replica:
            variable.assign(value)


def copy_between_holders(engine, loaded=frozenset()) -> None:
    """A weight several stages hold starts alike on each: the first holder's value (collective over the pipeline).

    ``cut.shared`` names the virtual stages holding a unit; with several
    chunks a rank those are not the ranks (interleaved 1F1B on 2 ranks puts
    virtual stage 3 on rank 1), so the holders are counted in ranks. Where one
    rank holds every copy (ZB-V's first and last chunk) nothing travels. The
    first holder sends the value to the other holders alone, one weight at a
    time: a rank that does not hold it receives nothing (a broadcast over the
    pipeline gave every rank a copy of each shared weight, a language model's
    embedding tables, for a moment). ``loaded``: the ids of weights every rank
    has just read from one file (:func:`load_deferred`), alike already.
    """
    shared = engine.cut.shared
    if not shared or engine.num_stages == 1:
        return
    holders = engine.holder_ranks()
    pipeline = engine.pipeline
    pipeline.doing = "copying the weights several stages hold from their first holder"
    # (ordered() lists the weights in graph.weight_order's order: each weight's unit is that entry's)
    for (unit, _), (variable, owner, here) in zip(engine.graph.weight_order, ordered(engine)):
        if unit not in shared or holders[unit] == {owner} or id(variable) in loaded:
            continue
        others = sorted(holders[unit] - {owner})
        if engine.stage == owner:
            value = np.asarray(variable.numpy())
            for rank in others:
                pipeline.send(value, rank, TAG_STATE)
            pipeline.flush()  # (every rank takes the weights in the same order: one in flight at a time)
        elif here and engine.stage in others:
            variable.assign(pipeline.recv_exact(owner, TAG_STATE, tuple(variable.shape), np.dtype(variable.dtype)))


def load_deferred(engine, model) -> set[int]:
    """The weights files loaded into ``model`` (or a model nested in it) while it had no memory, now read (collective).

    A keras_hub ``from_preset`` (or a ``load_weights``) inside
    :func:`keras_pipe.unallocated` is recorded, not run (see
    :func:`keras_pipe.compat.unallocated_scope`). Once each rank holds its own
    stage, each rank runs Keras' own load of each file over the whole model,
    reading and assigning only the variables it holds; an error on any rank
    (a missing file, a shape that differs) is raised on every rank, naming it.
    Returns the ids of the model's weights the files gave a value on every rank.
    """
    loads = [(sub, load) for sub in compat.sublayers(model) for load in sub.__dict__.get(compat.DEFERRED_LOADS, [])]
    if not loads:
        return set()

    def load():
        for sub, (filepath, skip_mismatch, objects_to_skip) in loads:
            compat.load_weights_only(sub, filepath, skip_mismatch, objects_to_skip)

    visited = read_held(engine, load, f"loading the weights recorded while {model.name!r} was created unallocated")
    for sub, _ in loads:
        object.__setattr__(sub, compat.DEFERRED_LOADS, [])
    # Which of the model's weights the files gave a value on every rank (the same walk everywhere, agreed on
    # all the same): the holders of those read one value, and copying it between them would move it for nothing.
    entries = ordered(engine)
    indices = {i for i, (variable, _, _) in enumerate(entries) if id(variable) in visited}
    if engine.world.size > 1:
        for other in engine.world.allgather_json(sorted(indices)):
            indices &= set(other)
    return {id(entries[i][0]) for i in indices}


def read_held(engine, load, what: str) -> set[int]:
    """``load()`` (Keras reading a file into the model) on every rank, each reading only what it holds (collective).

    An error on any rank (a missing file, a shape that differs) is raised
    on every rank, naming the rank. Returns the ids of the variables the file
    gave a value (held here or not).
    """
    problem, visited = None, set()
    try:
        with compat.held_only_loading(aligned_empty) as visited:  # (each value assigned without a copy)
            load()
    except Exception as error:  # noqa: BLE001 - every rank raises the first rank's error
        problem = f"rank {engine.world.rank}: {type(error).__name__}: {error}"
    problems = [problem] if engine.world.size == 1 else engine.world.allgather_json(problem)
    problems = [p for p in problems if p]
    if problems:
        raise PipelineIOError(f"{what} failed: {problems[0]}")
    return visited
