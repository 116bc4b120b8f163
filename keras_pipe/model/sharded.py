"""Sharded checkpoints in Keras' own layout, written a stage a rank and read on any layout.

``model.save_weights("m.weights.json")`` (optionally ``max_shard_size=`` in
GB, as Keras takes it) writes Keras' sharded weights layout: an index,
``m.weights.json`` (``{"metadata": ..., "weight_map": {"/layers/dense/vars":
[shard file], ...}}``), beside ``.weights.h5`` shards. Each rank of the first
replica writes the entries of the weights its stage answers for, at the
paths the unsplit model's file has them (Keras' own walk of the model,
:func:`keras_pipe.compat.save_state`), and its optimizer slots at their
positions in the unsplit optimizer's list (:func:`keras_pipe.compat.optimizer_layout`),
into shard files of its own, in parallel; no rank holds more than its stage
and the one value being written. Rank 0 writes the index last: the index is
the commit. Plain Keras' ``model.load_weights("m.weights.json")`` on the
unsplit model reads it, weights and optimizer state.

Files beside the index::

    m.weights.json                              the index (replaced atomically: the commit)
    m_00000.weights.h5                          empty: Keras' reader opens it first, whatever the index says
    m_stage00002-00000.<save>.weights.h5        stage 2's first shard of the save named <save>

A save writes new shard names (``<save>`` is new each time), so that a save
killed part way, on any rank, leaves the previous index and every shard it
names in place; the shards no index names any more (a previous save's, a
killed one's) are removed once the new index is in place. Every rank must
see the directory (a shared filesystem): rank 0 checks that it sees every
rank's shards before writing the index, and raises on every rank otherwise.

Loading (:func:`load`) needs no particular layout: every rank walks the
whole model as Keras does and reads only the values of the weights it holds
(:func:`keras_pipe.compat.held_only_loading`), and its optimizer slots from
their positions in the file; a pipeline of any number of stages, replicas,
schedule or chunks, or plain Keras, reads what any of them wrote.
"""

from __future__ import annotations

import glob
import json
import os
import re
import uuid
import warnings

import h5py

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError, PipelineIOError
from keras_pipe.model.transfer import ROOT, on_root, trainable_index
from keras_pipe.model.weights import ordered, read_held
from keras_pipe.mpi.files import atomic_path, describe_unreadable, is_remote, write_text

INDEX = ".weights.json"
OPTIMIZER = "optimizer"
ANCHOR_ATTRIBUTE = "keras_pipe_anchor"
METADATA = "keras_pipe"  # the index's metadata entry of keras_pipe's own (the save's name, the stages that wrote it)


def wants_sharded(filepath, max_shard_size) -> bool:
    """Whether ``save_weights(filepath, max_shard_size=...)`` writes the sharded layout (a ``.weights.json`` path, or
    any ``max_shard_size``, which Keras takes for a ``.weights.h5`` path too, renaming it)."""
    return max_shard_size is not None or os.fspath(filepath).endswith(INDEX)


def index_path(filepath, max_shard_size) -> str:
    """The index's path, as Keras' ``save_weights`` checks and renames it."""
    filepath = os.fspath(filepath)
    if filepath.endswith(INDEX):
        return filepath
    if filepath.endswith(".weights.h5"):
        renamed = filepath[: -len(".h5")] + ".json"
        warnings.warn(
            f"Saving sharded weights requires `*.json` as the extension. The original path: {filepath} will be "
            f"renamed to {renamed}.",
            stacklevel=4,
        )
        return renamed
    raise PipelineConfigError(
        "The filename must end in `.weights.json` when `max_shard_size` is specified (a sharded checkpoint, Keras' "
        f"layout). Received: filepath={filepath}"
    )


def base_of(index: str) -> str:
    """Keras' shard stem: ``out/m.weights.json`` -> ``out/m`` (its shards are ``out/m_NNNNN.weights.h5``)."""
    return index[: -len(INDEX)]


def shard_name(base: str, stage: int, k: int, save: str) -> str:
    return f"{os.path.basename(base)}_stage{stage:05d}-{k:05d}.{save}.weights.h5"


def _shard_pattern(base: str):
    return re.compile(re.escape(os.path.basename(base)) + r"_stage\d{5}-\d{5}\.([0-9a-f]+)\.weights\.h5$")


# -- saving ----------------------------------------------------------------------


