"""One-file saving and loading through rank 0, one entry at a time: no rank holds more than its stage and one layer.

``save_weights("m.weights.h5")``, ``save("m.keras")``, ``load_weights`` of
either, and ``keras_pipe.load_model`` write and read one standard Keras
file, on rank 0, so that the ranks need not share a filesystem. Rank 0 walks
the whole model as Keras does (its own layer objects, the other stages'
without memory) and writes or reads each layer's entry where Keras' walk
reaches it:

- saving, an entry of another stage's layer is asked of the stage that
  answers for it (the first holding it), which runs the layer's own
  ``save_own_variables`` into a store that sends each value as it comes;
  then the optimizer's list, each position asked of the stage holding its
  weight (:func:`keras_pipe.model.sharded.optimizer_positions`);
- loading, rank 0 reads each entry and sends it to every rank of the first
  replica holding the layer, which runs the layer's own ``load_own_variables``
  on it; each optimizer position goes to the ranks whose optimizer holds it;
  the other replicas then copy the first's.

The other ranks serve rank 0's requests (:class:`_Server`) until it says it
is done; an error on any rank ends every rank's part alike and is raised on
every rank. The file's bytes are what Keras writes for the unsplit model.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import numpy as np

from keras_pipe import compat
from keras_pipe.errors import PipelineIOError
from keras_pipe.model import sharded
from keras_pipe.model.transfer import ROOT, numpy_dtype
from keras_pipe.model.weights import copy_from_first_replica, ordered
from keras_pipe.mpi.comm import TAG_STATE, aligned_empty
from keras_pipe.mpi.files import describe_unreadable

# -- messages: a JSON header, an array as its bytes ---------------------------------------------


def _send_json(comm, obj, dest: int) -> None:
    comm.send(np.frombuffer(json.dumps(obj).encode(), np.uint8), dest, TAG_STATE)
    comm.flush()  # (one message in flight: a rank never holds more than the value it sends)


def _recv_json(comm, source: int):
    return json.loads(comm.recv(source, TAG_STATE, (), np.uint8).tobytes())


def _send_array(comm, value, dest: int, **header) -> None:
    array = compat.as_array(value)  # (one copy of a variable at most)
    _send_json(comm, dict(header, shape=list(array.shape), dtype=array.dtype.name), dest)
    _send_bytes(comm, array, dest)


def _send_bytes(comm, array: np.ndarray, dest: int) -> None:
    comm.send(np.ascontiguousarray(array).reshape(-1).view(np.uint8), dest, TAG_STATE)  # (a scalar: 1-d here only)
    comm.flush()


def _recv_array(comm, source: int, header: dict) -> np.ndarray:
    data = comm.recv(source, TAG_STATE, (), np.uint8)
    return data.view(numpy_dtype(header["dtype"])).reshape(header["shape"])


# -- who holds what -------------------------------------------------------------------------------


def layer_places(engine, whole) -> dict:
    """``id(layer) -> (answering rank, holding ranks)`` in the pipeline for every layer of ``whole`` with variables of
    its own: the ranks of the units the layer belongs to."""
    holders = engine.holder_ranks()
    places = {}
    for unit, layer in engine.graph.units.items():
        for sub in compat.sublayers(layer):
            places.setdefault(id(sub), (engine.owner_of(unit), set(holders[unit])))
    unplaced = [
        layer.path for layer in compat.sublayers(whole) if compat.own_variables(layer) and id(layer) not in places
    ]
    if unplaced:
        raise PipelineIOError(f"no stage holds the weights of {unplaced[:3]}: they cannot be saved or loaded")
    return places


# -- saving ---------------------------------------------------------------------------------------


def save(saver, write, what: str) -> None:
    """Rank 0 runs ``write(write_entries)``, which opens the file and calls ``write_entries(store, assets)``; the
    first replica's other ranks serve its requests for their entries (collective)."""
    model = saver.model
    model.build()
    optimizer = model.optimizer if model.compiled else None
    if optimizer is not None and not optimizer.built:  # (Keras writes a compiled model's optimizer, built)
        optimizer.build(model.trainable_variables)
    with_state = optimizer is not None

    def on_root(comm, whole, places):
        def write_entries(store, assets=None):
            with _fetching(comm, whole, places):
                optimizer = getattr(whole, "optimizer", None)
                compat.save_state(whole, store, skip=[optimizer] if optimizer is not None else [], assets=assets)
            if with_state:
                _write_optimizer(saver, comm, store, ordered(saver.engine))

        write(write_entries)

    _serve_root(saver, on_root, with_state, what)


