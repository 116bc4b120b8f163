"""Keras callbacks under the pipeline: one writer for files, collective checkpoints.

Every rank sees the same logs, so every callback decides the same thing on
every rank (EarlyStopping stops everywhere at the same epoch,
ReduceLROnPlateau sets the same learning rate). What must differ:

- callbacks whose only effect is outside the job (``CSVLogger``,
  ``TensorBoard``, ``RemoteMonitor``, and a user's callback passed through
  :func:`writer_only`) run on rank 0 alone: one file, one post, as from one
  process;
- ``TensorBoard``'s weight histograms and embeddings need every stage's
  weights: every rank takes part in gathering them (``get_weights``) and in
  the embeddings' ``save_weights``, at the TensorBoard's place in the list;
  rank 0 writes;
- a monitoring callback (``EarlyStopping``, ``ModelCheckpoint``,
  ``ReduceLROnPlateau``, any ``MonitorCallback``) with ``mode="auto"`` asks
  ``model.metrics`` whether its metric goes up or down: every rank answers
  as the last stage, which holds the compiled metrics (``model/logs.py``),
  so every rank decides alike, or raises Keras' error alike;
- ``ModelCheckpoint`` runs everywhere, as ``model.save``/``save_weights`` are
  collective and rank 0 writes; the directory it creates first (Keras:
  "if it does not exist, make it") is created by whichever rank gets there
  first, and another rank finding it made in between goes on;
- ``BackupAndRestore`` decides on rank 0 whether a backup exists and tells the
  other ranks, so that they need not share its filesystem, and only rank 0
  writes the backup and its metadata.
- a stop one rank alone asks for (``model.stop_training`` set by a callback
  that reads its own clock, or by a signal handler) is every rank's stop
  after the same batch: the last callback of every rank's list sums the
  ranks' flags after each epoch, and after each batch where code of the
  user's runs between batches (:class:`_StopAgreed`).

See ``docs/callbacks.md``.
"""

from __future__ import annotations

import json
import os
import warnings

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.errors import PipelineIOError
from keras_pipe.model.transfer import on_root
from keras_pipe.model.weights import ordered
from keras_pipe.mpi.comm import Communicator
from keras_pipe.mpi.files import copy, write_text
from keras_pipe.optional import check_callbacks

_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard, keras.callbacks.RemoteMonitor)
WRITER = 0  # the rank that runs the callbacks with an effect outside the job
_WRITER_ONLY = "_keras_pipe_writer_only"


def is_writer() -> bool:
    """Whether this process is the one of the job that writes files and posts: ``MPI.COMM_WORLD`` rank 0.

    For a callback of one's own with an effect outside the job (a file, a
    remote logger, an experiment tracker), as Horovod's ``hvd.rank() == 0``::

        callbacks = [keras.callbacks.EarlyStopping(...)]
        if is_writer():
            callbacks.append(MyTracker())

    or pass it through :func:`writer_only`. Plain ``python`` (one process): True.
    """
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() == WRITER


