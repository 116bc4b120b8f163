"""Saving and loading a pipeline as the equivalent ``keras.Sequential``.

A ``PipelineModel`` saved with ``model.save("model.keras")`` (called on every
rank, as in any Keras script) is one standard ``.keras`` file, written by
rank 0 alone: the equivalent ``keras.Sequential`` with every stage's weights
and optimizer state. Plain ``keras.models.load_model`` opens it without MPI
or keras_pipe; :func:`load_model` opens it (or any ``Sequential`` file) on
any number of ranks. Files are read on rank 0 only and each stage receives
its part, so the ranks need not share a filesystem.

Rank 0 holds the whole model while saving or loading: the file format has
no per-stage shards.
"""

from __future__ import annotations

import os

import keras
import numpy as np

from keras_pipe import partition
from keras_pipe.comm import TAG_STATE, Communicator
from keras_pipe.errors import PipelineIOError
from keras_pipe.failure import collective
from keras_pipe.files import atomic_path, describe_unreadable
from keras_pipe.weights import copy_from_first_replica

ROOT = 0


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


def optimizer_state(optimizer, variables, first_index: int = 0) -> dict[str, np.ndarray]:
    """The optimizer's variables keyed so that stages and the whole model agree.

    A slot (Adam's momentum of a kernel, say) is keyed by the model-wide
    index of its weight and the slot's name; the optimizer's own variables
    (iteration count, learning rate) by their names.
    """
    keys = [(_path_key(v), first_index + i) for i, v in enumerate(variables)]
    keys.sort(key=lambda pair: -len(pair[0]))  # longest prefix first: "d1_kernel_2" before "d1_kernel"
    state = {}
    for slot in optimizer.variables:
        for prefix, index in keys:
            if slot.name.startswith(prefix + "_"):
                state[f"{index}:{slot.name[len(prefix) + 1 :]}"] = np.asarray(slot.numpy())
                break
        else:
            state[f"optimizer:{slot.name}"] = np.asarray(slot.numpy())
    return state


def assign_optimizer_state(optimizer, variables, state: dict, first_index: int = 0) -> None:
    """Sets the optimizer's variables from :func:`optimizer_state` output (of any split)."""
    mine = optimizer_state(optimizer, variables, first_index)
    missing = sorted(set(mine) - set(state))
    if missing:
        raise PipelineIOError(f"the saved optimizer state lacks {missing[:5]}: was it saved with another optimizer?")
    lookup = dict(zip(mine, optimizer.variables))
    for key, slot in lookup.items():
        slot.assign(state[key])


def _path_key(variable) -> str:
    return variable.path.replace("/", "_")


# -- the equivalent Sequential ----------------------------------------------


def skeleton(model) -> keras.Sequential:
    """A ``Sequential`` with ``model``'s layers re-created from their configs, compiled as ``model`` is."""
    shape, dtype = model.engine.input_spec
    layers = [keras.layers.deserialize(keras.layers.serialize(layer)) for layer in model.layers]
    sequential = keras.Sequential([keras.Input(batch_shape=shape, dtype=dtype), *layers], name=model.name)
    if model.compiled:
        sequential.compile_from_config(model.get_compile_config())
        if sequential.optimizer is not None and not sequential.optimizer.built:
            sequential.optimizer.build(sequential.trainable_variables)
    return sequential


def to_sequential(model) -> keras.Sequential | None:
    """The whole model as a ``keras.Sequential`` on rank 0 (``None`` elsewhere); collective.

    With replicas, the first replica's pipeline gathers (the others hold the same weights).
    """
    if model.replica_index != 0:
        return None
    engine = model.engine
    comm = engine.pipeline
    gathered = gather_to_root(comm, [v.numpy() for v in engine.stage_weights()])
    offset = engine.weight_offset(trainable=True)
    optimizer = model.optimizer if model.compiled else None
    with_optimizer = comm.allgather_json(bool(optimizer is not None and optimizer.built))
    opt_parts = None
    if all(with_optimizer):
        state = optimizer_state(optimizer, engine.compute.trainable_variables, offset)
        names = sorted(state)
        parts = gather_to_root(comm, [state[name] for name in names])
        keys = comm.allgather_json(names)
        opt_parts = [dict(zip(k, p)) for k, p in zip(keys, parts)] if parts is not None else None
    if comm.rank != ROOT:
        return None
    sequential = skeleton(model)
    sequential.set_weights([w for arrays in gathered for w in arrays])
    if opt_parts is not None and sequential.optimizer is not None:
        merged = {}
        for part in opt_parts:
            merged.update(part)  # the optimizer's own variables are the same on every stage
        assign_optimizer_state(sequential.optimizer, sequential.trainable_variables, merged)
    return sequential