def save_through(saver, writer, what: str) -> None:
    """Rank 0 runs ``writer(whole)``, a writer of one process's model (keras_hub's ``save_to_preset``), on the model
    of its own layers (:meth:`ModelSaver.walked`), each other stage's layer's ``save_own_variables`` answered by
    its stage as in :func:`save`: rank 0 holds its stage and one layer's values. No optimizer state (collective)."""
    saver.model.build()

    def on_root(comm, whole, places):
        with _fetching(comm, whole, places):
            writer(whole)

    _serve_root(saver, on_root, False, what)


def _serve_root(saver, on_root, with_state: bool, what: str) -> None:
    """Rank 0 runs ``on_root(comm, whole, places)`` while the first replica's other ranks serve its requests; an
    error on rank 0 (or in a stage's answer) is raised on every rank."""
    engine = saver.engine
    world, comm = engine.world, engine.pipeline
    error = None
    if engine.replica == 0:
        whole = saver.walked()
        if comm.rank == ROOT:
            error = _root_save(comm, whole, lambda places: on_root(comm, whole, places), engine)
        else:
            _Server(saver, comm, whole, with_state).serve_saving()
    error = world.bcast_json(error, root=engine.layout.rank_of(0, ROOT))
    if error is not None:
        raise PipelineIOError(f"rank 0 could not {what}: {error}")


def _root_save(comm, whole, run, engine):
    error = None
    try:
        run(layer_places(engine, whole))
    except Exception as failure:  # noqa: BLE001 - every rank raises it
        error = failure.args[0] if isinstance(failure, PipelineIOError) else f"{type(failure).__name__}: {failure}"
    for rank in range(1, comm.size):
        _send_json(comm, {"stop" if error else "done": True}, rank)
    return error


@contextlib.contextmanager
def _fetching(comm, whole, places):
    """Inside, each layer of ``whole`` that another stage answers for has its ``save_own_variables`` ask that stage
    for the entry, named by its path in ``whole`` (not the store's: a writer may walk a part of the model, as
    keras_hub's ``backbone.save_weights`` does)."""
    paths = {id(layer): path for path, layer in compat.entry_paths(whole).items()}
    patched = []
    for layer in compat.sublayers(whole):
        if not compat.own_variables(layer):
            continue
        owner, path = places[id(layer)][0], paths.get(id(layer))
        if owner == ROOT:  # (its own values, handed to the store without Keras' second copy)
            fetch = lambda store, layer=layer: compat.saved_own_variables(layer, store)  # noqa: E731
        else:
            fetch = lambda store, owner=owner, path=path: _fetch_entry(comm, owner, store, path)  # noqa: E731
        object.__setattr__(layer, "save_own_variables", fetch)
        patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            layer.__dict__.pop("save_own_variables", None)


def _fetch_entry(comm, owner: int, store, path: str | None) -> None:
    """Rank 0: the entry at ``path`` (where Keras' walk is, by default), asked of ``owner`` and written value by value
    as it comes."""
    _send_json(comm, {"entry": path if path is not None else compat.entry_path(store)}, owner)
    failed = None
    while True:
        header = _recv_json(comm, owner)
        if "error" in header:
            raise PipelineIOError(f"rank {comm.world_rank_of(owner)}: {header['error']}")
        if header.get("end"):
            break
        value = _recv_array(comm, owner, header)
        if failed is None:
            try:
                store[header["key"]] = compat.handed_over(value)  # (written from the buffer it came in)
            except Exception as failure:  # noqa: BLE001 - the entry's other values are still taken from the owner
                failed = failure
        del value  # (one value at a time: not kept while the next comes)
    if failed is not None:
        raise failed


def _write_optimizer(saver, comm, store, entries) -> None:
    model, engine = saver.model, saver.engine
    optimizer = model.optimizer
    positions, local = sharded.optimizer_positions(model, entries)
    owners = sharded.trainable_owners(entries)
    mine = {positions[key]: variable for (key, _), variable in zip(local, optimizer.variables)}
    store.make(sharded.OPTIMIZER, metadata={"name": optimizer.name})
    for key, p in sorted(positions.items(), key=lambda item: item[1]):
        owner = ROOT if key[0] == "own" else owners[key[0]]
        if owner == engine.stage:
            store[str(p)] = compat.handed_over(mine[p])
        else:
            _send_json(comm, {"position": p}, owner)
            header = _recv_json(comm, owner)
            if "error" in header:
                raise PipelineIOError(f"rank {comm.world_rank_of(owner)}: {header['error']}")
            store[str(p)] = compat.handed_over(_recv_array(comm, owner, header))


