"""Internal: every use of Keras' and TensorFlow's private internals, in one place.

keras_pipe reaches into Keras where no public API says what it needs. Each
function below names what it uses, why, and the versions it was written
against (Keras 3.15, TensorFlow 2.21; the older releases noted were read
too). ``tests/test_compat.py`` calls :func:`check`, which fails loudly, naming
the missing attribute, when a Keras or TensorFlow upgrade removes one.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

# -- layers -------------------------------------------------------------------


def sublayers(layer) -> list:
    """``layer`` and every layer nested in it (``Layer._flatten_layers``, Keras 3.0-3.15).

    Why: the losses a layer adds during ``call`` (activity regularization)
    live on the sublayer that added them.
    """
    return list(layer._flatten_layers())


def trained_weights(layer) -> list:
    """The weights of ``layer`` a trainable Keras model trains: each one whose own ``trainable`` flag is set.

    The one place keras_pipe decides what trains (every stage, backward,
    update, tied weight and replica reads it). Keras decides per variable,
    at any depth: ``Model.trainable_weights`` is ``[v for v in self.weights
    if v.trainable]`` (``Layer.trainable_weights``, Keras 3.0-3.15), and a
    model's ``weights`` gather every sub-layer's whatever the sub-layer's
    flag. ``layer.trainable_weights`` is not that: it is empty when
    ``layer`` itself is frozen, even where a child was unfrozen after it
    (``block.trainable = False; block.a.trainable = True``) or where LoRA
    added trainable weights under a frozen parent (keras_hub's
    ``Backbone.enable_lora`` freezes every layer, then unfreezes the targets
    and adds their ``lora_kernel_a``/``lora_kernel_b``). Setting a layer's
    ``trainable`` sets its variables' flags (``Layer.trainable``'s setter),
    so the flags are the whole truth. The model's own ``trainable=False`` is
    applied by the caller (``StageCompute``'s ``frozen``), as Keras' model does.
    """
    return [v for v in layer.weights if v.trainable]


def own_losses(layer) -> list:
    """The losses ``layer`` itself added in its last call (``Layer._get_own_losses``, Keras 3.0-3.15).

    Why: a stage adds its layers' activity losses to its share of the loss;
    the public ``layer.losses`` also includes weight regularization, which is
    counted once per batch, not per micro-batch.
    """
    return list(layer._get_own_losses())


def weight_regularization_losses(layer) -> list:
    """The weight regularizers' losses of ``layer``'s weights that train, as the unsplit model counts them.

    Keras' model sums ``v.regularizer(v)`` over its ``trainable_weights``
    (``Layer._get_regularization_losses``, Keras 3.0-3.15): the weights of
    :func:`trained_weights`, not ``layer._get_regularization_losses()``, which
    a frozen parent empties of a trainable child's.
    """
    return [v.regularizer(v) for v in trained_weights(layer) if v.regularizer is not None]


def seed_generators(layer) -> list:
    """The ``SeedGenerator``s of ``layer`` and its sublayers (``Layer._seed_generators``, Keras 3.0-3.15).

    Why: replaying a layer with dropout during its backward must draw the
    same random numbers as its forward did, so the generators' states are
    saved before the forward and restored for the replay.
    """
    found = []
    for sub in sublayers(layer):
        for generator in sub._seed_generators:
            if all(generator is not g for g in found):
                found.append(generator)
    return found


# -- the trainer -----------------------------------------------------------------


def compiled_loss(model):
    """The ``CompileLoss`` built by ``compile()`` (``Trainer._compile_loss``, Keras 3.0-3.15).

    Why: the last stage computes the compiled loss of each micro-batch
    itself, without ``compute_loss``, whose signature carries the whole batch.
    """
    return model._compile_loss


def compiled_metrics(model):
    """The ``CompileMetrics`` built by ``compile()`` (``Trainer._compile_metrics``, Keras 3.0-3.15)."""
    return model._compile_metrics


def metric_containers() -> tuple:
    """Keras' containers of compiled metrics, ``(CompileMetrics, MetricsList)`` (``trainers.compile_utils``, 3.0-3.15).

    Why: a ``MonitorCallback`` with ``mode="auto"`` looks its metric's
    direction up among the members of these, in ``model.metrics``; a rank
    without the last stage answers it with the last stage's names and
    directions (``engine/logs.py``).
    """
    from keras.src.trainers.compile_utils import CompileMetrics, MetricsList

    return CompileMetrics, MetricsList


def loss_tracker(model):
    """The ``Mean`` behind the logged ``loss`` (``Trainer._loss_tracker``, Keras 3.0-3.15)."""
    return model._loss_tracker


def set_mean_state(mean, total: float, count: float) -> None:
    """Sets a ``keras.metrics.Mean``'s running sums (``Mean.total``/``Mean.count``, Keras 3.0-3.15).

    Why: the loss tracker's mean is kept in Python per step; its variables
    are written so that ``result()`` agrees.
    """
    mean.total.assign(total)
    mean.count.assign(count)


def compile_config_metrics(model):
    """The ``metrics`` argument given to ``compile()`` (``Trainer._compile_config``, Keras 3.0-3.15), or ``None``."""
    config = getattr(model, "_compile_config", None)
    return config.config.get("metrics") if config is not None else None


def set_initial_epoch(model, epoch: int) -> None:
    """Makes the next ``fit()`` start at ``epoch`` (``Trainer._initial_epoch``, read by ``fit``, Keras 3.0-3.15).

    Why: ``BackupAndRestore`` resumes a run this way; under the pipeline it
    is done by rank 0's decision on every rank.
    """
    model._initial_epoch = epoch


# -- callbacks ---------------------------------------------------------------------

BACKUP_ATTRIBUTES = (
    "_weights_path",
    "_training_metadata_path",
    "_prev_weights_path",
    "_prev_training_metadata_path",
    "_current_epoch",
    "_last_batch_seen",
    "_load_model",
    "_save_model",
)


def backup_paths(callback) -> dict:
    """``BackupAndRestore``'s files and position (private attributes, Keras 3.4-3.15).

    Why: the callback's load and save become collective under the pipeline
    (rank 0 reads and writes, every rank loads); Keras has no hook for that.
    """
    return {name.lstrip("_"): getattr(callback, name) for name in BACKUP_ATTRIBUTES[:6]}


def replace_backup_io(callback, load, save) -> None:
    """Replaces ``BackupAndRestore._load_model`` and ``_save_model`` (Keras 3.4-3.15)."""
    callback._load_model = load
    callback._save_model = save


def file_utils():
    """Keras' file helpers, which also handle remote paths (``keras.src.utils.file_utils``, Keras 3.0-3.15)."""
    from keras.src.utils import file_utils as module

    return module


# -- TensorFlow ----------------------------------------------------------------------


def global_seed():
    """TensorFlow's global seed, or ``None`` (``tensorflow.python.eager.context.global_seed``, TF 2.x).

    Why: replicas must shuffle alike; ``fit`` seeds TensorFlow only when the
    script did not.
    """
    from tensorflow.python.eager import context

    return context.global_seed()


def variable_handle(variable):
    """The ``tf.Variable`` behind a Keras variable (``KerasVariable.value`` is it on the TF backend)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def call_concrete(concrete, flat_inputs: list):
    """Calls a traced ``tf.function`` graph with its flat tensor inputs (``ConcreteFunction._call_flat``, TF 2.x).

    Why: a ``tf.function`` call first matches its arguments against its
    traces, which costs 100-200 us a call; keras_pipe keeps the traces
    itself, by shape, and calls them directly (62 us for a small program).
    """
    return concrete._call_flat(flat_inputs, concrete.captured_inputs)


# -- graphs ----------------------------------------------------------------------------


def execution_order(functional) -> list:
    """A Functional model's nodes in the order ``Functional._run_through_graph`` runs them (Keras 3.0-3.15).

    ``_nodes_by_depth``, deepest first, input nodes left out. Why: the
    pipeline cuts this order into stages and runs each stage's part of it.
    """
    order = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                order.append(node)
    return order


def call_operation(operation, args, kwargs, training):
    """Calls a graph node's operation as ``Functional.call`` does (``functional.operation_fn``, Keras 3.9-3.15).

    ``training`` goes to the operations whose call takes it (their
    ``_call_context_args``); everything else as the node recorded it.
    """
    from keras.src.models.functional import operation_fn

    return operation_fn(operation, training=training)(*args, **kwargs)


def is_functional(model) -> bool:
    """Whether ``model`` is a Functional model, a subclass (keras_hub's task models) included
    (``keras.src.models.functional.Functional``, Keras 3.0-3.15; the class is not exported)."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def sequential_functional(model):
    """The Functional graph a built ``Sequential`` runs (``Sequential._functional``, Keras 3.0-3.15), or ``None``."""
    return getattr(model, "_functional", None)


def standardize_inputs(functional, x) -> list:
    """A batch's model inputs, flat, as ``Functional.call`` converts them (``_standardize_inputs``, Keras 3.0-3.15).

    Why: a dict, a list or one array, converted to each input's dtype, with
    Keras' rank adjustments, exactly as the unsplit model takes them.
    """
    return list(functional._standardize_inputs(x))


def input_shape_argument(layer):
    """A layer's legacy ``input_shape=``/``input_dim=`` (``Layer._input_shape_arg``, Keras 3.0-3.15)."""
    return getattr(layer, "_input_shape_arg", None) if isinstance(layer, keras.layers.Layer) else None


def executing_eagerly() -> bool:
    """Whether code runs op by op, not inside a ``tf.function`` being traced."""
    return tf.executing_eagerly()


def flat_inputs(functional, inputs) -> list:
    """``inputs`` flat, in the order of ``functional.inputs``, as ``Functional._standardize_inputs`` orders them.

    Why: a dict given to a model whose inputs are a list (keras_hub's
    Gemma3n task calls its backbone, built on ``[token_ids,
    padding_mask]``, with a dict) is read by the inputs' names, not in the
    dict's sorted order (Keras 3.15).
    """
    struct = functional._inputs_struct
    if isinstance(inputs, dict) and not isinstance(struct, dict):
        names = [t.name for t in keras.tree.flatten(struct)]
        if set(names) <= set(inputs):
            return [inputs[name] for name in names]
    return keras.tree.flatten(inputs)


def check_input_structure(functional, x, name: str | None = None) -> None:
    """Raises as a Functional model's call does for inputs of another structure (Keras 3.15).

    A dict without one of the inputs' names, more or fewer arrays than
    inputs, something that is not an array, ``None`` for an input that is
    not ``optional=True`` (``Functional._assert_input_compatibility`` and
    ``keras.src.layers.input_spec.assert_input_compatibility``), and the
    structure's own error (``Functional._standardize_inputs``,
    ``_maybe_warn_inputs_struct_mismatch``): on every rank, where only the
    first stage standardizes the inputs (see :func:`check_input_shapes`;
    the structure's warning is the first stage's alone).
    """
    from keras.src.layers.input_spec import assert_input_compatibility

    name = name or functional.name
    if isinstance(x, (dict, list, tuple)) or hasattr(x, "shape"):
        for given, tensor in zip(flat_inputs(functional, x), functional.inputs):
            layer = tensor._keras_history.operation
            if given is None and not getattr(layer, "optional", False):
                raise ValueError(
                    f"The input '{tensor.name}' is not optional, but None was passed. Please provide a valid tensor."
                )
    _check_structure_as_keras_does(functional, x)
    assert_input_compatibility(functional.input_spec, x, name)


def _check_structure_as_keras_does(functional, inputs) -> None:
    """The part of ``Functional._standardize_inputs`` before conversion: its structure error, on every rank."""
    struct, raise_exception = functional._inputs_struct, False
    array = hasattr(inputs, "shape") and not isinstance(inputs, (dict, list, tuple))  # (NumPy too: Keras sees tensors)
    if isinstance(struct, list) and len(struct) == 1 and array:
        inputs = [inputs]
    elif isinstance(inputs, dict) and not isinstance(struct, dict):
        if hasattr(struct, "__len__") and all(isinstance(i, keras.KerasTensor) for i in struct):
            if {i.name for i in struct} <= set(inputs):
                inputs = [inputs[i.name] for i in struct]
            else:
                raise_exception = True
        elif isinstance(struct, keras.KerasTensor):
            if struct.name in inputs:
                inputs = [inputs[struct.name]]
            else:
                raise_exception = True
        else:
            raise_exception = True
    if isinstance(struct, dict) and not isinstance(inputs, dict) and list(struct) != sorted(struct):
        raise_exception = True
    if raise_exception:  # (the warning alone is left to the first stage's standardization: Keras' count of them)
        functional._maybe_warn_inputs_struct_mismatch(inputs, raise_exception=True)


def check_input_shapes(functional, x) -> list:
    """Raises, in Keras' words (``InputSpec``'s check, ``Functional._adjust_input_rank``), for inputs that do not fit.

    Keras 3.15: the inputs' structure as :func:`check_input_structure` checks
    it; the same shapes as the model's input spec (the fixed sizes equal), or
    one more or one less trailing axis of size 1. Returns the inputs, flat.

    Why: only the first stage converts a batch (``standardize_inputs``), so
    only it would find out; every rank checks the shapes alone (no
    conversion), so that every rank raises the same error.
    """
    check_input_structure(functional, x)
    flat = flat_inputs(functional, x)
    struct = functional._inputs_struct
    for index, (given, ref) in enumerate(zip(flat, functional.inputs)):
        if given is None or not hasattr(given, "shape"):
            continue
        shape, ref_shape = tuple(given.shape), tuple(ref.shape)
        if len(shape) == len(ref_shape):
            fixed = [(a, b) for a, b in zip(shape[1:], ref_shape[1:]) if a is not None and b is not None]
            if all(a == b for a, b in fixed):
                continue
            # (Keras' words, as its InputSpec check says them)
            raise ValueError(
                f"Input {index} with name '{ref.name}' of layer '{functional.name}' is incompatible with the layer: "
                f"expected shape={ref_shape}, found shape={shape}"
            )
        if len(shape) == len(ref_shape) + 1 and shape[-1] == 1:
            continue
        if len(shape) == len(ref_shape) - 1 and ref_shape[-1] == 1:
            continue
        path = ".".join(str(p) for p in keras.tree.flatten_with_path(struct)[index][0])
        raise ValueError(  # (as _adjust_input_rank says it, less the whole array)
            f"Invalid input shape for input with name '{ref.name}' and path '{path}'. Expected shape {ref_shape}, "
            f"but input has incompatible shape {shape}"
        )
    return flat


def unallocated(variable) -> bool:
    """Whether a Keras variable has a shape but no value (created in an unallocated scope, or released)."""
    return getattr(variable, "_value", None) is None


def release_variable(variable) -> None:
    """Frees a Keras variable's value, keeping its shape and dtype (``KerasVariable._value``, Keras 3.0-3.15).

    Why: a model handed in built has every stage's weights on every rank;
    each rank frees those of the stages it does not run (and never allocates
    those of a model built here). Reading it on this rank is an error that
    says so.
    """
    path = variable.path
    if getattr(variable, "_keras_pipe_initializer", False) is not False:
        return  # released before

    def elsewhere(shape, dtype=None):
        raise RuntimeError(
            f"{path} belongs to another stage of the pipeline; this rank does not hold it (model.get_weights() "
            "gathers every stage's weights). A model handed to PipelineModel.from_model or from_sequential gives "
            "the pipeline its layers, and each rank keeps its own stage's weights: use the pipeline from then on "
            "(pipeline.to_keras() is the whole model again, on rank 0)."
        )

    # An unallocated variable would give its initializer's values when read: it raises instead, and
    # keeps the initializer in case this rank comes to hold it (a one-rank model rebuilt).
    variable._keras_pipe_initializer = variable._initializer if unallocated(variable) else None
    variable._value = None
    variable._initializer = elsewhere


def restore_initializer(variable) -> None:
    """Undoes :func:`release_variable` of a variable never allocated here, so that it can be allocated."""
    initializer = getattr(variable, "_keras_pipe_initializer", False)
    if initializer is not False:
        variable._initializer = initializer
        del variable._keras_pipe_initializer


@contextlib.contextmanager
def lent_values(variables):
    """The unallocated ones of ``variables`` hold a value (zeros, until assigned) inside; none again after.

    Why: saving a model whose layers Keras cannot rebuild from their configs
    (a custom layer not registered, or whose ``get_config`` misses an
    argument) writes rank 0's own layer objects, as ``keras.Sequential``
    would: for that moment they hold every stage's weights. Afterwards each
    is as :func:`release_variable` left it (``KerasVariable._value`` and
    ``_initializer``, Keras 3.0-3.15).
    """
    import numpy as np

    lent = []
    try:
        with allocating_scope(), tf.init_scope():
            for variable in variables:
                if unallocated(variable) and all(variable is not other for other, _, _ in lent):
                    kept = variable.__dict__.get("_keras_pipe_initializer", lent)
                    lent.append((variable, variable._initializer, kept))
                    variable._initialize(np.zeros(tuple(variable.shape), np.dtype(variable.dtype)))
        yield
    finally:
        for variable, initializer, kept in lent:
            variable._value = None
            variable._initializer = initializer
            if kept is lent:
                variable.__dict__.pop("_keras_pipe_initializer", None)
            else:
                variable._keras_pipe_initializer = kept


def write_model_summary(board) -> None:
    """``TensorBoard._write_keras_model_summary`` for a ``PipelineModel`` (``keras_model_summary``, Keras 3.0-3.15).

    Why: Keras writes the ``keras`` tag (the model's JSON) for a model whose
    class is named ``Functional`` or ``Sequential`` only; the pipeline stands
    for one, and its event files carry the same tags.
    """
    from keras.src.callbacks.tensorboard import keras_model_summary

    with board._train_writer.as_default():
        keras_model_summary("keras", board.model, step=0)


# -- losses ------------------------------------------------------------------------------


def loss_terms(compile_loss) -> list:
    """A built ``CompileLoss``'s terms ``(path, loss, weight, name)`` (``CompileLoss._flat_losses``, Keras 3.0-3.15)."""
    return list(compile_loss._flat_losses or [])


def apply_mask(sample_weight, mask, dtype, reduction):
    """``keras.src.losses.loss.apply_mask`` (Keras 3.0-3.15): a mask merged into the sample weights."""
    from keras.src.losses.loss import apply_mask as keras_apply_mask

    return keras_apply_mask(sample_weight, mask, dtype=dtype, reduction=reduction)


def squeeze_or_expand_to_same_rank(x1, x2):
    """``keras.src.losses.loss.squeeze_or_expand_to_same_rank`` (Keras 3.0-3.15)."""
    from keras.src.losses.loss import squeeze_or_expand_to_same_rank as keras_squeeze

    return keras_squeeze(x1, x2)


def scale_loss_for_distribution(value):
    """``keras.src.losses.loss.scale_loss_for_distribution`` (Keras 3.0-3.15)."""
    from keras.src.losses.loss import scale_loss_for_distribution as keras_scale

    return keras_scale(value)


# -- checking ------------------------------------------------------------------------


def get_mask(tensor):
    """The Keras mask a tensor carries, or ``None`` (``keras.src.backend.get_keras_mask``, Keras 3.0-3.15).

    Why: a mask (``Embedding(mask_zero=True)``, ``Masking``) rides on the
    tensor as an attribute; at a stage boundary it must travel beside it.
    """
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def set_mask(tensor, mask) -> None:
    """Attaches a Keras mask to a tensor (``keras.src.backend.set_keras_mask``, Keras 3.0-3.15)."""
    from keras.src.backend import set_keras_mask

    set_keras_mask(tensor, mask)


@contextlib.contextmanager
def unallocated_scope():
    """A ``keras.StatelessScope`` whose new variables are never allocated (Keras' ``global_state``
    ``"uninitialized_variables"`` list, Keras 3.0-3.15).

    Why: every rank builds every layer of the model, shapes only. A plain
    ``StatelessScope`` allocates the variables created inside it on exit, and
    ``initialize_variables=False`` leaves them on a list the next scope
    allocates: either way the whole model's weights on every rank, which a
    pipeline exists to avoid. This scope takes them off the list again. A
    variable created from a value rather than an initializer, which a
    ``StatelessScope`` refuses, is allocated (``Variable.__init__`` wrapped
    for the scope's duration).
    """
    from keras.src.backend.common import global_state
    from keras.src.backend.common.variables import Variable

    before = list(global_state.get_global_attribute("uninitialized_variables") or [])
    original = Variable.__init__

    def create(variable, initializer, *args, **kwargs):
        # A variable created from a value, not an initializer (an optimizer's iteration count,
        # which keras_hub's task models create as they compile themselves), cannot wait: a
        # StatelessScope refuses it. It is small: it is allocated as it is.
        if callable(initializer) or isinstance(initializer, str):
            return original(variable, initializer, *args, **kwargs)
        with allocating_scope():
            return original(variable, initializer, *args, **kwargs)

    Variable.__init__ = create
    try:
        with keras.StatelessScope(initialize_variables=False), _deferring_weight_loads():
            yield
    finally:
        Variable.__init__ = original
        global_state.set_global_attribute("uninitialized_variables", before)


DEFERRED_LOADS = "_keras_pipe_deferred_loads"


@contextlib.contextmanager
def _deferring_weight_loads():
    """Weights files loaded into a model without memory are recorded on it, not read (``saving_lib.load_weights_only``,
    which ``Model.load_weights`` and ``keras.saving.load_weights`` call for ``.weights.h5``, ``.weights.json`` and
    ``.keras`` files, Keras 3.0-3.15).

    Why: keras_hub's ``from_preset`` builds the model, then loads the
    preset's weights file into it; inside a ``StatelessScope`` each assign
    would go to the scope and be dropped, and the pipeline would train the
    initializers' values. Recorded (``DEFERRED_LOADS``: ``(filepath,
    skip_mismatch, objects_to_skip)``), each load is run once the pipeline
    has given each rank its own stage's memory, reading only what that rank
    holds (:func:`held_only_loading`).
    """
    from keras.src.saving import saving_lib

    original = saving_lib.load_weights_only

    def defer(model, filepath, skip_mismatch=False, objects_to_skip=None):
        if not any(unallocated(v) for v in model.weights):
            return original(model, filepath, skip_mismatch=skip_mismatch, objects_to_skip=objects_to_skip)
        loads = model.__dict__.get(DEFERRED_LOADS, [])
        object.__setattr__(model, DEFERRED_LOADS, [*loads, (str(filepath), skip_mismatch, objects_to_skip)])
        return None

    saving_lib.load_weights_only = defer
    try:
        yield
    finally:
        saving_lib.load_weights_only = original


class _Stored:
    """A value of a weights file, read only when a variable this rank holds takes it (``numpy.asarray`` reads it)."""

    def __init__(self, read):
        self.read = read

    def __array__(self, dtype=None, copy=None):
        value = np.asarray(self.read())
        return value if dtype is None else value.astype(dtype)

    def __getitem__(self, key):  # (``store["rank"][()]``, as keras_hub reads a scalar)
        return np.asarray(self.read())[key]


@contextlib.contextmanager
def held_only_loading():
    """While Keras loads a weights file: only the variables this rank holds are read and assigned
    (``saving_lib.H5IOStore.__getitem__``, its sharded subclass's, and ``KerasVariable.assign``, Keras 3.12-3.15).

    Why: every rank walks the whole model as Keras does (the file's layout
    is the model's), but a variable of another stage has no memory here and
    its bytes are left in the file, so that a rank never holds more than its
    own stage and the one value being read.
    """
    from keras.src.backend.common.variables import Variable
    from keras.src.saving import saving_lib

    stores = [saving_lib.H5IOStore, saving_lib.ShardedH5IOStore]
    reads = {store: store.__dict__["__getitem__"] for store in stores if "__getitem__" in store.__dict__}
    assign = Variable.assign

    def lazy_of(read):
        def lazy(store, key):
            group = store._h5_entry_group  # (the store is one object moved from entry to entry)

            def read_now():
                current = store._h5_entry_group
                store._h5_entry_group = group
                try:
                    return read(store, key)
                finally:
                    store._h5_entry_group = current

            return _Stored(read_now)

        return lazy

    def held_assign(variable, value):
        if unallocated(variable):
            return variable  # (another stage's: its value stays in the file)
        if isinstance(value, _Stored):
            value = value.read()
        return assign(variable, value)

    for store, read in reads.items():
        store.__getitem__ = lazy_of(read)
    Variable.assign = held_assign
    try:
        yield
    finally:
        for store, read in reads.items():
            store.__getitem__ = read
        Variable.assign = assign


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


def load_weights_only(model, filepath: str, skip_mismatch: bool, objects_to_skip) -> None:
    """``keras.saving.load_weights`` of a ``.weights.h5``/``.weights.json``/``.keras`` file (``saving_lib``, Keras
    3.0-3.15), without the deferral of :func:`unallocated_scope`."""
    from keras.src.saving import saving_lib

    saving_lib.load_weights_only(model, filepath, skip_mismatch=skip_mismatch, objects_to_skip=objects_to_skip)


@contextlib.contextmanager
def allocating_scope():
    """Leaves :func:`unallocated_scope` for a moment (Keras' ``StatelessScope`` stack, Keras 3.0-3.15).

    Why: a layer whose output shape Keras cannot infer symbolically is
    called once on a real tensor, which no stateless scope may see.
    """
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


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
    missing = [f"{type(obj).__name__}.{name}" for obj, name in needed if not hasattr(obj, name)]
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
            "Update keras_pipe/compat.py for this version."
        )


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
