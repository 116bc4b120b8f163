"""Internal: Keras' saving internals (``saving_lib``): pickle bytes, a weights-only load, keras_hub's LoRA file."""

from __future__ import annotations


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