def save(saver, filepath, overwrite: bool = True, max_shard_size=None, finish=None, keep=()) -> str:
    """Writes the pipeline's weights and optimizer state in Keras' sharded layout (collective); returns the index.

    ``max_shard_size``: GB a shard file holds at most (Keras' meaning; a
    value larger than that is one shard of its own); ``None``: one shard
    file a stage. ``finish(metadata)`` runs on rank 0 before the index is
    written, to add entries to its metadata (``BackupAndRestore``'s
    position). ``keep``: other indexes beside this one whose shards must
    stay (a previous backup).
    """
    model, engine = saver.model, saver.engine
    model.build()
    index = index_path(filepath, max_shard_size)
    if is_remote(index):
        raise PipelineConfigError(
            f"{index}: a sharded checkpoint is written a stage a rank into one directory every rank sees; remote "
            "paths (gs://, s3://...) are not supported. Save to a shared filesystem, or use a .weights.h5 path."
        )
    world = engine.world
    exists = world.bcast_json(os.path.exists(index) if world.rank == ROOT else None, root=ROOT)
    if exists and not overwrite:
        raise FileExistsError(f"{index} exists and overwrite=False; pass overwrite=True to replace it")
    limit = float("inf") if max_shard_size is None else float(max_shard_size) * 1024**3
    save_id = world.bcast_json(uuid.uuid4().hex[:12] if world.rank == ROOT else None, root=ROOT)
    base = base_of(index)
    if world.rank == ROOT:
        os.makedirs(os.path.dirname(index) or ".", exist_ok=True)
    world.barrier()

    optimizer = model.optimizer if model.compiled else None
    # (agreed before any rank writes: a rank whose write fails must not leave the others in a collective)
    with_state = all(engine.pipeline.allgather_json(bool(optimizer is not None and optimizer.built)))
    written, error = _write_own_part(saver, base, save_id, limit, with_state), None
    if isinstance(written, str):
        written, error = None, written
    reports = world.allgather_json(error if error else written)
    failed = [(rank, r) for rank, r in enumerate(reports) if isinstance(r, str)]
    own_files = [] if written is None else written["files"]
    if failed:
        _remove(os.path.dirname(index), own_files)
        rank, problem = failed[0]
        raise PipelineIOError(f"rank {rank} could not write its shard of {index}: {problem}")

    def commit():
        parts = [r for r in reports if r["files"] or r["map"] or r["called"] or r["skipped"]]
        _check_complete(index, parts)
        weight_map = {}
        for part in parts:  # (rank order: a group several stages wrote, the optimizer's, lists each one's shard)
            for group, names in part["map"].items():
                weight_map.setdefault(group, [])
                weight_map[group] += [n for n in names if n not in weight_map[group]]
        metadata = {
            "total_size": sum(part["size"] for part in parts),
            METADATA: {"save": save_id, "stages": engine.num_stages, "format": 1},
        }
        if finish is not None:
            finish(metadata)
        anchor = f"{base}_00000.weights.h5"
        ours = _is_anchor(anchor)
        if not os.path.exists(anchor):
            _write_anchor(anchor)  # (before the index: Keras' reader opens it first)
        write_text(index, json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=4))
        if not ours and os.path.exists(anchor) and not _is_anchor(anchor):
            _write_anchor(anchor)  # (a plain Keras shard the previous index named: replaced once it names it no more)
        _remove_stale(base, keep_saves={save_id, *(_save_of(other) for other in keep)})

    try:
        on_root(world, commit, f"write the index {index}")
    except PipelineIOError:
        _remove(os.path.dirname(index), own_files)
        raise
    return index


def _write_own_part(saver, base: str, save_id: str, limit: float, with_state: bool):
    """This rank's shards: the entries of the weights and optimizer slots it answers for. Returns what it wrote
    (``{"files", "map", "size", "called", "skipped"}``), or the error's text."""
    engine = saver.engine
    if engine.replica != 0:  # (the first replica writes; the others hold the same values)
        return {"files": [], "map": {}, "size": 0, "called": [], "skipped": []}
    entries = ordered(engine)
    answered = {id(v) for v, owner, here in entries if here and owner == engine.stage}
    directory = os.path.dirname(base)
    writer = _ShardWriter(lambda k: os.path.join(directory, shard_name(base, engine.stage, k, save_id)), limit)
    called, skipped, patched = [], [], []
    try:
        whole = saver.walked()
        for layer in compat.sublayers(whole):
            own = compat.own_variables(layer)
            if not own:
                continue
            mine = all(id(v) in answered for v in own)
            _record_save(layer, writer, called if mine else skipped, run=mine)
            patched.append(layer)
        try:
            optimizer = getattr(whole, "optimizer", None)
            compat.save_state(whole, writer, skip=[optimizer] if optimizer is not None else [])
        finally:
            for layer in patched:
                layer.__dict__.pop("save_own_variables", None)
        if with_state:
            _write_optimizer(saver, writer, entries)
        writer.close()
    except Exception as failure:  # noqa: BLE001 - every rank raises the first rank's error
        writer.close()
        _remove(directory, writer.files)
        return f"{type(failure).__name__}: {failure}"
    return {"files": writer.files, "map": writer.weight_map, "size": writer.total, "called": called, "skipped": skipped}


