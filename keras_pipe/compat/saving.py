"""Internal: Keras' saving internals (``saving_lib``): pickle bytes, a weights-only load, keras_hub's LoRA file."""

from __future__ import annotations

import contextlib

from keras.src.saving import saving_lib

from keras_pipe.compat.tensors import read_into, variable_handle


def keras_pickle_bytes(model) -> bytes:
    """What Keras' own ``pickle.dumps(model)`` holds: the model as ``.keras`` bytes (``KerasSaveable.__reduce__``).

    Why: a pipeline pickles the whole model, gathered on rank 0, as Keras
    pickles one (Keras 3.0-3.15, ``saving_lib._save_model_to_fileobj``).
    """
    import io

    from keras.src.saving import saving_lib

    buffer = io.BytesIO()
    saving_lib._save_model_to_fileobj(model, buffer, "h5")
    return buffer.getvalue()


def keras_unpickle(data: bytes):
    """The model of :func:`keras_pickle_bytes`, compiled as it was (``KerasSaveable._unpickle_model``, Keras 3.15)."""
    import io

    from keras.src.saving import saving_lib

    return saving_lib._load_model_from_fileobj(io.BytesIO(data), custom_objects=None, compile=True, safe_mode=False)


def load_weights_only(model, filepath: str, skip_mismatch: bool, objects_to_skip) -> None:
    """``keras.saving.load_weights`` of a ``.weights.h5``/``.weights.json``/``.keras`` file (``saving_lib``, Keras
    3.0-3.15), without the deferral of :func:`unallocated_scope`."""
    from keras.src.saving import saving_lib

    saving_lib.load_weights_only(model, filepath, skip_mismatch=skip_mismatch, objects_to_skip=objects_to_skip)


def write_lora_file(filepath: str, rank: int, kernels: list) -> None:
    """keras_hub's ``Backbone.save_lora_weights`` file (``saving_lib.H5IOStore``, keras_hub 0.20-0.32): ``lora/rank``
    and ``lora/<index>/lora_kernel_a|b`` for each ``(index, a, b)`` of ``kernels``, the index counting the
    backbone's layers that hold weights.

    Why: the pipeline's backbone holds only this rank's LoRA kernels; rank 0
    writes what keras_hub writes, from the gathered values.
    """
    from keras.src.saving import saving_lib

    store = saving_lib.H5IOStore(filepath, mode="w")
    try:
        store.make("lora")["rank"] = rank
        for index, a, b in kernels:
            inner = store.make(f"lora/{index}")
            inner["lora_kernel_a"] = a
            inner["lora_kernel_b"] = b
    finally:
        store.close()


# -- Keras' weights layout, walked a stage a rank (the sharded checkpoint: keras_pipe/model/sharded.py) --------------


def own_variables(layer) -> list:
    """The variables ``layer.save_own_variables`` writes by default: its own, not its sublayers'
    (``Layer._trainable_variables + _non_trainable_variables``, Keras 3.0-3.15).

    Why: a rank writes a layer's entry of a weights file only where it
    answers for every one of these; the layer's own ``save_own_variables``
    (a ``Dense`` merging its LoRA kernels) would read another stage's.
    """
    return list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))


def save_state(model, store, skip=(), assets=None) -> None:
    """Keras' own walk of ``model`` into a weights ``store`` (``saving_lib._save_state``, Keras 3.0-3.15), the
    objects in ``skip`` (an optimizer) and everything under them left out.

    Why: the path of every layer's entry (``layers/dense_1/vars``) is Keras'
    walk's; a pipeline's rank writes the entries of its own stage at the
    paths the unsplit model's file has them.
    """
    from keras.src.saving import saving_lib

    skipped = {id(s) for s in skip}
    saving_lib._save_state(model, weights_store=store, assets_store=assets, inner_path="", visited_saveables=skipped)


