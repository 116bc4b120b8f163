"""Internal: Keras' trainer (``Trainer``, ``trainers.compile_utils``), its losses, and its callbacks' internals.

The compiled loss and metrics and the loss tracker, which the last stage
runs per micro-batch; ``BackupAndRestore``'s files and ``TensorBoard``'s
model summary, which become collective under the pipeline; the loss helpers
a micro-batch's loss is computed with; ``DataAdapter``, the base of what a
stage that does not read the data gives Keras' loop in its place (Keras'
``get_data_adapter`` takes an adapter as it is: Keras 3.0-3.15).
"""

from __future__ import annotations

import contextlib

from keras.src.trainers.data_adapters.data_adapter import DataAdapter  # noqa: F401 (re-exported)


def data_adapter(x, class_weight=None, shuffle=False):
    """Keras' own adapter of ``x`` (a ``tf.data.Dataset``, ``PyDataset`` or generator), as ``fit`` makes it
    (``trainers.data_adapters.get_data_adapter``, Keras 3.0-3.15).

    Why: a replica's first stage reads the batches its own dataset function
    made (``distribute_datasets_from_function``) through Keras' adapter of
    them, inside an adapter that reports the batches every replica agreed on.
    """
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(x, class_weight=class_weight, shuffle=shuffle)


def compiled_loss(model):
    """The ``CompileLoss`` built by ``compile()`` (``Trainer._compile_loss``, Keras 3.0-3.15).

    Why: the last stage computes the compiled loss of each micro-batch
    itself, without ``compute_loss``, whose signature carries the whole batch.
    """
    return model._compile_loss


def is_default_hook(method) -> bool:
    """Whether a callback's hook is ``keras.callbacks.Callback``'s own, doing nothing (``utils.is_default``,
    Keras 3.0-3.15).

    Why: only code of the user's between two batches can decide a stop on one rank alone; Keras' default hooks
    are marked, as its ``CallbackList`` reads them to decide on asynchronous dispatch.
    """
    return method is None or getattr(method, "_is_default", False)


def compiled_metrics(model):
    """The ``CompileMetrics`` built by ``compile()`` (``Trainer._compile_metrics``, Keras 3.0-3.15)."""
    return model._compile_metrics


def metric_containers() -> tuple:
    """Keras' containers of compiled metrics, ``(CompileMetrics, MetricsList)`` (``trainers.compile_utils``, 3.0-3.15).

    Why: a ``MonitorCallback`` with ``mode="auto"`` looks its metric's
    direction up among the members of these, in ``model.metrics``; a rank
    without the last stage answers it with the last stage's names and
    directions (``model/logs.py``).
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


def set_backup_weights_paths(callback, weights_path: str, prev_weights_path: str) -> None:
    """Sets ``BackupAndRestore``'s weights file and its previous one (``_weights_path``, ``_prev_weights_path``,
    Keras 3.4-3.15).

    Why: a pipeline's backup is a sharded checkpoint (``latest.weights.json``),
    and code reading the callback's paths (Keras' own tests do) must find it.
    """
    callback._weights_path = weights_path
    callback._prev_weights_path = prev_weights_path


def replace_backup_io(callback, load, save) -> None:
    """Replaces ``BackupAndRestore._load_model`` and ``_save_model`` (Keras 3.4-3.15)."""
    callback._load_model = load
    callback._save_model = save


def file_utils():
    """Keras' file helpers, which also handle remote paths (``keras.src.utils.file_utils``, Keras 3.0-3.15)."""
    from keras.src.utils import file_utils as module

    return module


@contextlib.contextmanager
def makedirs_tolerating_existing():
    """While it is open, Keras' ``file_utils.makedirs`` takes a directory that exists by the time it runs as made.

    Why: ``ModelCheckpoint._save_model`` (Keras 3.0-3.15) checks
    ``file_utils.exists(dirname)``, then calls ``file_utils.makedirs(dirname)``
    (``os.makedirs``, no ``exist_ok``); every rank runs it, and on a shared
    filesystem another rank can make the directory between the two, which
    raised ``FileExistsError`` on one rank alone.
    """
    module = file_utils()
    make = module.makedirs

    def makedirs(path):
        try:
            return make(path)
        except FileExistsError:
            if not module.isdir(path):
                raise

    module.makedirs = makedirs
    try:
        yield
    finally:
        module.makedirs = make


def flatten_metrics_in_order(model, logs):
    """``keras.Model._flatten_metrics_in_order`` (Keras 3.0-3.15): the logs' values in Keras' order of its metrics.

    Why: every rank lists the logs in the order the last stage's compiled metrics give, which Keras decides here.
    """
    import keras

    return keras.Model._flatten_metrics_in_order(model, logs)


def metric_direction(metric):
    """A metric's ``_direction`` (``"up"``, ``"down"`` or ``None``; Keras 3.0-3.15), which ``MonitorCallback``'s
    ``mode="auto"`` reads: told by the last stage to the ranks without its metrics."""
    return getattr(metric, "_direction", None)


def replace_tensorboard_hooks(board, log_weights=None, summary=None) -> None:
    """Replaces ``TensorBoard._log_weights`` and ``_write_keras_model_summary`` (Keras 3.0-3.15) where given.

    Why: the weights' histograms gather every stage's weights; the model summary is the pipeline's.
    """
    if log_weights is not None:
        board._log_weights = log_weights
    if summary is not None:
        board._write_keras_model_summary = summary


def tensorboard_train_writer(board):
    """``TensorBoard._train_writer`` (Keras 3.0-3.15), the summary writer of the training logs."""
    return board._train_writer


def log_weight_as_image(board, value, name: str, epoch: int) -> None:
    """``TensorBoard._log_weight_as_image`` (Keras 3.0-3.15)."""
    board._log_weight_as_image(value, name, epoch)


def wrap_checkpoint_save(callback, wrap) -> bool:
    """``ModelCheckpoint._save_model`` replaced by ``wrap(original)`` once (Keras 3.0-3.15); whether it was now."""
    if getattr(callback, "_keras_pipe_wrapped_save", False):
        return False
    callback._save_model = wrap(callback._save_model)
    callback._keras_pipe_wrapped_save = True
    return True


def write_model_summary(board) -> None:
    """``TensorBoard._write_keras_model_summary`` for a ``PipelineModel`` (``keras_model_summary``, Keras 3.0-3.15).

    Why: Keras writes the ``keras`` tag (the model's JSON) for a model whose
    class is named ``Functional`` or ``Sequential`` only; the pipeline stands
    for one, and its event files carry the same tags.
    """
    from keras.src.callbacks.tensorboard import keras_model_summary

    with tensorboard_train_writer(board).as_default():
        keras_model_summary("keras", board.model, step=0)


def distribute_strategy(model):
    """``_distribute_strategy`` (Keras 3.0-3.15, the TensorFlow trainer): the ``tf.distribute`` strategy the model
    was made under, or ``None``."""
    return getattr(model, "_distribute_strategy", None)


def loss_function_kwargs(loss) -> dict:
    """``_fn_kwargs`` (Keras 3.0-3.15): the keyword arguments a ``LossFunctionWrapper`` passes its function."""
    return getattr(loss, "_fn_kwargs", None) or {}


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