def load_into(model, sequential: keras.Sequential | None) -> None:
    """Gives every stage its weights (and optimizer state) from ``sequential`` on rank 0; collective.

    The first replica's pipeline receives them from rank 0, then passes them to the other replicas.
    """
    if model.replica_index == 0:
        _load_pipeline(model, sequential)
    copy_from_first_replica(model.engine, model.optimizer if model.compiled else None)


def _load_pipeline(model, sequential: keras.Sequential | None) -> None:
    engine = model.engine
    comm = engine.pipeline
    bounds = partition.stage_bounds(model.balance)
    per_rank = None
    if comm.rank == ROOT:
        per_rank = [[w.numpy() for layer in sequential.layers[a:b] for w in layer.weights] for a, b in bounds]
    weights = scatter_from_root(comm, per_rank)
    for variable, value in zip(engine.stage_weights(), weights):
        variable.assign(value)
    has_state = comm.bcast_json(
        bool(
            sequential is not None
            and getattr(sequential, "optimizer", None) is not None  # an uncompiled model has none
            and sequential.optimizer.built
            and model.compiled
        )
        if comm.rank == ROOT
        else None,
        root=ROOT,
    )
    if not has_state or not model.compiled:
        return
    per_rank_state = None
    if comm.rank == ROOT:
        full = optimizer_state(sequential.optimizer, sequential.trainable_variables)
        per_rank_state = []
        for a, b in bounds:
            first = sum(len(layer.trainable_weights) for layer in sequential.layers[:a])
            last = first + sum(len(layer.trainable_weights) for layer in sequential.layers[a:b])
            keys = sorted(k for k in full if k.startswith("optimizer:") or first <= int(k.split(":")[0]) < last)
            per_rank_state.append(keys)
    keys = comm.bcast_json(per_rank_state, root=ROOT)[comm.rank]
    values = scatter_from_root(comm, [[full[k] for k in ks] for ks in per_rank_state] if comm.rank == ROOT else None)
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(engine.compute.trainable_variables)
    assign_optimizer_state(
        optimizer, engine.compute.trainable_variables, dict(zip(keys, values)), engine.weight_offset(trainable=True)
    )


def write_weights(model, filepath, overwrite: bool = True, finish=None, **kwargs) -> None:
    """``model.save_weights`` (collective); ``finish(path)`` runs on rank 0 on the complete file before its rename."""
    sequential = model.to_sequential()

    def write(temporary):
        sequential.save_weights(temporary, **kwargs)
        if finish is not None:
            finish(temporary)

    on_root(model.engine.world, lambda: write_atomically(filepath, overwrite, write), f"save weights to {filepath}")


def write_atomically(filepath, overwrite: bool, write) -> None:
    """``write(path)`` to a partial file beside ``filepath``, renamed over it once complete (see :mod:`files`).

    With ``overwrite=False`` an existing file is an error: Keras would ask on
    the terminal, which a rank of an MPI job cannot answer.
    """
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(f"{filepath} exists and overwrite=False; pass overwrite=True to replace it")
    with atomic_path(filepath) as temporary:
        write(temporary)


class SavingMethods:
    """``PipelineModel``'s saving and loading methods (a mixin; every one is collective)."""

    @collective
    def to_sequential(self) -> keras.Sequential | None:
        """The whole model, weights and optimizer state, as a ``keras.Sequential`` on rank 0 (``None`` elsewhere)."""
        self.build()
        return to_sequential(self)

    @collective
    def save(self, filepath, overwrite: bool = True, zipped=None, **kwargs) -> None:
        """Writes one standard ``.keras`` file, from rank 0: the equivalent ``Sequential``.

        Plain ``keras.models.load_model`` opens the file in one process,
        without MPI or keras_pipe; :func:`keras_pipe.load_model` opens it on
        any number of ranks.
        """
        sequential = self.to_sequential()
        arguments = dict(kwargs)
        if zipped is not None:
            arguments["zipped"] = zipped

        def write(temporary):
            sequential.save(temporary, **arguments)

        on_root(self.engine.world, lambda: write_atomically(filepath, overwrite, write), f"save {filepath}")

    @collective
    def save_weights(self, filepath, overwrite: bool = True, **kwargs) -> None:
        """Writes the whole model's weights (and optimizer state) to one ``.weights.h5`` file, from rank 0."""
        write_weights(self, filepath, overwrite, **kwargs)

    @collective
    def load_weights(self, filepath, skip_mismatch: bool = False, **kwargs) -> None:
        """Reads a ``.weights.h5`` file of this model (or its ``Sequential``) on rank 0; each stage gets its part."""
        self.build()

        def read():
            sequential = skeleton(self)
            sequential.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
            return sequential

        load_into(self, on_root(self.engine.world, read, f"load weights from {filepath}", reading=filepath))