def load_state(model, filepath: str, skip_mismatch: bool = False, skip=()) -> None:
    """Keras' ``load_weights`` of a ``.weights.h5``, ``.weights.json`` or ``.keras`` file into ``model`` (its walk,
    ``saving_lib._load_state``, and its error for what could not be read, as ``saving_lib.load_weights_only``
    does, Keras 3.12-3.15), without its check that the model is built, ``skip``'s objects left out.

    Why: a pipeline's rank walks the whole model of its own layers, a
    chain's in a ``Sequential`` it cannot build (building calls other
    stages' layers, whose weights it does not hold).
    """
    import zipfile

    filepath = str(filepath)
    archive = None
    if filepath.endswith(".weights.json"):
        store = saving_lib.ShardedH5IOStore(filepath, mode="r")
    elif filepath.endswith(".keras"):
        archive = zipfile.ZipFile(filepath, "r")
        store = saving_lib.H5IOStore(saving_lib._VARS_FNAME_H5, archive=archive, mode="r")
    else:
        store = saving_lib.H5IOStore(filepath, mode="r")
    failed, errors = set(), {}
    try:
        saving_lib._load_state(
            model,
            weights_store=store,
            assets_store=None,
            inner_path="",
            skip_mismatch=skip_mismatch,
            visited_saveables={id(s) for s in skip},
            failed_saveables=failed,
            error_msgs=errors,
        )
    finally:
        store.close()
        if archive is not None:
            archive.close()
    if failed:
        saving_lib._raise_loading_failure(errors, warn_only=skip_mismatch)


@contextlib.contextmanager
def readable_weights(filepath: str):
    """A path Keras' weights stores read quickly: a ``.keras`` archive's ``model.weights.h5`` copied out to a
    temporary file beside it (from the disk, a block at a time), any other file as it is (Keras 3.0-3.15's
    archive layout).

    Why: read inside the archive, each of HDF5's seeks backwards starts the zip member over from its first byte:
    rank 0 took a minute to read a 1 GiB model's ``.keras`` file entry by entry.
    """
    import os
    import shutil
    import tempfile
    import zipfile

    if not str(filepath).endswith(".keras"):
        yield filepath
        return
    directory = os.path.dirname(os.path.abspath(filepath))
    with zipfile.ZipFile(filepath) as archive, tempfile.NamedTemporaryFile(dir=directory, suffix=".weights.h5") as out:
        with archive.open(saving_lib._VARS_FNAME_H5) as member:
            shutil.copyfileobj(member, out, 16 * 1024 * 1024)
        out.flush()
        yield out.name


def entry_path(store) -> str:
    """The path of the entry a Keras weights store is at (``H5IOStore._h5_entry_path``, set by ``make`` and ``get``,
    Keras 3.0-3.15): inside a layer's ``save_own_variables`` or ``load_own_variables``, that layer's path."""
    return store._h5_entry_path


def entry_paths(model) -> dict:
    """``{path: layer}`` for every layer holding variables of its own, at the path Keras' walk writes it
    (:func:`save_state` with a store that records, writes nothing and allocates nothing)."""
    recorder = _PathRecorder()
    layers = [layer for layer in model._flatten_layers() if own_variables(layer)]
    for layer in layers:
        object.__setattr__(layer, "save_own_variables", lambda store, layer=layer: recorder.found(layer))
    try:
        optimizer = getattr(model, "optimizer", None)
        save_state(model, recorder, skip=[optimizer] if optimizer is not None else [])
    finally:
        for layer in layers:
            layer.__dict__.pop("save_own_variables", None)
    return recorder.paths


