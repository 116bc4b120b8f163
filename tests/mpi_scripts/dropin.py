"""Drop-in cases: each behaves as keras.Sequential does, or fails clearly on every rank.

Run on 2 or 3 ranks; prints ``DROPIN <case> ok`` per case and rank.
"""

import os
import sys
import tempfile

import keras
import numpy as np
from common import RANK, SIZE, assert_close
from mpi4py import MPI

import keras_pipe
from keras_pipe import PipelineConfigError, PipelineModel

COMM = MPI.COMM_WORLD


def ok(name):
    print(f"DROPIN {name} ok rank {RANK}", flush=True)


def same_training(make_layers, x, y, compile_args, m=2, from_sequential=False, **fit):
    """Trains Sequential (rank 0's initial weights) and the pipeline; compares history and weights."""
    sequential = keras.Sequential(make_layers())  # unseeded: different weights on every rank
    initial = COMM.bcast(sequential.get_weights() if RANK == 0 else None, root=0)
    if from_sequential:
        # from_sequential takes the model's own layers (each rank then frees the other stages'
        # weights): the reference is a second Sequential
        handed_in = sequential
        sequential = keras.Sequential(make_layers())
        pipeline = PipelineModel.from_sequential(handed_in, num_microbatches=m)
    else:
        pipeline = PipelineModel(make_layers(), num_microbatches=m)
        pipeline.set_weights(sequential.get_weights())  # this rank's own: rank 0's are taken
    sequential.set_weights(initial)
    sequential.compile(**compile_args())
    pipeline.compile(**compile_args())
    fit = dict(dict(batch_size=16, epochs=2, shuffle=False, verbose=0), **fit)
    expected = sequential.fit(x, y, **fit).history
    history = pipeline.fit(x, y, **fit).history
    for key in expected:
        assert_close(history[key], expected[key], f"history {key}")
    for a, b in zip(pipeline.get_weights(), sequential.get_weights()):
        assert_close(a, b, "weights", atol=1e-5)
    return sequential, pipeline


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 12)).astype("float32")
y = rng.integers(0, 3, size=64)


def dense_chain():
    return [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8), keras.layers.Dense(3)]


def adam_args():
    # epsilon: the weights are unseeded (rank 0's draw), and now and then a draw gives one weight a gradient that
    # cancels to round-off; Adam's default epsilon (1e-7) scales that round-off, which a micro-batched sum rounds
    # otherwise, into a good part of a step (CI saw 4e-5 on one weight of 192). At 1e-3 round-off stays round-off.
    return dict(
        optimizer=keras.optimizers.Adam(1e-2, epsilon=1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True)
    )


# 1. An unseeded script: every rank's Sequential differs; the pipeline trains rank 0's.
same_training(dense_chain, x, y, adam_args, from_sequential=True)
same_training(dense_chain, x, y, adam_args)
ok("unseeded")

# 2 + 3. Embedding with Adam (a sparse gradient), int32 inputs fed numpy's int64 token ids.
tokens = rng.integers(1, 50, size=(64, 6))  # int64


def embedding_chain():
    return [
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(50, 8),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3),
    ]


_, pipeline = same_training(embedding_chain, tokens, y, adam_args)
assert pipeline.count_params() == keras.Sequential(embedding_chain()).count_params(), pipeline.count_params()
ok("embedding adam int64")

# 4 + 8. evaluate(): Sequential's list, in its order and length, on every rank; binary labels of shape (n, 1).
binary = (x[:, :1] > 0).astype("float32")


def binary_chain():
    return [
        keras.Input((12,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ]


def binary_args():
    return dict(
        optimizer="sgd",
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.Precision(name="precision"), keras.metrics.AUC(name="auc")],
        weighted_metrics=["accuracy"],
    )


sequential, pipeline = same_training(binary_chain, x, binary, binary_args, m=3, sample_weight=np.ones(64))
expected = sequential.evaluate(x, binary, verbose=0)
result = pipeline.evaluate(x, binary, verbose=0)
assert len(result) == len(expected), (result, expected)  # (Keras lists "accuracy" twice here)
assert_close(result, expected, "evaluate list")
assert list(pipeline.evaluate(x, binary, verbose=0, return_dict=True)) == list(
    sequential.evaluate(x, binary, verbose=0, return_dict=True)
)
ok("evaluate order")

# 5. keras_pipe.load_model opens an uncompiled file saved by plain Keras.
directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None, root=0)
path = os.path.join(directory, "plain.keras")
keras.utils.set_random_seed(1)
plain = keras.Sequential(dense_chain())
if RANK == 0:
    plain.save(path)
