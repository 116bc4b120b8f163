"""Keras callbacks under the pipeline: one writer for files, collective checkpoints.

Every rank sees the same logs, so every callback decides the same thing on
every rank (EarlyStopping stops everywhere at the same epoch,
ReduceLROnPlateau sets the same learning rate). What must differ:

- callbacks that only write files (``CSVLogger``, ``TensorBoard``) run on
  rank 0 alone: one writer;
- ``ModelCheckpoint`` runs everywhere, as ``model.save``/``save_weights`` are
  collective and rank 0 writes;
- ``BackupAndRestore`` decides on rank 0 whether a backup exists and tells the
  other ranks, so that they need not share its filesystem, and only rank 0
  writes the backup and its metadata.
"""

from __future__ import annotations

import json
import warnings

import keras

from keras_pipe import compat
from keras_pipe.errors import PipelineIOError
from keras_pipe.model.saving import on_root, write_weights
from keras_pipe.mpi.comm import Communicator
from keras_pipe.mpi.files import copy, write_text
from keras_pipe.optional import check_callbacks

_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


def adapt_callbacks(callbacks, comm: Communicator):
    """The callbacks this rank runs (see the module docstring)."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    check_callbacks(callbacks)  # (on every rank: a writer's missing package is everyone's error, before training)
    kept = []
    for callback in callbacks:
        if isinstance(callback, _WRITERS) and comm.rank != 0:
            continue
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            _make_collective(callback, comm)
        kept.append(callback)
    return kept


def _make_collective(callback: keras.callbacks.BackupAndRestore, comm: Communicator) -> None:
    root = comm.rank == 0
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
            restore(paths["prev_weights_path"], paths["prev_training_metadata_path"])

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
        write_weights(callback.model, paths["weights_path"], finish=lambda path: mark_position(path, position))
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


def mark_position(weights_path: str, position: dict) -> None:
    """Stores a backup's position (epoch, batch) inside its weights file, before the file is renamed into place.

    The weights and the epoch to resume at are then replaced together: a job
    killed between writing the weights and the metadata file cannot resume
    at the wrong epoch.
    """
    import h5py

    with h5py.File(weights_path, "a") as f:
        f.attrs[POSITION_ATTRIBUTE] = json.dumps(position)


def _position_in(weights_path: str):
    import h5py

    try:
        with h5py.File(weights_path, "r") as f:
            text = f.attrs.get(POSITION_ATTRIBUTE)
    except OSError:
        return None  # not HDF5, or remote: the metadata file says
    return None if text is None else json.loads(text)["epoch"]