class _Sender:
    """The store a layer's ``save_own_variables`` writes to on a rank serving rank 0: each value is sent as it comes."""

    def __init__(self, comm):
        self.comm = comm

    def __setitem__(self, key, value):
        _send_array(self.comm, value, ROOT, key=key)


class _Server:
    """A rank of the first replica other than 0: answers rank 0's requests until it is done."""

    def __init__(self, saver, comm, whole, with_state: bool, skip_mismatch: bool = False, by_position=None):
        """``by_position``: this rank's optimizer variables by their position in the unsplit list, where the caller
        has them already (loading: :func:`_wanted_positions`)."""
        self.comm, self.skip_mismatch, self.by_position = comm, skip_mismatch, by_position
        self.problem = None
        try:
            self.by_path = compat.entry_paths(whole)
            if with_state and by_position is None:
                positions, local = sharded.optimizer_positions(saver.model, ordered(saver.engine))
                self.by_position = {positions[k]: v for (k, _), v in zip(local, saver.model.optimizer.variables)}
        except Exception as failure:  # noqa: BLE001 - said in answer to rank 0's first request
            self.problem = f"{type(failure).__name__}: {failure}"

    def serve_saving(self) -> None:
        comm = self.comm
        while True:
            request = _recv_json(comm, ROOT)
            if "done" in request or "stop" in request:
                return
            if self.problem is not None:
                _send_json(comm, {"error": self.problem}, ROOT)
                continue
            try:
                if "entry" in request:
                    layer = self.by_path[request["entry"]]
                    type(layer).save_own_variables(layer, _Sender(comm))
                    _send_json(comm, {"end": True}, ROOT)
                else:
                    _send_array(comm, self.by_position[request["position"]], ROOT)
            except Exception as failure:  # noqa: BLE001 - rank 0 raises it on every rank
                _send_json(comm, {"error": f"{type(failure).__name__}: {failure}"}, ROOT)

    def serve_loading(self) -> str | None:
        """Takes what rank 0 sends until it is done; returns this rank's first error (the others' are agreed after)."""
        comm, problem = self.comm, self.problem
        while True:
            header = _recv_json(comm, ROOT)
            if "done" in header or "stop" in header:
                return problem
            if "entry" in header:
                values = {key: _recv_array(comm, ROOT, h) for key, h in zip(header["keys"], header["arrays"])}
                if problem is None:
                    try:
                        layer = self.by_path.get(header["entry"])
                        if layer is None:
                            raise PipelineIOError(f"the file's entry {header['entry']!r} is no layer of this model")
                        type(layer).load_own_variables(layer, values)
                    except Exception as failure:  # noqa: BLE001 - agreed once rank 0 is done
                        if not self.skip_mismatch:  # (Keras' skip_mismatch: the layer is left as it is, with a warning)
                            problem = f"{type(failure).__name__}: {failure}"
                        else:
                            warnings.warn(f"Skipping loading {header['entry']}: {failure}", stacklevel=2)
            else:
                value = _recv_array(comm, ROOT, header)
                if problem is None:
                    try:
                        self.by_position[header["position"]].assign(value)
                    except Exception as failure:  # noqa: BLE001 - agreed once rank 0 is done
                        problem = f"{type(failure).__name__}: {failure}"


# -- loading --------------------------------------------------------------------------------------


def load(saver, filepath, skip_mismatch: bool = False) -> None:
    """``load_weights`` of a ``.weights.h5`` or ``.keras`` file: rank 0 reads it entry by entry, each to the ranks
    holding it (collective)."""
    model, engine = saver.model, saver.engine
    model.build()
    world, comm = engine.world, engine.pipeline
    optimizer = model.optimizer if model.compiled else None
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    problem = None
    if engine.replica == 0:
        whole = saver.walked()
        wanted, problem = _wanted_positions(saver, comm) if optimizer is not None else (None, None)
        with compat.assigning_in_place():  # (each value copied into its variable's buffer: no second buffer)
            if problem is None and comm.rank == ROOT:
                problem = _root_load(saver, comm, whole, os.fspath(filepath), skip_mismatch, wanted)
            elif problem is None:
                mine = wanted.mine if wanted is not None else None
                server = _Server(saver, comm, whole, optimizer is not None, skip_mismatch, by_position=mine)
                problem = server.serve_loading()
                problem = None if problem is None else f"rank {world.rank}: {problem}"
    problems = [p for p in world.allgather_json(problem) if p]
    if problems:
        raise PipelineIOError(f"loading {filepath} failed: {problems[0]}")
    copy_from_first_replica(engine, optimizer)