def writer_only(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Marks ``callback`` to run on rank 0 alone (as ``CSVLogger`` and ``TensorBoard`` do); returns it.

    For a callback whose effect is outside the job (it writes, posts,
    prints) and that calls nothing collective (``model.save``,
    ``get_weights`` and ``evaluate`` are collective: a callback calling them
    must run on every rank). The other ranks leave it out of ``fit``.
    """
    setattr(callback, _WRITER_ONLY, True)
    return callback


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras' ``ModelCheckpoint``, which also takes a ``.weights.json`` path: a sharded checkpoint a stage a rank.

    With ``save_weights_only=True`` and a path ending in ``.weights.json``,
    each checkpoint is Keras' sharded weights layout, written by every stage
    in parallel (``model.save_weights``, :mod:`keras_pipe.model.sharded`): no
    rank holds more than its stage, and plain Keras' ``load_weights`` reads
    it. Keras' own class refuses such a path (it knows ``.weights.h5`` and
    ``.keras`` only); any other path behaves exactly as Keras' (rank 0 writes
    the whole model). Every argument is Keras'.

    Example:

    ```python
    checkpoint = keras_pipe.ModelCheckpoint("ck/epoch{epoch:02d}.weights.json", save_weights_only=True)
    model.fit(x, y, epochs=10, callbacks=[checkpoint])
    ```
    """

    def __init__(
        self,
        filepath,
        monitor="val_loss",
        verbose=0,
        save_best_only=False,
        save_weights_only=False,
        mode="auto",
        save_freq="epoch",
        initial_value_threshold=None,
    ):
        path = os.fspath(filepath)
        sharded = path.endswith(".weights.json")
        if sharded and not save_weights_only:
            raise ValueError(
                "A `.weights.json` path is a sharded weights checkpoint: pass save_weights_only=True (a whole model "
                f"is saved to a `.keras` path). Received: filepath={path}"
            )
        # (Keras' checks of everything else, on a .weights.h5 stand-in for the path it does not know)
        stand_in = path[: -len(".json")] + ".h5" if sharded else path
        super().__init__(
            stand_in, monitor, verbose, save_best_only, save_weights_only, mode, save_freq, initial_value_threshold
        )
        self.filepath = path


def adapt_callbacks(callbacks, comm: Communicator):
    """The callbacks this rank runs (see the module docstring)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    if callbacks is None:
        return [_StopAgreed.made(comm, _signal_handled())] if comm.size > 1 else None
    check_callbacks(callbacks)  # (on every rank: a writer's missing package is everyone's error, before training)
    kept = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.TensorBoard) and (callback.histogram_freq or callback.embeddings_freq):
            # every rank gathers the weights (and joins the embeddings' save_weights) where the TensorBoard is
            helper = _TensorBoardWeights(callback, comm)
            kept.append(helper)
            if comm.rank == WRITER:
                compat.replace_tensorboard_hooks(callback, log_weights=helper.log_weights)
        if isinstance(callback, keras.callbacks.TensorBoard) and comm.rank == WRITER:
            compat.replace_tensorboard_hooks(callback, summary=lambda board=callback: compat.write_model_summary(board))
        if (isinstance(callback, _WRITERS) or getattr(callback, _WRITER_ONLY, False)) and comm.rank != WRITER:
            continue
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            _make_collective(callback, comm)
        if isinstance(callback, keras.callbacks.ModelCheckpoint):
            _tolerate_racing_directories(callback)
        kept.append(callback)
    if any(isinstance(c, _WRITERS) or getattr(c, _WRITER_ONLY, False) for c in callbacks):
        kept.append(_WritersDone(comm))
    if comm.size > 1:
        kept.append(_StopAgreed.made(comm, _signal_handled() or any(map(_may_stop_alone, callbacks))))
    return kept


# Keras' callbacks that set no stop, or set it from the logs (the same on every rank): EarlyStopping, TerminateOnNaN.
_DECIDING_FROM_LOGS = tuple(
    getattr(keras.callbacks, name)
    for name in (
        "BackupAndRestore",
        "CSVLogger",
        "EarlyStopping",
        "History",
        "LearningRateScheduler",
        "ModelCheckpoint",
        "ProgbarLogger",
        "ReduceLROnPlateau",
        "RemoteMonitor",
        "SwapEMAWeights",
        "TensorBoard",
        "TerminateOnNaN",
    )
    if hasattr(keras.callbacks, name)
)
_BATCH_HOOKS = (
    "on_epoch_begin",
    "on_batch_begin",
    "on_batch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


def _may_stop_alone(callback) -> bool:
    """Whether ``callback`` runs code of its own between two batches (anything but Keras' own, unchanged)."""
    if type(callback) in _DECIDING_FROM_LOGS or type(callback).__module__.startswith("keras_pipe."):
        return False
    return any(not compat.is_default_hook(getattr(callback, hook, None)) for hook in _BATCH_HOOKS)


def _signal_handled() -> bool:
    """Whether the script handles a signal in Python (a handler that may set ``model.stop_training``)."""
    import signal

    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU")
    handlers = [signal.getsignal(getattr(signal, name)) for name in names if hasattr(signal, name)]
    return any(callable(h) and h is not signal.default_int_handler for h in handlers)


class _StopAgreed(keras.callbacks.Callback):
    """Last in the list, on every rank: a stop one rank asks for stops every rank, at the same batch.

    Keras' loops end after a batch where ``model.stop_training`` (``fit``),
    ``stop_evaluating`` or ``stop_predicting`` is set. A callback deciding
    from the logs decides alike everywhere, but one deciding from what its own
    rank sees (its clock, a file, a signal handler on a preempted node) would
    stop one rank while the others wait for it in the next step. So after
    each epoch, and after each batch where code other than Keras' own
    callbacks runs between batches (``every_batch``: a callback of the
    user's with a batch hook, or a signal handler), the ranks sum their
    flags, one number each, and where any rank stops, every rank does. (A
    sum a batch: up to 1.3 ms of an 11 ms step on three ranks of a 2-core
    host, ``benchmarks/stop_agreement.py``.)
    """

    def __init__(self, comm: Communicator, every_batch: bool = True):
        super().__init__()
        self.comm = comm
        self.every_batch = every_batch
        self.pending = {}  # flags set while the ranks were summing theirs

    @classmethod
    def made(cls, comm: Communicator, every_batch_here: bool) -> _StopAgreed:
        """One for this call of ``fit``/``evaluate``/``predict`` (collective): a sum every batch if any rank needs
        it (a callback one rank alone runs, a signal handler one rank alone installed), so that all sum alike."""
        wanted = comm.allreduce_sum(np.array([float(every_batch_here)]), "every rank's callbacks")[0] > 0
        return cls(comm, every_batch=bool(wanted))

    def _agree(self, flag: str) -> None:
        asked = bool(getattr(self.model, flag, False)) or self.pending.pop(flag, False)
        anyone = self.comm.allreduce_sum(np.array([float(asked)]), "every rank to say whether it stops")[0] > 0
        if not anyone and getattr(self.model, flag, False):
            # set during the sum (a signal handler runs between any two instructions): the next sum has it
            self.pending[flag] = True
        setattr(self.model, flag, anyone)

    def on_train_batch_end(self, batch, logs=None):
        if self.every_batch:
            self._agree("stop_training")

    def on_epoch_end(self, epoch, logs=None):
        self._agree("stop_training")

    def on_test_batch_end(self, batch, logs=None):
        if self.every_batch:
            self._agree("stop_evaluating")

    def on_predict_batch_end(self, batch, logs=None):
        if self.every_batch:
            self._agree("stop_predicting")


class _WritersDone(keras.callbacks.Callback):
    """Last in the list, on every rank: ``fit()`` returns once rank 0's writers have closed their files.

    So that a rank reading a ``CSVLogger``'s file or a ``TensorBoard``'s
    events after ``fit()`` (on a shared filesystem) finds them complete.
    """

    def __init__(self, comm: Communicator):
        super().__init__()
        self.comm = comm

    def on_train_end(self, logs=None):
        self.comm.barrier()


class _TensorBoardWeights(keras.callbacks.Callback):
    """Every rank's part of a ``TensorBoard``'s histograms and embeddings, just before it (rank 0) or in its place.

    The histograms are of every stage's weights, gathered (``get_weights``,
    collective) on the epochs the TensorBoard logs them; rank 0's
    TensorBoard writes them under each weight's path, as Keras does. Its
    embeddings call ``model.save_weights``, collective: the other ranks call
    it here, at the same place in the list.
    """

    def __init__(self, board: keras.callbacks.TensorBoard, comm: Communicator):
        super().__init__()
        self.board = board
        self.comm = comm
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        board = self.board
        if board.histogram_freq and epoch % board.histogram_freq == 0:
            model = self.model
            values = model.get_weights()
            # (keras.Sequential builds its layers under its own name: the chain's paths are named as its are)
            prefix = f"{model.name}/" if model._builder.layers else ""
            self.weights = [
                (v.path if v.path.startswith(prefix) else prefix + v.path, value)
                for (v, _, _), value in zip(ordered(model.engine), values)
            ]
        if self.comm.rank != WRITER and board.embeddings_freq and epoch % board.embeddings_freq == 0:
            # (the path rank 0's TensorBoard saves to; rank 0 writes it)
            self.model.save_weights(os.path.join(board.log_dir, "train", f"keras_embedding.ckpt-{epoch}.weights.h5"))

    def log_weights(self, epoch):
        """``TensorBoard._log_weights`` (Keras 3.15) over every stage's weights."""
        board = self.board
        writer = compat.tensorboard_train_writer(board)
        with writer.as_default():
            for path, value in self.weights:
                name = path.replace(":", "_")
                board.summary.histogram(f"{name}/histogram", value, step=epoch)
                if board.write_images:
                    compat.log_weight_as_image(board, value, f"{name}/image", epoch)
            writer.flush()


def _tolerate_racing_directories(callback: keras.callbacks.ModelCheckpoint) -> None:
    """``ModelCheckpoint`` makes its file's directory where it is missing, on every rank: a race on a shared filesystem.

    Another rank can make it between Keras' check and its ``makedirs``
    (``{epoch}`` in the directory's name: a new one each epoch), which
    raised on this rank alone and aborted the job. While the callback
    saves, a directory that exists by then is taken as made
    (:func:`keras_pipe.compat.makedirs_tolerating_existing`).
    """

    def wrap(original):
        def save_model(*args, **kwargs):
            with compat.makedirs_tolerating_existing():
                return original(*args, **kwargs)

        return save_model

    compat.wrap_checkpoint_save(callback, wrap)  # (once: a second fit() with the same callback finds it wrapped)


def _make_collective(callback: keras.callbacks.BackupAndRestore, comm: Communicator) -> None:
    root = comm.rank == 0
    # The backup's weights: a sharded checkpoint (model/sharded.py), each stage writing its own; no rank holds
    # the whole model, which a backup written every epoch of a long run would otherwise need on rank 0.
    weights_path = compat.backup_paths(callback)["weights_path"].replace(".weights.h5", ".weights.json")
    compat.set_backup_weights_paths(callback, weights_path, f"{weights_path}.bkp")
    files = compat.file_utils()

    def position_of(weights_path, metadata_path):
        """(weights exist, epoch to resume at), read on rank 0; the epoch the weights file carries wins."""
        if not files.exists(weights_path):
            return {"weights": False, "epoch": None}
        epoch = _position_in(weights_path)
        if epoch is None and files.exists(metadata_path):
            with files.File(metadata_path, "r") as f:
                epoch = json.loads(f.read())["epoch"]
        return {"weights": True, "epoch": epoch}

    def restore(weights_path, metadata_path):
        model = callback.model
        weights_path = comm.bcast_json(_backup_to_read(weights_path) if root else None, root=0)
        found = on_root(comm, lambda: position_of(weights_path, metadata_path), "read the backup", metadata_path)
        found = comm.bcast_json(found, root=0)
        if found["weights"]:
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
            model.load_weights(weights_path)
        if found["epoch"] is not None:
            compat.set_initial_epoch(model, found["epoch"])

    def load_model():
        if not callback.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, build the model before fit() (start it with keras.Input)."
            )
        paths = compat.backup_paths(callback)
        try:
            restore(paths["weights_path"], paths["training_metadata_path"])
        except PipelineIOError as error:
            has_previous = callback.double_checkpoint and comm.bcast_json(
                files.exists(paths["prev_weights_path"]) if root else None, root=0
            )
            if not has_previous:
                raise PipelineIOError(
                    f"the backup in {callback.backup_dir} cannot be read, and there is no older one to resume from "
                    f"({error}). Delete {callback.backup_dir} to start afresh; BackupAndRestore(double_checkpoint="
                    "True) keeps the previous backup too."
                ) from error
            if root:
                warnings.warn(
                    f"the backup {paths['weights_path']} cannot be read ({error}); resuming from the previous one, "
                    f"{paths['prev_weights_path']}",
                    stacklevel=2,
                )

            def put_back():
                # (as Keras does: the previous backup becomes the latest, then is read under the latest's name, which
                # load_weights takes: a .bkp path is not a weights file's name to it)
                copy(paths["prev_weights_path"], paths["weights_path"])
                if files.exists(paths["prev_training_metadata_path"]):
                    copy(paths["prev_training_metadata_path"], paths["training_metadata_path"])
                elif files.exists(paths["training_metadata_path"]):
                    files.remove(paths["training_metadata_path"])

            on_root(comm, put_back, "put the previous backup back")
            restore(paths["weights_path"], paths["training_metadata_path"])

    def save_model():
        paths = compat.backup_paths(callback)
        if root:
            if not files.exists(callback.backup_dir):
                files.makedirs(callback.backup_dir)
            if callback.double_checkpoint and files.exists(paths["weights_path"]):
                copy(paths["weights_path"], paths["prev_weights_path"])
            if callback.double_checkpoint and files.exists(paths["training_metadata_path"]):
                copy(paths["training_metadata_path"], paths["prev_training_metadata_path"])
        position = {"epoch": paths["current_epoch"], "batch": paths["last_batch_seen"]}
        keep = [paths["prev_weights_path"]] if callback.double_checkpoint else []  # (its shards stay too)
        callback.model._saver.save_weights(
            paths["weights_path"], finish=lambda metadata: metadata.update({POSITION_ATTRIBUTE: position}), keep=keep
        )
        if root:
            write_text(paths["training_metadata_path"], json.dumps(position))

    original_end = callback.on_train_end

    def on_train_end(logs=None):
        if root:
            original_end(logs)
        comm.barrier()

    compat.replace_backup_io(callback, load_model, save_model)
    callback.on_train_begin = lambda logs=None: load_model()  # Keras' own fallback copies files on every rank
    callback.on_train_end = on_train_end


POSITION_ATTRIBUTE = "keras_pipe_backup_position"


def _backup_to_read(weights_path: str) -> str:
    """The backup's index, or where there is none the one file an earlier keras_pipe wrote (rank 0)."""
    files = compat.file_utils()
    one_file = weights_path.replace(".weights.json", ".weights.h5")
    return one_file if not files.exists(weights_path) and files.exists(one_file) else weights_path


def _position_in(weights_path: str):
    import h5py

    if weights_path.endswith(".weights.json"):  # (the index's metadata: written with the index, the commit)
        try:
            with open(weights_path) as f:
                position = json.load(f)["metadata"].get(POSITION_ATTRIBUTE)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return None if position is None else position["epoch"]

    try:
        with h5py.File(weights_path, "r") as f:
            text = f.attrs.get(POSITION_ATTRIBUTE)
    except OSError:
        return None  # not HDF5, or remote: the metadata file says
    return None if text is None else json.loads(text)["epoch"]
