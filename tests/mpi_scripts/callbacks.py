"""Every built-in callback behaves as for Sequential, identically on every rank.

Usage: callbacks.py TMPDIR [--families]. Trains a Sequential reference and a PipelineModel
with the same callbacks and compares what the callbacks did. ``--families``: then runs
callback_families.py in the same launch (its files under TMPDIR/families), to start the
ranks once for both.
"""

import os
import sys

import keras
import numpy as np
from common import RANK, SIZE, assert_close, data, layers

from keras_pipe import PipelineModel
from keras_pipe.mpi.comm import Communicator

tmp = sys.argv[1]
x, y, sw = data(n=203)
comm = Communicator()


class Reader(keras.callbacks.Callback):
    """A custom callback that reads self.model."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        weights = self.model.get_weights()
        self.seen.append(
            [float(self.model.optimizer.learning_rate), len(self.model.layers), float(sum(w.sum() for w in weights))]
        )


def train(model, tag, epochs=12, **fit_args):
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    early = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
    logged, reader = [], Reader()
    callbacks = [
        keras.callbacks.ModelCheckpoint(f"{tmp}/{tag}_best.keras", monitor="val_loss", save_best_only=True),
        keras.callbacks.ModelCheckpoint(f"{tmp}/{tag}_{{epoch}}.weights.h5", save_weights_only=True),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10),
        keras.callbacks.CSVLogger(f"{tmp}/{tag}_log{RANK}.csv"),
        keras.callbacks.TensorBoard(log_dir=f"{tmp}/{tag}_tensorboard{RANK}"),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: logged.append(dict(logs))),
        reader,
        early,
    ]
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=epochs,
        shuffle=False,
        validation_split=0.2,
        verbose=0,
        callbacks=callbacks,
        **fit_args,
    ).history
    return history, early.stopped_epoch, model.get_weights(), float(model.optimizer.learning_rate), logged, reader.seen


keras.utils.set_random_seed(11)
reference = keras.Sequential(layers(regularize=False))
initial = reference.get_weights()
expected = train(reference, f"seq{RANK}")
pipeline = PipelineModel(layers(regularize=False), num_microbatches=2)
pipeline.set_weights(initial)
got = train(pipeline, "pipe")

history, stopped, weights, lr, logged, seen = got
assert stopped == expected[1] and stopped > 0, f"rank {RANK}: stopped at {stopped}, Sequential at {expected[1]}"
assert sorted(history) == sorted(expected[0])
for key in history:
    assert_close(history[key], expected[0][key], f"history {key}")
for a, b in zip(weights, expected[2]):
    assert_close(a, b, "restored best weights")
assert_close(lr, expected[3], "learning rate")
for a, b in zip(logged, expected[4]):
    for key in b:
        assert_close(a[key], b[key], f"LambdaCallback {key}")
assert_close(np.array(seen), np.array(expected[5]), "custom callback", rtol=1e-4)
# Identical on every rank, too.
everyone = comm.allgather_json([stopped, lr, history["loss"]])
assert all(e == everyone[0] for e in everyone), everyone

comm.barrier()
# One writer: only rank 0's CSV and TensorBoard files exist.
for r in range(SIZE):
    assert os.path.exists(f"{tmp}/pipe_log{r}.csv") == (r == 0), f"CSVLogger file of rank {r}"
    assert os.path.exists(f"{tmp}/pipe_tensorboard{r}") == (r == 0), f"TensorBoard dir of rank {r}"
if RANK == 0:
    csv = np.genfromtxt(f"{tmp}/pipe_log0.csv", delimiter=",", names=True)
    csv_expected = np.genfromtxt(f"{tmp}/seq0_log0.csv", delimiter=",", names=True)
    for name in csv_expected.dtype.names:
        assert_close(csv[name], csv_expected[name], f"CSV column {name}")
    best = keras.models.load_model(f"{tmp}/pipe_best.keras")
    best_expected = keras.models.load_model(f"{tmp}/seq0_best.keras")
    assert_close(best.predict(x, verbose=0), best_expected.predict(x, verbose=0), "best checkpoint")
    assert os.path.exists(f"{tmp}/pipe_{stopped + 1}.weights.h5")

# TerminateOnNaN: a NaN sample weight stops every rank at the same batch, as Sequential.
sw_nan = sw.copy()
sw_nan[100] = np.nan
stops = []
for model in (keras.Sequential(layers(regularize=False)), PipelineModel(layers(regularize=False))):
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    batches = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs, seen=batches: seen.append(batch))
    model.fit(
        x,
        y,
        sample_weight=sw_nan,
        batch_size=32,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN(), counter],
    )
    stops.append(len(batches))
assert stops[0] == stops[1] < 7 * 3, stops
assert len(set(comm.allgather_json(stops[1]))) == 1


# A stop one rank alone asks for (its own clock, a file, a signal handler on a preempted node) stops every rank
# after the same batch, as Sequential stopping there: fit() at a batch and at an epoch's end, evaluate() at a batch.
class StopAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch, rank):
        super().__init__()
        self.at, self.rank, self.epoch = (epoch, batch), rank, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at and RANK == self.rank:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.at == (epoch, None) and RANK == self.rank:
            self.model.stop_training = True

    def on_test_batch_end(self, batch, logs=None):
        if self.at == (None, batch) and RANK == self.rank:
            self.model.stop_evaluating = True


keras.utils.set_random_seed(5)
sequential = keras.Sequential(layers(regularize=False))
pipeline = PipelineModel(layers(regularize=False))
pipeline.set_weights(sequential.get_weights())
for model in (sequential, pipeline):  # (one compile each, for all three stops: no XLA, which they do not depend on)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=False)
for at, rank in (((1, 2), SIZE - 1), ((0, None), 0)):
    results = []
    for model, stopper in ((sequential, StopAt(*at, RANK)), (pipeline, StopAt(*at, rank))):
        history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[stopper])
        results.append((history.history["loss"], model.get_weights()))
    assert len(results[1][0]) == len(results[0][0]) == at[0] + 1, (at, results[0][0], results[1][0])
    assert_close(results[1][0], results[0][0], f"losses, stopped at {at} by rank {rank}")
    for a, b in zip(results[1][1], results[0][1]):
        assert_close(a, b, f"weights, stopped at {at} by rank {rank}")
evaluated = [
    model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[StopAt(None, 1, rank)])
    for model, rank in ((sequential, RANK), (pipeline, SIZE - 1))
]
assert_close(evaluated[1], evaluated[0], "evaluate() stopped after batch 1 by the last rank")

# A checkpoint in a new directory each epoch: every rank's ModelCheckpoint makes a missing directory (Keras:
# exists? else makedirs), and on one filesystem another rank can make it in between (FileExistsError on one rank
# aborted the job, 1 run in 3 on 3 ranks: Keras' own model_checkpoint_test's "subdir" did it once in CI).
racing = PipelineModel(layers(regularize=False))
racing.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
epochs = 12
path = f"{tmp}/racing/{{epoch}}/model.weights.h5"
checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
racing.fit(x, y, batch_size=101, epochs=epochs, verbose=0, callbacks=[checkpoint])
racing.fit(x, y, batch_size=101, epochs=1, verbose=0, callbacks=[checkpoint])  # (the same callback: wrapped once)
assert all(os.path.exists(path.format(epoch=e)) for e in range(1, epochs + 1)), sorted(os.listdir(f"{tmp}/racing"))

print(f"CALLBACKS OK rank {RANK} of {SIZE}: stopped at epoch {stopped}", flush=True)

if "--families" in sys.argv[2:]:
    import runpy

    families = os.path.join(tmp, "families")
    os.makedirs(families, exist_ok=True)
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "callback_families.py"), families]
    runpy.run_path(sys.argv[0], run_name="__main__")
