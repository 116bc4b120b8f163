"""Internal: :func:`check` fails loudly when a Keras or TensorFlow upgrade removes an internal of this package."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_pipe.compat.tensors import get_mask, global_seed, variable_handle
from keras_pipe.compat.training import BACKUP_ATTRIBUTES, file_utils
from keras_pipe.compat.variables import unallocated_scope


def check() -> None:
    """Raises ``AttributeError`` naming each internal above that this Keras/TensorFlow lacks."""
    layer = keras.layers.Dropout(0.5)
    layer.build((None, 2))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse", metrics=["mae"])
    callback = keras.callbacks.BackupAndRestore("/tmp/keras_pipe_compat_check")
    needed = [
        (layer, "_flatten_layers"),
        (layer, "_get_own_losses"),
        (layer, "_get_regularization_losses"),
        (layer, "_seed_generators"),
        (model, "_compile_loss"),
        (model, "_compile_metrics"),
        (model, "_loss_tracker"),
        (model, "_compile_config"),
        (model, "_initial_epoch"),
        (keras.metrics.Mean(), "total"),
        (keras.metrics.Mean(), "count"),
        *[(callback, name) for name in BACKUP_ATTRIBUTES],
    ]
    from keras.src.saving import saving_lib

    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    needed += [
        (layer, "_trainable_variables"),
        (layer, "_non_trainable_variables"),
        (optimizer, "_trainable_variables"),
        *[
            (saving_lib, name)
            for name in (
                "_save_state",
                "_load_state",
                "_raise_loading_failure",
                "_serialize_model_as_json",
                "_METADATA_FILENAME",
                "_CONFIG_FILENAME",
                "_VARS_FNAME_H5",
                "_ASSETS_DIRNAME",
                "H5IOStore",
                "ShardedH5IOStore",
                "DiskIOStore",
                "load_weights_only",
            )
        ],
    ]
    inputs = keras.Input((2,))
    functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    needed += [
        (keras.Model, "_flatten_metrics_in_order"),
        (keras.metrics.Accuracy(), "_direction"),
        (functional, "_inputs_struct"),
        (functional, "_outputs_struct"),
        (functional, "_build_shapes_dict"),
        (model, "_distribute_strategy"),
        (keras.losses.SparseCategoricalCrossentropy(), "_fn_kwargs"),
        (layer, "_convert_input_args"),
        (keras.Variable(1.0), "_initializer"),
        (keras.Variable(1.0), "_deferred_initialize"),
        (keras.callbacks.TensorBoard, "_train_writer"),  # (the class's: the instance's property makes a writer)
        (keras.callbacks.TensorBoard, "_log_weights"),
        (keras.callbacks.TensorBoard, "_log_weight_as_image"),
        (keras.callbacks.TensorBoard, "_write_keras_model_summary"),
        (keras.callbacks.ModelCheckpoint, "_save_model"),
        (saving_lib.H5IOStore, "_create_h5_group"),
    ]
    missing = [
        f"{obj.__name__ if isinstance(obj, type) else type(obj).__name__}.{name}"
        for obj, name in needed
        if not hasattr(obj, name)
    ]
    try:
        _ = file_utils().exists
        global_seed()
        get_mask(tf.zeros(1))
        with unallocated_scope():
            pass
    except (ImportError, AttributeError) as error:
        missing.append(str(error))
    concrete = tf.function(lambda x: x + 1).get_concrete_function(tf.TensorSpec((), tf.float32))
    if not hasattr(concrete, "_call_flat"):
        missing.append("ConcreteFunction._call_flat")
    if not isinstance(variable_handle(layer.seed_generator.state), tf.Variable):
        missing.append("KerasVariable.value is not a tf.Variable")
    if missing:
        raise AttributeError(
            f"keras_pipe {keras.__version__=} {tf.__version__=}: internals gone: {', '.join(missing)}. "
            "Update keras_pipe/compat/ for this version."
        )
