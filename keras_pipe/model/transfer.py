"""Internal: a whole model's arrays between rank 0 and the stages: weights and optimizer state, gathered and given.

The routes that need the whole model in one process (``to_keras``,
``export``, pickling) hold it on rank 0 alone: :func:`gathered` brings every
stage's weights and optimizer state there, :func:`load_into` gives each stage its part of a
whole model's. Optimizer slots are keyed by the model-wide index of their
weight (:func:`optimizer_state`), so that a pipeline of any split and the
unsplit model agree. :func:`on_root` runs a file's reading or writing on
rank 0 and raises its error on every rank. Each function taking ``model``
reads the :class:`~keras_pipe.model.model.PipelineModel`'s engine,
replica index and compiled optimizer only.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.errors import PipelineIOError
from keras_pipe.model.weights import copy_from_first_replica, ordered
from keras_pipe.mpi.comm import TAG_STATE, Communicator
from keras_pipe.mpi.files import describe_unreadable

ROOT = 0


def numpy_dtype(name) -> np.dtype:
    """NumPy's dtype of a Keras dtype's name, ``bfloat16`` and the float8 types (ml_dtypes') included."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, str(name)))


# -- moving arrays between rank 0 and the stages ---------------------------


def gather_to_root(comm: Communicator, arrays: list[np.ndarray]) -> list[list[np.ndarray]] | None:
    """Every rank's list of arrays, on rank 0 (``None`` elsewhere); shapes travel as JSON."""
    arrays = [np.asarray(a) for a in arrays]
    shapes = comm.allgather_json([[list(a.shape), a.dtype.str] for a in arrays])
    if comm.rank != ROOT:
        for array in arrays:
            comm.send(array, ROOT, TAG_STATE)
        comm.flush()
        return None
    gathered = []
    for rank, shape_list in enumerate(shapes):
        if rank == ROOT:
            gathered.append(arrays)
        else:
            gathered.append([comm.recv_exact(rank, TAG_STATE, tuple(shape), dtype) for shape, dtype in shape_list])
    return gathered


def scatter_from_root(comm: Communicator, per_rank: list[list[np.ndarray]] | None) -> list[np.ndarray]:
    """Rank ``r`` gets ``per_rank[r]`` from rank 0."""
    shapes = comm.bcast_json(
        [[[list(np.shape(a)), np.asarray(a).dtype.str] for a in arrays] for arrays in per_rank]
        if comm.rank == ROOT
        else None,
        root=ROOT,
    )
    if comm.rank == ROOT:
        for rank, arrays in enumerate(per_rank):
            if rank != ROOT:
                for array in arrays:
                    comm.send(np.asarray(array), rank, TAG_STATE)
        comm.flush()
        return [np.asarray(a) for a in per_rank[ROOT]]
    return [comm.recv_exact(ROOT, TAG_STATE, tuple(shape), dtype) for shape, dtype in shapes[comm.rank]]


def on_root(comm: Communicator, action, what: str, reading=None):
    """Runs ``action`` on rank 0; if it fails, every rank raises the same error.

    ``reading``: the file ``action`` reads, so that the error says what is wrong with it.
    """
    result, error = None, None
    if comm.rank == ROOT:
        try:
            result = action()
        except Exception as failure:  # noqa: BLE001 - re-raised on every rank below
            error = describe_unreadable(reading, failure) if reading else f"{type(failure).__name__}: {failure}"
    error = comm.bcast_json(error, root=ROOT)
    if error is not None:
        raise PipelineIOError(f"rank 0 could not {what}: {error}")
    return result


# -- optimizer state ------------------------------------------------------


def optimizer_state(optimizer, indexed: list, others=()) -> dict[str, np.ndarray]:
    """The optimizer's variables keyed so that stages and the whole model agree.

    ``indexed``: ``(variable, model-wide index)`` of the trainable weights
    whose slots to take; ``others``: weights whose slots to leave out (a
    copy of a weight another stage answers for). A slot is keyed
    ``"<index>:<k>"``: the ``k``-th variable the optimizer's build made for
    the weight of that model-wide index (Adam's momentum ``k=0``, velocity
    ``k=1``); the optimizer's own variables (iteration count, learning rate)
    ``"optimizer:<k>"``. The build's order is read from the optimizer's own
    build (:func:`keras_pipe.compat.optimizer_layout`), not from the slots'
    names: Adafactor names its factors after the weight's name, which many
    weights share.
    """
    return {key: np.asarray(slot.numpy()) for key, slot in _slots(optimizer, indexed, others).items()}


def assign_optimizer_state(optimizer, indexed: list, state: dict) -> None:
    """Sets the optimizer's variables from :func:`optimizer_state` output (of any split)."""
    slots = _slots(optimizer, indexed)
    missing = sorted(set(slots) - set(state))
    if missing:
        raise PipelineIOError(f"the saved optimizer state lacks {missing[:5]}: was it saved with another optimizer?")
    for key, slot in slots.items():
        slot.assign(state[key])


_UNKEYED = 10**9  # (stand-in numbers of the weights built on but not indexed: their slots are left out)


def _slots(optimizer, indexed: list, others=()) -> dict:
    del others  # (whatever is built on and not indexed is left out)
    index_of = {id(v): i for v, i in indexed}
    built = compat.built_on(optimizer)
    numbers = [index_of.get(id(v), _UNKEYED + n) for n, v in enumerate(built)]
    layout = compat.optimizer_layout(optimizer, [(i, v.path, v.shape, v.dtype) for i, v in zip(numbers, built)])
    real = optimizer.variables
    if len(layout) != len(real) or any(tuple(shape) != tuple(v.shape) for (_, shape), v in zip(layout, real)):
        raise PipelineIOError(
            f"{type(optimizer).__name__}'s variables ({len(real)}) are not what its build on its weights makes "
            f"({len(layout)}): its state cannot be matched between the stages and the whole model"
        )
    slots = {}
    for ((owner, k), _), slot in zip(layout, real):
        if owner == "own":
            slots[f"optimizer:{k}"] = slot
        elif owner < _UNKEYED:
            slots[f"{owner}:{k}"] = slot
    return slots


def trainable_index(model_weights) -> dict:
    """``id(variable) -> index`` among the trainable ones of ``model_weights`` (the model-wide key of its slots)."""
    trainable = [v for v in model_weights if v.trainable]
    return {id(v): i for i, v in enumerate(trainable)}


# -- the whole model on rank 0 ------------------------------------------


def gathered(model):
    """Every stage's weights and optimizer state, on rank 0 (``None`` elsewhere); collective.

    What :func:`fill` puts into a whole model: ``(values, optimizer state parts)``.
    """
    if model.replica_index != 0:
        return None
    engine = model.engine
    comm = engine.pipeline
    entries = ordered(engine)
    answered = [position for position, (_, owner, _) in enumerate(entries) if owner == engine.stage]
    gathered = gather_to_root(comm, [entries[p][0].numpy() for p in answered])
    positions = comm.allgather_json(answered)
    optimizer = model.optimizer if model.compiled else None
    with_optimizer = comm.allgather_json(bool(optimizer is not None and optimizer.built))
    opt_parts = None
    if all(with_optimizer):
        index = trainable_index([v for v, _, _ in entries])
        indexed = [(entries[p][0], index[id(entries[p][0])]) for p in answered if id(entries[p][0]) in index]
        answered_ids = {id(v) for v, _ in indexed}
        copies = [v for v in engine.trainable_variables if id(v) not in answered_ids]
        state = optimizer_state(optimizer, indexed, copies)
        names = sorted(state)
        parts = gather_to_root(comm, [state[name] for name in names])
        keys = comm.allgather_json(names)
        opt_parts = [dict(zip(k, p)) for k, p in zip(keys, parts)] if parts is not None else None
    if comm.rank != ROOT:
        return None
    values = [None] * len(entries)
    for stage_positions, arrays in zip(positions, gathered):
        for p, array in zip(stage_positions, arrays):
            values[p] = array
    return values, opt_parts


def fill(whole: keras.Model, parts) -> None:
    values, opt_parts = parts
    whole.set_weights(values)
    if opt_parts is not None and whole.optimizer is not None:
        merged = {}
        for part in opt_parts:
            merged.update(part)  # the optimizer's own variables are the same on every stage
        index = trainable_index(whole.weights)
        assign_optimizer_state(whole.optimizer, [(v, index[id(v)]) for v in whole.trainable_variables], merged)


class WholeArrays:
    """A whole model's weights (in its ``weights`` order) and optimizer state, as numpy arrays (rank 0).

    What :func:`load_into` takes where the whole model only lived for a
    moment (its layers are this process's own: ``ModelSaver.of_layers``).
    """

    def __init__(self, whole: keras.Model):
        self.values = [np.asarray(w.numpy()) for w in whole.weights]
        self.state = None
        if getattr(whole, "optimizer", None) is not None and whole.optimizer.built:
            index = trainable_index(whole.weights)
            self.state = optimizer_state(whole.optimizer, [(v, index[id(v)]) for v in whole.trainable_variables])


def load_into(model, whole: keras.Model | WholeArrays | None) -> None:
    """Gives every stage its weights (and optimizer state) from ``whole`` on rank 0; collective.

    The first replica's pipeline receives them from rank 0, then passes them to the other replicas.
    """
    if model.replica_index == 0:
        _load_pipeline(model, whole)
    copy_from_first_replica(model.engine, model.optimizer if model.compiled else None)


def _load_pipeline(model, whole) -> None:
    engine = model.engine
    comm = engine.pipeline
    entries = ordered(engine)
    held = comm.allgather_json([p for p, (_, _, here) in enumerate(entries) if here])
    per_rank = None
    if comm.rank == ROOT and not isinstance(whole, WholeArrays):
        whole = WholeArrays(whole)
    if comm.rank == ROOT:
        values = whole.values
        if len(values) != len(entries):
            raise PipelineIOError(f"the file holds {len(values)} weights but the model has {len(entries)}")
        per_rank = [[values[p] for p in positions] for positions in held]
    received = scatter_from_root(comm, per_rank)
    for p, value in zip(held[comm.rank], received):
        entries[p][0].assign(value)
    has_state = comm.bcast_json(
        bool(whole is not None and whole.state is not None and model.compiled) if comm.rank == ROOT else None,
        root=ROOT,
    )
    if not has_state or not model.compiled:
        return
    index = trainable_index([v for v, _, _ in entries])
    wanted = comm.allgather_json(
        sorted({index[id(entries[p][0])] for p in held[comm.rank] if id(entries[p][0]) in index})
    )
    per_rank_state = keys = None
    if comm.rank == ROOT:
        full = whole.state
        keys = [sorted(k for k in full if k.startswith("optimizer:") or int(k.split(":")[0]) in set(w)) for w in wanted]
        per_rank_state = [[full[k] for k in ks] for ks in keys]
    keys = comm.bcast_json(keys, root=ROOT)[comm.rank]
    values = scatter_from_root(comm, per_rank_state)
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(engine.trainable_variables)
    indexed = [(v, index[id(v)]) for v in engine.trainable_variables if id(v) in index]
    assign_optimizer_state(optimizer, indexed, dict(zip(keys, values)))
