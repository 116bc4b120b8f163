"""``keras_pipe.load_model``: a ``.keras`` file opened as a pipeline, on any number of ranks."""

from __future__ import annotations

import zipfile

import keras

from keras_pipe import compat
from keras_pipe.model.model import PipelineModel
from keras_pipe.model.saving import compile_whole
from keras_pipe.model.transfer import ROOT, load_into, on_root
from keras_pipe.mpi.comm import Communicator


def load_model(filepath, custom_objects=None, safe_mode: bool = True, **pipeline_options):
    """Opens a ``.keras`` file saved by ``PipelineModel`` (on any number of ranks) or by plain Keras.

    Rank 0 reads the file's config (with Keras' ``safe_mode``); every rank
    rebuilds the model from it without allocating its weights, cuts it,
    allocates its own stage's and receives them with their optimizer state,
    entry by entry as rank 0 reads them (no rank holds more than its stage
    and one layer's values), so training resumes exactly. A ``Sequential`` file gives a chain, any
    other model its own class's graph (a keras_hub ``GPT2CausalLM``).

    Example:

    ```python
    model = keras_pipe.load_model("model.keras", num_microbatches=4)
    model.fit(x, y, epochs=1)
    ```
    """
    comm = Communicator()

    def read():
        if zipfile.is_zipfile(filepath):  # (a .keras file: its config only; the weights are read after, streamed)
            return None, read_config(filepath, custom_objects, safe_mode)
        whole, compile_config = read_whole(filepath, custom_objects, safe_mode)
        return whole, _summary_of(whole, compile_config)

    whole, description = on_root(comm, read, f"load {filepath}", reading=filepath) or (None, None)
    description = comm.bcast_json(description if comm.rank == ROOT else None, root=ROOT)
    streamed = comm.bcast_json(whole is None if comm.rank == ROOT else None, root=ROOT)
    with keras.saving.custom_object_scope(custom_objects or {}):
        pipeline_options.setdefault("name", description["name"])
        if description["layers"] is not None:
            # (Keras builds a layer from its config's build_config: unallocated, each rank then allocates its own)
            with compat.unallocated_scope():
                layers = [keras.saving.deserialize_keras_object(c, safe_mode=safe_mode) for c in description["layers"]]
            shape, dtype = description["input"]
            model = PipelineModel([keras.Input(batch_shape=tuple(shape), dtype=dtype), *layers], **pipeline_options)
            model.build()
        else:
            with compat.unallocated_scope():
                source = keras.saving.deserialize_keras_object(description["model"], safe_mode=safe_mode)
            model = PipelineModel.from_model(source, **pipeline_options)
        if description["compile"] is not None:
            model.compile_from_config(description["compile"])
    if streamed:
        model.load_weights(filepath)  # (rank 0 reads the archive's weights entry by entry: model/streaming.py)
    else:
        load_into(model, whole)
    return model


def read_config(filepath, custom_objects=None, safe_mode: bool = True) -> dict:
    """Rank 0: what every rank needs to make the pipeline of a ``.keras`` file (its layers' or model's config, its
    compile config), from the file's config alone: the model is made without memory for its weights."""
    config = compat.read_keras_config(filepath)
    compile_config = config.pop("compile_config", None)
    with keras.saving.custom_object_scope(custom_objects or {}), compat.unallocated_scope():
        whole = keras.saving.deserialize_keras_object(config, safe_mode=safe_mode)
    return _summary_of(whole, compile_config)


def read_whole(filepath, custom_objects=None, safe_mode: bool = True):
    """Rank 0: ``(the whole model, its compile config)`` from a ``.keras`` file, compiled as it was saved.

    As ``keras.models.load_model``, except that the model is compiled with
    the file's own compile config before its weights and optimizer state are
    read: Keras skips that for a model whose class has a ``compile()`` of its
    own (keras_hub's task models), which would keep that class's defaults.
    """
    import json
    import zipfile

    if not zipfile.is_zipfile(filepath):
        whole = keras.models.load_model(filepath, custom_objects=custom_objects, safe_mode=safe_mode)
        return whole, (whole.get_compile_config() if whole.compiled else None)
    with zipfile.ZipFile(filepath) as archive:
        config = json.loads(archive.read("config.json"))
    compile_config = config.pop("compile_config", None)
    with keras.saving.custom_object_scope(custom_objects or {}):
        whole = keras.saving.deserialize_keras_object(config, safe_mode=safe_mode)
        if compile_config is not None:
            compile_whole(whole, compile_config)
    whole.load_weights(filepath)
    return whole, compile_config


def _summary_of(whole: keras.Model, compile_config) -> dict:
    if isinstance(whole, keras.Sequential):
        config = whole.get_config()
        first = whole.inputs[0]
        return {
            "name": whole.name,
            "layers": [c for c in config["layers"] if c["class_name"] != "InputLayer"],
            "input": [list(first.shape), str(first.dtype)],
            "model": None,
            "compile": compile_config,
        }
    config = keras.saving.serialize_keras_object(whole)
    config.pop("compile_config", None)  # compiled once the pipeline exists, not on the unallocated graph
    return {
        "name": whole.name,
        "layers": None,
        "input": None,
        "model": config,
        "compile": compile_config,
    }
