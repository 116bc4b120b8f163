"""``keras_pipe.load_model``: a ``.keras`` file opened as a pipeline, on any number of ranks."""

from __future__ import annotations

import keras

from keras_pipe.comm import Communicator
from keras_pipe.model import PipelineModel
from keras_pipe.saving import ROOT, load_into, on_root


def load_model(filepath, custom_objects=None, safe_mode: bool = True, **pipeline_options):
    """Opens a ``.keras`` file saved by ``PipelineModel`` (on any number of ranks) or by plain Keras.

    Rank 0 reads the file (with Keras' ``safe_mode``); every rank rebuilds
    the layers from the model's JSON config and receives its stage's weights
    and optimizer state, so training resumes exactly.

    Example:

    ```python
    model = keras_pipe.load_model("model.keras", num_microbatches=4)
    model.fit(x, y, epochs=1)
    ```
    """
    comm = Communicator()

    def read():
        loaded = keras.models.load_model(filepath, custom_objects=custom_objects, safe_mode=safe_mode)
        if not isinstance(loaded, keras.Sequential):
            raise ValueError(f"{filepath} holds a {type(loaded).__name__}; keras_pipe loads Sequential models")
        return loaded

    sequential = on_root(comm, read, f"load {filepath}", reading=filepath)
    description = comm.bcast_json(_summary_of(sequential) if comm.rank == ROOT else None, root=ROOT)
    with keras.saving.custom_object_scope(custom_objects or {}):
        layers = [keras.saving.deserialize_keras_object(c, safe_mode=safe_mode) for c in description["layers"]]
        shape, dtype = description["input"]
        pipeline_options.setdefault("name", description["name"])
        model = PipelineModel([keras.Input(batch_shape=tuple(shape), dtype=dtype), *layers], **pipeline_options)
        model.build()
        if description["compile"] is not None:
            model.compile_from_config(description["compile"])
    load_into(model, sequential)
    return model


def _summary_of(sequential: keras.Sequential) -> dict:
    config = sequential.get_config()
    layers = [c for c in config["layers"] if c["class_name"] != "InputLayer"]
    first = sequential.inputs[0]
    compile_config = sequential.get_compile_config() if sequential.compiled else None
    return {
        "name": sequential.name,
        "layers": layers,
        "input": [list(first.shape), str(first.dtype)],
        "compile": compile_config,
    }
