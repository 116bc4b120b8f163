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

import keras

from keras_pipe import compat
from keras_pipe.comm import Communicator

_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)


def adapt_callbacks(callbacks, comm: Communicator):
    """The callbacks this rank runs (see the module docstring)."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
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

    def load_model():
        model = callback.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, build the model before fit() (start it with keras.Input)."
            )
        paths = compat.backup_paths(callback)
        found = None
        if root:
            found = {"weights": files.exists(paths["weights_path"]), "epoch": None}
            if files.exists(paths["training_metadata_path"]):
                with files.File(paths["training_metadata_path"], "r") as f:
                    found["epoch"] = json.loads(f.read())["epoch"]
        found = comm.bcast_json(found, root=0)
        if found["weights"]:
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
            model.load_weights(paths["weights_path"])
        if found["epoch"] is not None:
            compat.set_initial_epoch(model, found["epoch"])

    def save_model():
        paths = compat.backup_paths(callback)
        if root:
            if not files.exists(callback.backup_dir):
                files.makedirs(callback.backup_dir)
            if callback.double_checkpoint and files.exists(paths["weights_path"]):
                files.copy(paths["weights_path"], paths["prev_weights_path"])
            if callback.double_checkpoint and files.exists(paths["training_metadata_path"]):
                files.copy(paths["training_metadata_path"], paths["prev_training_metadata_path"])
        callback.model.save_weights(filepath=paths["weights_path"], overwrite=True)
        if root:
            with files.File(paths["training_metadata_path"], "w") as f:
                f.write(json.dumps({"epoch": paths["current_epoch"], "batch": paths["last_batch_seen"]}))

    original_end = callback.on_train_end

    def on_train_end(logs=None):
        if root:
            original_end(logs)
        comm.barrier()

    compat.replace_backup_io(callback, load_model, save_model)
    callback.on_train_end = on_train_end