COMM.Barrier()
loaded = keras_pipe.load_model(path)
assert_close(loaded.predict(x, verbose=0), plain.predict(x, verbose=0), "uncompiled load")
ok("uncompiled load")


# 6. A Lambda layer, and a custom layer with neither get_config() nor **kwargs.
class Scale(keras.layers.Layer):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor


def lambda_chain():
    return [
        keras.Input((12,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Lambda(lambda t: t * 2.0),
        Scale(0.5),
        keras.layers.Dense(3),
    ]


same_training(lambda_chain, x, y, adam_args)
same_training(lambda_chain, x, y, adam_args, from_sequential=True)
ok("lambda and custom layers")


# 7. Fewer layers than ranks: the last stages hold none (the last computes the loss), with a warning.
def short_chain():
    return [keras.Input((12,)), *dense_chain()[1:SIZE]]  # SIZE - 1 layers


same_training(short_chain, x, y, adam_args)
ok("fewer layers than ranks")

# 8. fit(x) without y: the package's message, on every rank.
model = PipelineModel(dense_chain())
model.compile(**adam_args())
try:
    model.fit(x, epochs=1, verbose=0)
    raise AssertionError("fit() without y trained")
except PipelineConfigError as error:
    assert "no y" in str(error), error
ok("fit without y")

# 8. A metric object created once more on one rank (auto-named differently there) changes nothing.
if RANK == 1:
    keras.metrics.Precision()
model = PipelineModel(binary_chain())
model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=[keras.metrics.Precision()])
model.fit(x, binary, epochs=1, verbose=0)
ok("extra metric object")

# 8. from_sequential on a branching Functional model pipelines it, as from_model does (rank 0's weights).
inputs = keras.Input((12,))
branching = keras.Model(inputs, keras.layers.Add()([keras.layers.Dense(4)(inputs), keras.layers.Dense(4)(inputs)]))
expected = COMM.bcast(branching.predict(x, verbose=0) if RANK == 0 else None, root=0)
pipeline = PipelineModel.from_sequential(branching)
assert_close(pipeline.predict(x, verbose=0), expected, "a Functional model through from_sequential")
ok("functional")


# 9. keras.Model(inputs, outputs) -> PipelineModel(inputs, outputs), positionally; output_names, and a loss and
# metrics by output name, as keras.Model's (issue 41): the same logs and weights.
def named_outputs(cls, **options):
    keras.utils.set_random_seed(3)
    given = keras.Input((12,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(given)
    outputs = [keras.layers.Dense(1, name="a")(hidden), keras.layers.Dense(1, activation="sigmoid", name="b")(hidden)]
    model = cls(given, outputs, **options)
    model.compile(optimizer="adam", loss={"a": "mse", "b": "binary_crossentropy"}, metrics={"b": ["acc"]})
    return model


reference = named_outputs(keras.Model)
pipeline = named_outputs(PipelineModel, num_microbatches=2)
pipeline.set_weights(reference.get_weights())
assert pipeline.output_names == reference.output_names == ["a", "b"], pipeline.output_names
targets = {"a": x[:, :1], "b": binary}
expected = reference.fit(x, targets, batch_size=32, epochs=2, shuffle=False, verbose=0).history
history = pipeline.fit(x, targets, batch_size=32, epochs=2, shuffle=False, verbose=0).history
assert sorted(history) == sorted(expected) == ["a_loss", "b_acc", "b_loss", "loss"], sorted(history)
for key in expected:
    assert_close(history[key], expected[key], f"named outputs {key}")
for a, b in zip(pipeline.get_weights(), reference.get_weights()):
    assert_close(a, b, "named outputs weights")
ok("named outputs")

print(f"DROPIN done rank {RANK} of {SIZE}", flush=True)
sys.exit(0)