def write_keras_archive(filepath: str, model, write_weights) -> None:
    """Writes ``model``'s ``.keras`` file as Keras does (``saving_lib._save_model_to_fileobj``, Keras 3.0-3.15): its
    metadata and config, then ``write_weights(store, assets)`` into an HDF5 store on a temporary file beside it,
    added to the archive from the disk.

    Why: Keras keeps the weights file in memory while it writes an archive
    whose weights fit in memory; a pipeline's rank 0 writes the whole model's
    weights one entry at a time, as their owners send them, and must not hold
    them all.
    """
    import os
    import tempfile
    import zipfile

    from keras.src.saving import saving_lib

    config_json, metadata_json = saving_lib._serialize_model_as_json(model)
    with open(filepath, "wb") as f, zipfile.ZipFile(f, "w") as archive:
        archive.writestr(saving_lib._METADATA_FILENAME, metadata_json)
        archive.writestr(saving_lib._CONFIG_FILENAME, config_json)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(filepath)), suffix=".h5") as weights:
            store = saving_lib.H5IOStore(weights.name, mode="w")
            assets = saving_lib.DiskIOStore(saving_lib._ASSETS_DIRNAME, archive=archive, mode="w")
            try:
                write_weights(store, assets)
            finally:
                store.close()
                assets.close()
            archive.write(weights.name, saving_lib._VARS_FNAME_H5)


def read_keras_config(filepath: str) -> dict:
    """A ``.keras`` file's model config (``config.json``, Keras 3.0-3.15's archive), without its weights."""
    import json
    import zipfile

    from keras.src.saving import saving_lib

    with zipfile.ZipFile(filepath) as archive:
        return json.loads(archive.read(saving_lib._CONFIG_FILENAME))


@contextlib.contextmanager
def weights_reader(filepath: str):
    """Keras' store of a one-file weights file (``.weights.h5``, or a ``.keras`` archive's ``model.weights.h5``)
    at its optimizer's entry, or ``None`` where it has none (``saving_lib.H5IOStore``, Keras 3.0-3.15)."""
    import zipfile

    archive = zipfile.ZipFile(filepath, "r") if str(filepath).endswith(".keras") else None
    store = saving_lib.H5IOStore(saving_lib._VARS_FNAME_H5 if archive else filepath, archive=archive, mode="r")
    try:
        yield store.get("optimizer") if store.has_path("optimizer") else None
    finally:
        store.close()
        if archive is not None:
            archive.close()


def as_array(value):
    """``value`` (a variable, a tensor, an array) as a NumPy array: an array as it is, a variable's or tensor's
    buffer without a copy where DLPack can give it (a variable an embedding lookup has read is copied once, as
    TensorFlow reads it), one copy otherwise.

    Why: Keras' ``convert_to_numpy`` (TensorFlow backend, Keras 3.0-3.15)
    reads a variable into a tensor and copies that with ``np.array``: two
    copies of the value alive at once, which for the largest variable (a
    language model's embedding) is the largest part of a save's memory.
    """
    import numpy as np
    import tensorflow as tf

    if isinstance(value, np.ndarray):
        return value
    handle = variable_handle(value)
    tensor = handle.read_value() if isinstance(handle, tf.Variable) else handle
    if isinstance(tensor, tf.Tensor) and tf.executing_eagerly():
        try:
            return np.from_dlpack(tensor)  # (bfloat16 and a few other dtypes have no DLPack form in NumPy)
        except (BufferError, TypeError, ValueError, RuntimeError):
            pass
    return np.asarray(value)


