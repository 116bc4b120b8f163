"""Each family of Keras callbacks against keras.Sequential, on every rank, in one launch (issue 47).

Usage: callback_families.py TMPDIR. The unsplit references train on rank 0
alone (common.on_rank_0); every rank compares its pipeline with them.

1. Monitors with mode="auto" on a metric, not a loss: EarlyStopping,
   ModelCheckpoint(save_best_only) and ReduceLROnPlateau on "val_accuracy",
   on a model with an unregistered custom layer: the stop epoch, the
   learning-rate curve, the best checkpoint (reloaded with custom_objects,
   by Keras and by keras_pipe.load_model).
2. A custom layer whose get_config misses an argument: save, save_weights
   and load_weights work as for Sequential (only loading the .keras file
   needs the class).
3. TensorBoard with histograms and embeddings: the event files' tags equal
   Sequential's, the histograms are of every stage's weights.
4. Effects once per job: RemoteMonitor posts and a writer_only callback run
   on rank 0 alone.
5. tf.distribute: refused on every rank with the reason.
"""

import glob
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from common import RANK, SIZE, assert_close, data, on_rank_0

import keras_pipe
from keras_pipe import PipelineModel
from keras_pipe.errors import PipelineConfigError
from keras_pipe.model.callbacks import is_writer, writer_only
from keras_pipe.mpi.comm import Communicator

tmp = sys.argv[1]
comm = Communicator()
x, y, _ = data(n=160)