def _record_save(layer, writer, paths: list, run: bool) -> None:
    """Makes ``layer.save_own_variables`` (for the walk's time) note the entry's path, and write it only if ``run``."""
    own = type(layer).save_own_variables

    def save_own_variables(store):
        paths.append(writer.entry_path)
        if run:
            own(layer, store)

    object.__setattr__(layer, "save_own_variables", save_own_variables)


def _write_optimizer(saver, writer, entries) -> None:
    """This rank's optimizer slots at their positions in the unsplit model's optimizer list (``optimizer/vars``);
    the optimizer's own variables (iteration, learning rate) from the first stage."""
    model, engine = saver.model, saver.engine
    optimizer = model.optimizer
    positions, local = optimizer_positions(model, entries)
    owners = trainable_owners(entries)
    writer.make(OPTIMIZER, metadata={"name": optimizer.name})
    for (key, _), variable in zip(local, optimizer.variables):
        owner, _ = key
        if (owner == "own" and engine.stage == 0) or (owner != "own" and owners[owner] == engine.stage):
            writer[str(positions[key])] = variable


def trainable_owners(entries) -> dict:
    index = trainable_index([v for v, _, _ in entries])
    return {index[id(v)]: owner for v, owner, _ in entries if id(v) in index}


def optimizer_positions(model, entries):
    """``(key -> position in the unsplit optimizer's list, [(key, shape)] of this rank's optimizer.variables)``,
    checked against this rank's optimizer variable by variable."""
    optimizer = model.optimizer
    weights = [v for v, _, _ in entries]
    index = trainable_index(weights)
    trainable = [v for v in weights if id(v) in index]
    unsplit = compat.optimizer_layout(optimizer, [(index[id(v)], v.path, v.shape, v.dtype) for v in trainable])
    mine = compat.built_on(optimizer)
    outside = [v.path for v in mine if id(v) not in index]
    if outside:
        raise PipelineIOError(f"the optimizer was built on weights that are not the model's trainable ones: {outside}")
    local = compat.optimizer_layout(optimizer, [(index[id(v)], v.path, v.shape, v.dtype) for v in mine])
    real = optimizer.variables
    if len(local) != len(real) or any(tuple(s) != tuple(v.shape) for (_, s), v in zip(local, real)):
        raise PipelineIOError(
            f"{type(optimizer).__name__}'s variables on this stage ({len(real)}) are not what its build on the "
            f"stage's weights makes ({len(local)}): its state cannot be placed in the unsplit model's order"
        )
    return {key: p for p, (key, _) in enumerate(unsplit)}, local


def _check_complete(index: str, parts: list) -> None:
    """Every entry some rank left to another was written by one (rank 0, before the index is written)."""
    called = {path for part in parts for path in part["called"]}
    missing = sorted({path for part in parts for path in part["skipped"]} - called)
    if missing:
        raise PipelineIOError(
            f"no stage wrote {missing[:5]}: their weights are held by no stage of the first replica, so {index} "
            "would lack them"
        )
    directory = os.path.dirname(index)
    unseen = [name for part in parts for name in part["files"] if not os.path.exists(os.path.join(directory, name))]
    if unseen:
        raise PipelineIOError(
            f"rank 0 does not see {unseen[:3]}, which other ranks wrote into {directory or '.'}: a sharded checkpoint "
            "needs a directory every rank sees (a shared filesystem). Use a .weights.h5 path otherwise: rank 0 "
            "writes it whole."
        )