def _wanted_positions(saver, comm):
    """``(each pipeline rank's positions of the unsplit optimizer list, {position: this rank's variable}, the list's
    length)``, or the first rank's error (every rank of the pipeline sees the same)."""
    try:
        positions, local = sharded.optimizer_positions(saver.model, ordered(saver.engine))
        mine = {positions[k]: v for (k, _), v in zip(local, saver.model.optimizer.variables)}
        report = sorted(mine)
    except Exception as failure:  # noqa: BLE001 - every rank of the pipeline reports it
        report = f"rank {comm.world_rank}: {type(failure).__name__}: {failure}"
    reports = comm.allgather_json(report)
    errors = [r for r in reports if isinstance(r, str)]
    if errors:
        return None, errors[0]
    return _Wanted([set(r) for r in reports], mine, len(positions)), None


class _Wanted:
    def __init__(self, by_rank: list, mine: dict, count: int):
        self.by_rank, self.mine, self.count = by_rank, mine, count


def _root_load(saver, comm, whole, filepath: str, skip_mismatch: bool, wanted):
    error = None
    try:
        with compat.readable_weights(filepath) as readable:
            _root_read(saver, comm, whole, readable, skip_mismatch, wanted)
    except Exception as failure:  # noqa: BLE001 - every rank raises it
        error = describe_unreadable(filepath, failure) if not isinstance(failure, PipelineIOError) else failure.args[0]
        error = f"rank 0: {error}"
    for rank in range(1, comm.size):
        _send_json(comm, {"stop" if error else "done": True}, rank)
    return error


def _root_read(saver, comm, whole, filepath: str, skip_mismatch: bool, wanted) -> None:
    """Rank 0's walk of the file: its own layers loaded, the others' entries sent to their holders."""
    engine = saver.engine
    places = layer_places(engine, whole)
    patched = []
    for layer in compat.sublayers(whole):
        if compat.own_variables(layer):  # (rank 0's own too: read once, assigned without Keras' copies)
            _, holders = places[id(layer)]
            own = type(layer).load_own_variables
            object.__setattr__(
                layer,
                "load_own_variables",
                lambda store, layer=layer, holders=holders, own=own: _push_entry(
                    comm, store, holders, lambda values: own(layer, values)
                ),
            )
            patched.append(layer)
    try:
        optimizer = getattr(whole, "optimizer", None)
        compat.load_state(whole, filepath, skip_mismatch, [optimizer] if optimizer is not None else [])
    finally:
        for layer in patched:
            layer.__dict__.pop("load_own_variables", None)
    if wanted is not None:
        _push_optimizer(saver, comm, filepath, wanted)


def _push_entry(comm, store, holders: set, load_here) -> None:
    """Rank 0: the entry Keras' walk is at, read whole (one layer's values), sent to its other holders, loaded here
    if rank 0 holds it."""
    values = {key: compat.read_value(store, key, aligned_empty) for key in store.keys()}
    path = compat.entry_path(store)
    for rank in sorted(holders - {ROOT}):
        arrays = [{"shape": list(v.shape), "dtype": v.dtype.name} for v in values.values()]
        _send_json(comm, {"entry": path, "keys": list(values), "arrays": arrays}, rank)
        for value in values.values():
            _send_bytes(comm, value, rank)
    if ROOT in holders:
        load_here(values)


def _push_optimizer(saver, comm, filepath: str, wanted: _Wanted) -> None:
    """Rank 0: each position of the file's optimizer list to the ranks whose optimizer holds it (``wanted``: each
    rank's positions, this rank's variables). Where the file's list is missing or of another length: Keras'
    warning, and the optimizer left as it is."""
    optimizer = saver.model.optimizer
    count, mine = wanted.count, wanted.mine
    with compat.weights_reader(filepath) as reader:
        if reader is None:
            warnings.warn(f"{filepath} holds no optimizer state: the optimizer's is left as it is", stacklevel=5)
            return
        if len(reader.keys()) != count:
            warnings.warn(
                f"Skipping variable loading for optimizer '{optimizer.name}', because it has {count} variables (in "
                f"the unsplit model) whereas the saved optimizer has {len(reader.keys())} variables.",
                stacklevel=5,
            )
            return
        for p in range(count):
            value = compat.read_value(reader, str(p), aligned_empty)
            for rank, positions in enumerate(wanted.by_rank):
                if rank != ROOT and p in positions:
                    _send_array(comm, value, rank, position=p)
            if p in mine:
                mine[p].assign(value)