class Scale(keras.layers.Layer):
    """A custom layer, not registered: Keras cannot rebuild it from its config without custom_objects."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.w * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


class Untidy(Scale):
    """Its get_config misses ``factor``: Keras writes it all the same; only loading the file fails."""

    def get_config(self):
        return keras.layers.Layer.get_config(self)


def chain(custom=Scale):
    return [
        keras.Input((12,)),
        keras.layers.Dense(16, activation="relu"),
        custom(0.5),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ]


def compiled(model, rate=0.05):
    model.compile(optimizer=keras.optimizers.Adam(rate), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


# -- 1. monitors on val_accuracy, mode="auto" ---------------------------------------------------------------------


def monitored(model, tag):
    early = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=3, restore_best_weights=True)
    callbacks = [
        keras.callbacks.ModelCheckpoint(f"{tmp}/{tag}_best.keras", monitor="val_accuracy", save_best_only=True),
        keras.callbacks.ReduceLROnPlateau(monitor="val_accuracy", factor=0.5, patience=1),
        early,
    ]
    history = model.fit(
        x, y, batch_size=32, epochs=14, shuffle=False, validation_split=0.25, verbose=0, callbacks=callbacks
    )
    return history.history, early.stopped_epoch, model.get_weights()


keras.utils.set_random_seed(3)
reference = compiled(keras.Sequential(chain()))
initial = reference.get_weights()
expected = on_rank_0(monitored, reference, "seq")
pipeline = compiled(PipelineModel(chain(), num_microbatches=2))
pipeline.set_weights(initial)
history, stopped, weights = monitored(pipeline, "pipe")
assert stopped == expected[1], f"rank {RANK}: EarlyStopping(val_accuracy) stopped at {stopped}, not {expected[1]}"
assert sorted(history) == sorted(expected[0]), (sorted(history), sorted(expected[0]))
for key in history:
    assert_close(history[key], expected[0][key], f"history {key}", rtol=1e-4)
assert_close(history["learning_rate"], expected[0]["learning_rate"], "ReduceLROnPlateau's learning-rate curve")
for a, b in zip(weights, expected[2]):
    assert_close(a, b, "EarlyStopping's restored best weights", rtol=1e-4)
assert len(set(map(str, comm.allgather_json([stopped, history["learning_rate"]])))) == 1

comm.barrier()
best = keras_pipe.load_model(f"{tmp}/pipe_best.keras", custom_objects={"Scale": Scale})
got = best.predict(x, verbose=0)
if RANK == 0:
    keras_best = keras.models.load_model(f"{tmp}/pipe_best.keras", custom_objects={"Scale": Scale})
    seq_best = keras.models.load_model(f"{tmp}/seq_best.keras", custom_objects={"Scale": Scale})
    assert type(keras_best) is keras.Sequential and type(keras_best.layers[1]) is Scale
    assert_close(keras_best.predict(x, verbose=0), seq_best.predict(x, verbose=0), "best checkpoint", rtol=1e-4)
    assert_close(got, seq_best.predict(x, verbose=0), "best checkpoint through keras_pipe.load_model", rtol=1e-4)
    try:
        keras.models.load_model(f"{tmp}/pipe_best.keras")
        raise AssertionError("an unregistered layer loaded without custom_objects")
    except TypeError as error:
        assert "Scale" in str(error), error

# -- 2. a layer whose config cannot rebuild it -------------------------------------------------------------------

untidy = compiled(PipelineModel(chain(Untidy), num_microbatches=2))
untidy.fit(x, y, batch_size=32, epochs=1, verbose=0)
untidy.save(f"{tmp}/untidy.keras")
untidy.save_weights(f"{tmp}/untidy.weights.h5")
trained = untidy.get_weights()
untidy.set_weights([np.zeros_like(w) for w in trained])
untidy.load_weights(f"{tmp}/untidy.weights.h5")
for a, b in zip(untidy.get_weights(), trained):
    assert_close(a, b, "load_weights of a layer Keras cannot rebuild")
backup = keras.callbacks.BackupAndRestore(f"{tmp}/untidy_backup")
untidy.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[backup])
# (rank 0 lent its layers of other stages the weights for writing, and took them back)
layer = next(layer for layer in untidy.layers if isinstance(layer, Untidy))
mine = any(held is layer for held in untidy.stage_layers)
try:
    layer.w.numpy()
    assert mine, f"rank {RANK}: reads a weight of another stage after saving"
except RuntimeError as error:
    assert "belongs to another stage" in str(error) and not mine, error
if RANK == 0:
    with open(f"{tmp}/untidy.keras", "rb") as f:
        assert f.read(2) == b"PK"
    seq = compiled(keras.Sequential(chain(Untidy)))
    seq.save(f"{tmp}/untidy_seq.keras")  # what Keras does: it saves; only loading needs the class and its config
    for path in (f"{tmp}/untidy_seq.keras", f"{tmp}/untidy.keras"):
        try:
            keras.models.load_model(path, custom_objects={"Untidy": Untidy})
            raise AssertionError("loaded a layer whose config misses an argument")
        except TypeError as error:
            assert "factor" in str(error), error

# -- 3. TensorBoard: scalars, histograms of every stage's weights, embeddings -----------------------------------


def embedding_chain():
    return [
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(30, 4, name="tokens"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(8, activation="relu", name="hidden_1"),
        keras.layers.Dense(8, activation="relu", name="hidden_2"),
        keras.layers.Dense(3, activation="softmax", name="classes"),
    ]


tokens = np.random.default_rng(1).integers(0, 30, size=(96, 6)).astype("int32")


def boarded(model, log_dir):
    board = keras.callbacks.TensorBoard(log_dir, histogram_freq=1, embeddings_freq=1)
    model.fit(tokens, y[:96], batch_size=32, epochs=2, validation_split=0.25, verbose=0, callbacks=[board])


def tags_of(log_dir):
    """{(train|validation, tag): last value} of a TensorBoard directory's event files."""
    found = {}
    for path in sorted(glob.glob(f"{log_dir}/*/events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                array = tf.make_ndarray(value.tensor) if value.HasField("tensor") else None
                found[(os.path.basename(os.path.dirname(path)), value.tag)] = array
    return found


keras.utils.set_random_seed(5)
reference = compiled(keras.Sequential(embedding_chain(), name="tagged"))
initial = reference.get_weights()
on_rank_0(boarded, reference, f"{tmp}/board_seq")
pipeline = compiled(PipelineModel(embedding_chain(), num_microbatches=2, name="tagged"))
pipeline.set_weights(initial)
boarded(pipeline, f"{tmp}/board_pipe")
final = pipeline.get_weights()  # (collective)
comm.barrier()
if RANK == 0:
    want, have = tags_of(f"{tmp}/board_seq"), tags_of(f"{tmp}/board_pipe")
    assert sorted(have) == sorted(want), (sorted(set(want) ^ set(have)), sorted(have))
    histograms = [key for key in want if key[1].endswith("/histogram")]
    assert len(histograms) == len(final), histograms
    for key in histograms + [("train", "epoch_loss"), ("validation", "epoch_accuracy")]:
        assert_close(have[key], want[key], f"TensorBoard {key}", rtol=1e-4, atol=1e-5)
    for name in ("projector_config.pbtxt", "train/keras_embedding.ckpt-1.weights.h5"):
        assert os.path.exists(f"{tmp}/board_pipe/{name}"), name
    with open(f"{tmp}/board_pipe/projector_config.pbtxt") as f:
        assert "embeddings" in f.read()
# (the embeddings' checkpoint is the whole model's, from rank 0, readable by its Sequential)
if RANK == 0:
    reference.load_weights(f"{tmp}/board_pipe/train/keras_embedding.ckpt-1.weights.h5")
    for a, b in zip(reference.get_weights(), final):
        assert_close(a, b, "TensorBoard's embeddings checkpoint")

# -- 4. effects once per job -------------------------------------------------------------------------------------

import requests  # noqa: E402

posts, seen = [], []
requests.post = lambda *args, **kwargs: posts.append(kwargs.get("data") or kwargs.get("json"))


class Tracker(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        seen.append(epoch)


model = compiled(PipelineModel(chain(), num_microbatches=2))
model.fit(
    x,
    y,
    epochs=2,
    verbose=0,
    callbacks=[keras.callbacks.RemoteMonitor(root="http://localhost:9"), writer_only(Tracker())],
)
assert comm.allgather_json([len(posts), len(seen), is_writer()]) == [[2, 2, True]] + [[0, 0, False]] * (SIZE - 1)

# -- 5. tf.distribute is refused on every rank -------------------------------------------------------------------

strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
for where in ("made in its scope", "fit in its scope"):
    try:
        if where == "made in its scope":
            with strategy.scope():
                model = PipelineModel(chain(), num_microbatches=2)
            model.compile(loss="sparse_categorical_crossentropy")  # (Keras trains it under the strategy)
        else:
            model = PipelineModel(chain(), num_microbatches=2)
            model.compile(loss="sparse_categorical_crossentropy")
            with strategy.scope():
                model.fit(x, y, epochs=1, verbose=0)
        raise AssertionError(f"rank {RANK}: tf.distribute accepted, {where}")
    except PipelineConfigError as error:
        assert "tf.distribute" in str(error) and "OneDeviceStrategy" in str(error), error

print(f"FAMILIES OK rank {RANK} of {SIZE}: EarlyStopping(val_accuracy) stopped at {stopped}", flush=True)