class _ShardWriter(compat.weights_store_class()):
    """A rank's shard files in Keras' layout: the entries it is given, each at its group's path, rolled over to a
    new file past ``limit`` bytes; ``weight_map`` maps each group (``/layers/dense/vars``) to the files holding it.

    Keras' walk (``compat.save_state``) calls ``make(path)``, then the layer's
    ``save_own_variables`` sets ``store[key] = value``; a group is created
    only once a value comes (as Keras' own store does).
    """

    def __init__(self, path_of, limit: float):  # (not H5IOStore's: no file until a value comes)
        self.mode, self.archive, self.io_file = "w", None, None
        self.path_of, self.limit = path_of, limit
        self.h5_file, self.files, self.weight_map = None, [], {}
        self.total = self.in_file = 0
        self.entry_path, self.entry_metadata = None, None
        self._h5_entry_path, self._h5_entry_group, self._h5_entry_initialized = None, {}, False

    def __bool__(self):
        return True

    def make(self, path, metadata=None):
        self.entry_path, self.entry_metadata = path, metadata
        self._h5_entry_path, self._h5_entry_group, self._h5_entry_initialized = path, {}, False
        return self

    def __setitem__(self, key, value):
        value = compat.as_array(value)  # (one copy of a variable, as Keras' store would make two)
        size = value.nbytes
        if self.h5_file is None or (self.in_file and self.in_file + size > self.limit):
            self._next_file()
        if not self._h5_entry_initialized:
            compat.create_h5_group(self, self.entry_path, self.entry_metadata)
        super().__setitem__(key, compat.handed_over(value))
        self.in_file += size
        self.total += size
        names = self.weight_map.setdefault(self._h5_entry_group.name, [])
        if self.files[-1] not in names:
            names.append(self.files[-1])

    def _next_file(self) -> None:
        if self.h5_file is not None:
            self.h5_file.close()
        path = self.path_of(len(self.files))
        self.h5_file = h5py.File(path, "w")
        self.files.append(os.path.basename(path))
        self.in_file = 0
        self._h5_entry_initialized = False

    def close(self):
        if self.h5_file is not None:
            self.h5_file.close()
            self.h5_file = None


def _write_anchor(anchor: str) -> None:
    with atomic_path(anchor) as temporary, h5py.File(temporary, "w") as f:
        f.attrs[ANCHOR_ATTRIBUTE] = 1


def _is_anchor(path: str) -> bool:
    try:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get(ANCHOR_ATTRIBUTE, 0))
    except OSError:
        return False


def _save_of(index: str):
    try:
        with open(index) as f:
            return json.load(f)["metadata"][METADATA]["save"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_stale(base: str, keep_saves: set) -> None:
    """Removes the shards of this index's name that no kept save names (a previous save's, a killed save's)."""
    pattern = _shard_pattern(base)
    stem = os.path.basename(base)
    keras_shard = re.compile(re.escape(stem) + r"_(\d{5})\.weights\.h5$")  # (plain Keras' shards of this name)
    directory = os.path.dirname(base) or "."
    for path in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(stem)}_*.weights.h5")):
        ours, theirs = pattern.match(os.path.basename(path)), keras_shard.match(os.path.basename(path))
        if (ours and ours.group(1) not in keep_saves) or (theirs and theirs.group(1) != "00000"):
            try:
                os.remove(path)
            except OSError:
                pass


def _remove(directory: str, names) -> None:
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass


# -- loading ---------------------------------------------------------------------


def load(saver, filepath, skip_mismatch: bool = False) -> None:
    """Reads a sharded checkpoint (this module's or plain Keras') into the pipeline, on any layout (collective).

    Every rank runs Keras' own load over the whole model, reading only the
    values of the weights it holds, then its optimizer's slots from their
    positions in the file's optimizer list (as Keras, a file without the
    optimizer's state, or with another number of variables, leaves it as it
    is, with Keras' warning).
    """
    model, engine = saver.model, saver.engine
    model.build()
    filepath = os.fspath(filepath)
    whole = saver.walked()
    optimizer = getattr(whole, "optimizer", None)

    def load_all():
        try:
            with open(filepath) as f:
                json.load(f)["weight_map"]
        except Exception as failure:  # noqa: BLE001 - said as what it is: missing, damaged, not an index
            raise PipelineIOError(describe_unreadable(filepath, failure)) from failure
        compat.load_state(whole, filepath, skip_mismatch, [optimizer] if optimizer is not None else [])
        _load_optimizer(saver, filepath)

    read_held(engine, load_all, f"loading the sharded checkpoint {filepath}")


def _load_optimizer(saver, filepath: str) -> None:
    model, engine = saver.model, saver.engine
    optimizer = model.optimizer if model.compiled else None
    if optimizer is None:
        return
    reader = compat.sharded_reader(filepath)
    try:
        if f"/{OPTIMIZER}/vars" not in reader.sharding_config.get("weight_map", {}):
            if engine.world.rank == ROOT:
                warnings.warn(f"{filepath} holds no optimizer state: the optimizer's is left as it is", stacklevel=4)
            return
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        positions, local = optimizer_positions(model, ordered(engine))
        store = reader.get(OPTIMIZER)
        count = len(store.keys())
        if count != len(positions):
            if engine.world.rank == ROOT:
                warnings.warn(
                    f"Skipping variable loading for optimizer '{optimizer.name}', because it has {len(positions)} "
                    f"variables (in the unsplit model) whereas the saved optimizer has {count} variables.",
                    stacklevel=4,
                )
            return
        for (key, _), variable in zip(local, optimizer.variables):
            variable.assign(store[str(positions[key])])
    finally:
        reader.close()