class _HandedOver:
    """An array that ``np.array`` (NumPy 2: ``__array__(copy=True)``) takes as the copy it asked for."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype, copy=False)


def handed_over(value):
    """``value`` as Keras' weights stores take it without a copy of their own (:func:`as_array` first).

    Why: ``H5IOStore.__setitem__`` and ``ShardedH5IOStore.__setitem__``
    (Keras 3.0-3.15) convert every value with ``backend.convert_to_numpy``,
    which copies even an array (``np.array``), though HDF5 writes from the
    array's own buffer. With NumPy before 2 the store still copies, as it
    always did.
    """
    return _HandedOver(as_array(value))


class _HandingOver:
    """The store a layer's ``save_own_variables`` writes to, each value :func:`handed_over` to ``store``."""

    def __init__(self, store):
        self.store = store

    def __setitem__(self, key, value):
        self.store[key] = handed_over(value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def saved_own_variables(layer, store) -> None:
    """``layer``'s own ``save_own_variables`` (its class's, whatever is set on the object) into ``store``, each value
    handed over without Keras' second copy (:func:`handed_over`)."""
    type(layer).save_own_variables(layer, _HandingOver(store))


def safe_dataset(group, key: str):
    """The HDF5 dataset ``key`` of an entry's group, through Keras' own checks of it where Keras has them
    (``saving_lib.safe_get_h5_dataset``: no external or virtual data, no declared size far beyond the stored one,
    Keras 3.13-3.15); ``group[key]`` before."""
    check = getattr(saving_lib, "safe_get_h5_dataset", None)
    return check(group, key) if check is not None else group[key]


def read_value(store, key: str, allocate):
    """One value of the entry a Keras weights store is at, read from the file into ``allocate(shape, dtype)``'s
    array (one whose buffer TensorFlow can borrow: :func:`keras_pipe.compat.borrowed_tensor`); ``store[key]`` where
    the store is not a plain ``H5IOStore`` or the value not a plain array (bfloat16, a scalar).

    Why: ``H5IOStore.__getitem__`` (Keras 3.0-3.15) reads with ``np.array``
    into NumPy's own buffer, which TensorFlow must copy again to assign it;
    the HDF5 dataset behind it (``_h5_entry_group[key]``, checked as Keras
    checks it: :func:`safe_dataset`) reads into a buffer of the caller's.
    """
    import numpy as np

    value = entry_value_into(store._h5_entry_group, key, allocate) if type(store) is saving_lib.H5IOStore else None
    return np.asarray(store[key]) if value is None else value


def entry_value_into(group, key: str, allocate):
    """Value ``key`` of an entry's HDF5 group (checked as Keras checks it: :func:`safe_dataset`) read into
    ``allocate(shape, dtype)``'s array; ``None`` where the group is not yet a file's (Keras' empty stand-in) or the
    value not a plain array (:func:`~keras_pipe.compat.tensors.read_into`)."""
    return read_into(safe_dataset(group, key), allocate) if hasattr(group, "get") else None


def weights_file_writer(filepath: str):
    """Keras' store writing a ``.weights.h5`` file (``saving_lib.H5IOStore``, Keras 3.0-3.15)."""
    return saving_lib.H5IOStore(filepath, mode="w")


def weights_store_class():
    """Keras' HDF5 weights store (``saving_lib.H5IOStore``, Keras 3.0-3.15), which :func:`save_state` requires."""
    from keras.src.saving import saving_lib

    return saving_lib.H5IOStore


def sharded_reader(index_path: str):
    """Keras' reader of a sharded weights file (``saving_lib.ShardedH5IOStore``, Keras 3.12-3.15), opened on its
    index: ``reader.get("optimizer")[str(i)]`` reads one value from whichever shard holds it."""
    from keras.src.saving import saving_lib

    return saving_lib.ShardedH5IOStore(index_path, mode="r")


def optimizer_layout(optimizer, weights: list) -> list:
    """What each variable of ``optimizer``, built on ``weights``, is, in the order of its ``variables``, without
    allocating anything: ``(index, k)`` for the ``k``-th variable its build made for the weight numbered
    ``index`` (Adam's momentum ``k=0`` and velocity ``k=1``, Adafactor's row and column factors...), ``("own", k)``
    for its ``k``-th variable of no weight (iteration, learning rate, a loss scale); each with the shape the
    variable has.

    ``weights``: ``(index, path, shape, dtype)`` of the weights to build on, in order, ``index`` being the
    weight's number in the unsplit model's trainable weights. A copy of the optimizer (its class and config) is built on
    stand-ins named after those numbers, inside a throwaway graph where no variable takes memory; a variable
    the build makes belongs to the weight whose stand-in's name is in its own (Keras names a slot after its
    weight's path, ``BaseOptimizer.add_variable_from_reference``, or after the weight's name, Adafactor's
    factors, Keras 3.0-3.15).

    Why: Keras writes an optimizer's state as one list, ``optimizer/vars/<position>``, in its build's order.
    Each rank's optimizer holds its stage's slots; the unsplit model's order is read from the same build on
    every weight, not guessed: a layout built on all the weights and one built on a stage's give each of the
    stage's optimizer variables its position in the unsplit model's list.
    """
    import json
    import re

    import keras
    import tensorflow as tf

    config = optimizer.get_config()  # (eagerly: it reads the learning rate's value)
    # (each save asks again, and building the copy costs ~6 ms a variable: the same optimizer on the same weights has
    # the same layout; the learning rate, which callbacks change, makes no variable)
    key = (
        type(optimizer),
        json.dumps({k: v for k, v in config.items() if k != "learning_rate"}, sort_keys=True, default=repr),
        tuple((index, path, tuple(shape), str(dtype)) for index, path, shape, dtype in weights),
    )
    if key in _LAYOUTS:
        return list(_LAYOUTS[key])
    with tf.Graph().as_default():
        shadow = type(optimizer).from_config(config)
        stand_ins = [
            # (the weight's path in the name too: Muon chooses by it, "embedding" in a path taking AdamW's slots)
            keras.Variable(initializer="zeros", shape=tuple(shape), dtype=dtype, name=_stand_in_name(index, path))
            for index, path, shape, dtype in weights
        ]
        shadow.build(stand_ins)
        layout, counts = [], {}
        for variable in shadow.variables:
            found = re.search(r"keras_pipe_w(\d+)_", variable.path)
            owner = int(found.group(1)) if found else "own"
            counts[owner] = counts.get(owner, -1) + 1
            layout.append(((owner, counts[owner]), tuple(variable.shape)))
    if len(_LAYOUTS) >= 16:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[key] = tuple(layout)
    return layout


_LAYOUTS: dict = {}  # optimizer_layout's answers, by the optimizer's class and config and the weights'


def _stand_in_name(index: int, path: str) -> str:
    return f"keras_pipe_w{index}_{path.replace('/', '_')}"


def built_on(optimizer) -> list:
    """The variables ``optimizer`` was built on, in order (``BaseOptimizer._trainable_variables``, Keras 3.0-3.15).

    Why: the order of its slots is theirs; a pipeline builds its optimizer on its stage's weights.
    """
    inner = getattr(optimizer, "inner_optimizer", None)  # (LossScaleOptimizer builds its inner one on them)
    found = list(getattr(optimizer, "_trainable_variables", []) or [])
    return found or (built_on(inner) if inner is not None else [])


class _PathRecorder(saving_lib.H5IOStore):
    """A weights store for :func:`entry_paths`: ``make`` notes the path; nothing is written (no file)."""

    def __init__(self):
        self.paths, self.path = {}, None

    def __bool__(self):
        return True

    def make(self, path, metadata=None):
        self.path = path
        return self

    def found(self, layer) -> None:
        self.paths[self.path] = layer

    def __setitem__(self, key, value):  # (a layer whose save_own_variables was not replaced: nothing is kept)
        pass


def create_h5_group(store, path: str, metadata) -> None:
    """``H5IOStore._create_h5_group`` (Keras 3.12-3.15): a store's group for the entry at ``path``, made once its
    first value comes (as Keras' own store does), in a shard writer that rolls over to new files."""
    store._create_h5_group(path, metadata=metadata)


def lora_enabled_layers(backbone) -> list:
    """keras_hub's ``Backbone._lora_enabled_layers`` (0.18-0.32): the numbers of the layers ``enable_lora`` gave LoRA
    kernels, in its own numbering (empty for any other layer)."""
    return getattr(backbone, "_lora_enabled_layers", None) or []


def lora_rank(backbone) -> int:
    """keras_hub's ``Backbone._lora_rank`` (0.18-0.32), written in the ``.lora.h5`` file."""
    return backbone._lora_rank
