"""Internal: every use of Keras' and TensorFlow's private internals, in one package.

keras_pipe reaches into Keras where no public API says what it needs. Each
function names what it uses, why, and the versions it was written against
(Keras 3.15, TensorFlow 2.21; the older releases noted were read too). The
modules go by theme: :mod:`~keras_pipe.compat.layers` (sublayers, the weights
that train, a layer's losses and generators), :mod:`~keras_pipe.compat.training`
(Keras' trainer: the compiled loss and metrics, the loss helpers, the
callbacks' internals), :mod:`~keras_pipe.compat.functional` (a Functional
model's nodes and inputs), :mod:`~keras_pipe.compat.variables` (variables
without memory and the weights files loaded into them),
:mod:`~keras_pipe.compat.saving` (pickle bytes, a weights-only load, keras_hub's
LoRA file, Keras' weights layout walked a stage a rank) and :mod:`~keras_pipe.compat.tensors` (TensorFlow's internals, a
tensor's mask). Every name is imported here: the rest of keras_pipe writes
``compat.name``. ``tests/test_compat.py`` calls :func:`check`, which fails
loudly, naming the missing attribute, when a Keras or TensorFlow upgrade
removes one.
"""

from keras_pipe.compat.check import check
from keras_pipe.compat.functional import (
    call_operation,
    check_input_shapes,
    check_input_structure,
    execution_order,
    flat_inputs,
    input_shape_argument,
    is_functional,
    sequential_functional,
    standardize_inputs,
)
from keras_pipe.compat.layers import (
    own_losses,
    seed_generators,
    sublayers,
    trained_weights,
    weight_regularization_losses,
)
from keras_pipe.compat.saving import (
    built_on,
    entry_path,
    entry_paths,
    keras_pickle_bytes,
    keras_unpickle,
    load_state,
    load_weights_only,
    optimizer_layout,
    own_variables,
    read_keras_config,
    readable_weights,
    save_state,
    sharded_reader,
    weights_file_writer,
    weights_reader,
    weights_store_class,
    write_keras_archive,
    write_lora_file,
)
from keras_pipe.compat.tensors import call_concrete, executing_eagerly, get_mask, global_seed, set_mask, variable_handle
from keras_pipe.compat.training import (
    BACKUP_ATTRIBUTES,
    DataAdapter,
    apply_mask,
    backup_paths,
    compile_config_metrics,
    compiled_loss,
    compiled_metrics,
    file_utils,
    is_default_hook,
    loss_terms,
    loss_tracker,
    makedirs_tolerating_existing,
    metric_containers,
    replace_backup_io,
    scale_loss_for_distribution,
    set_backup_weights_paths,
    set_initial_epoch,
    set_mean_state,
    squeeze_or_expand_to_same_rank,
    write_model_summary,
)
from keras_pipe.compat.variables import (
    DEFERRED_LOADS,
    allocate_with,
    allocating_scope,
    held_only_loading,
    lent_values,
    named_as_built,
    release_variable,
    restore_initializer,
    unallocated,
    unallocated_scope,
)

__all__ = [
    "BACKUP_ATTRIBUTES",
    "DataAdapter",
    "DEFERRED_LOADS",
    "allocate_with",
    "allocating_scope",
    "built_on",
    "apply_mask",
    "backup_paths",
    "call_concrete",
    "call_operation",
    "check",
    "check_input_shapes",
    "check_input_structure",
    "compile_config_metrics",
    "compiled_loss",
    "compiled_metrics",
    "entry_path",
    "entry_paths",
    "executing_eagerly",
    "execution_order",
    "file_utils",
    "flat_inputs",
    "get_mask",
    "global_seed",
    "held_only_loading",
    "input_shape_argument",
    "is_default_hook",
    "is_functional",
    "keras_pickle_bytes",
    "keras_unpickle",
    "lent_values",
    "load_state",
    "load_weights_only",
    "loss_terms",
    "loss_tracker",
    "makedirs_tolerating_existing",
    "metric_containers",
    "named_as_built",
    "optimizer_layout",
    "own_variables",
    "read_keras_config",
    "readable_weights",
    "own_losses",
    "release_variable",
    "replace_backup_io",
    "restore_initializer",
    "save_state",
    "scale_loss_for_distribution",
    "seed_generators",
    "sequential_functional",
    "set_backup_weights_paths",
    "set_initial_epoch",
    "set_mask",
    "sharded_reader",
    "set_mean_state",
    "squeeze_or_expand_to_same_rank",
    "standardize_inputs",
    "sublayers",
    "trained_weights",
    "unallocated",
    "unallocated_scope",
    "variable_handle",
    "weights_file_writer",
    "weights_reader",
    "weights_store_class",
    "write_keras_archive",
    "weight_regularization_losses",
    "write_lora_file",
    "write_model_summary",
]
