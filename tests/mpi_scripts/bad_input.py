"""Every mistake gives a clear error on every rank, before any hang.

Runs on 4 ranks; each case prints ``CASE <name>: <first line of the error>``
on every rank, or ``CASE <name>: no error`` (which the test reports).
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf
from common import RANK, SIZE, compile_args, data, layers

from keras_pipe import PipelineModel

assert SIZE == 4, "run on 4 ranks"
x, y, sw = data(n=256)


def case(name, build, fit=None):
    try:
        model = build()
        if fit is not None:
            fit(model)
        print(f"CASE {name}: no error", flush=True)
    except (ValueError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0]
        detail = " | ".join(str(error).strip().splitlines()[1:4])
        print(f"CASE {name}: {type(error).__name__}: {first} | {detail}", flush=True)


def compiled(chain, **options):
    model = PipelineModel(chain, **options)
    model.compile(**compile_args())
    return model


def fit(model, **kwargs):
    arguments = dict(x=x, y=y, batch_size=32, epochs=1, verbose=0)
    arguments.update(kwargs)
    model.fit(**arguments)


def different_width():
    chain = layers()
    if RANK == 1:
        chain[2] = keras.layers.Dense(24, activation="tanh")
    return compiled(chain)


case("layers differ", different_width, fit)
case("batch size differs", lambda: compiled(layers()), lambda m: fit(m, batch_size=16 if RANK == 3 else 32))
case(
    "data size differs",
    lambda: compiled(layers()),
    lambda m: fit(m, x=x[: 200 if RANK == 1 else 256], y=y[: 200 if RANK == 1 else 256]),
)
case("num_microbatches differs", lambda: compiled(layers(), num_microbatches=2 if RANK == 0 else 4), fit)


def short_generator(model):
    # (ranks 0 and 2 are the two replicas' first stages, which read the generator; the others never call it)
    batches = 5 if RANK == 2 else 8

    def generate():
        for i in range(batches):
            yield x[32 * i : 32 * (i + 1)], y[32 * i : 32 * (i + 1)]

    model.fit(generate(), epochs=1, verbose=0)


case("fewer batches on one rank", lambda: compiled(layers(), num_stages=2), short_generator)
case("balance does not cover the layers", lambda: compiled(layers(), balance=[1, 1, 1, 1]), fit)
case("num_microbatches < 1", lambda: compiled(layers(), num_microbatches=0))
case("num_stages does not divide the ranks", lambda: compiled(layers(), num_stages=3))
case("num_stages differs", lambda: compiled(layers(), num_stages=1 if RANK == 3 else 4))


def reused():
    dense = keras.layers.Dense(16)
    return compiled(
        [keras.Input((12,)), dense, keras.layers.Dense(16), dense, keras.layers.Dense(3), keras.layers.Dense(3)]
    )


case("a layer used twice", reused)
case(
    "not a chain",
    lambda: compiled(layers()[:3] + [keras.layers.Concatenate()] + layers()[3:]),
    fit,
)


def compile_with(**options):
    def build():
        model = PipelineModel(layers())
        arguments = compile_args()
        arguments.update(options)
        model.compile(**arguments)
        return model

    return build


case("loss without reduction", compile_with(loss=keras.losses.SparseCategoricalCrossentropy(reduction=None)))


case("stall_timeout", lambda: PipelineModel(layers(), stall_timeout=0))
case("stall_timeout not a number", lambda: PipelineModel(layers(), stall_timeout="abc"))


class OwnLoss(PipelineModel):
    def compute_loss(self, *args, **kwargs):
        return super().compute_loss(*args, **kwargs)


case("compute_loss override", lambda: OwnLoss(layers()).compile(**compile_args()))


def overriding(method):
    """A Functional model whose class overrides ``method`` (as a keras_hub object detector does compute_loss)."""

    def own(self, *args, **kwargs):
        return getattr(keras.Model, method)(self, *args, **kwargs)

    own_class = type(f"Own{method.title().replace('_', '')}", (keras.Model,), {method: own})
    inputs = keras.Input((12,))
    return own_class(inputs, keras.layers.Dense(3)(keras.layers.Dense(16)(inputs)))


def written_by(writer):
    def write(model):
        with tempfile.TemporaryDirectory() as directory:  # (this rank's: refused before anything is read back)
            writer(model, os.path.join(directory, "model.keras"))

    return write


case("keras.saving.save_model", lambda: compiled(layers()), written_by(keras.saving.save_model))
case(
    "tf.train.Checkpoint",
    lambda: compiled(layers()),
    written_by(lambda model, path: tf.train.Checkpoint(model=model).save(path)),
)
case(  # (Keras' own error would name the class each rank holds: the dataset, or a follower's)
    "validation_split of a dataset",
    lambda: compiled(layers()),
    lambda m: m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), validation_split=0.2, verbose=0),
)
case(
    "save_to_preset of a chain",
    lambda: compiled(layers()),
    written_by(lambda model, path: model.save_to_preset(os.path.dirname(path))),
)

for method in ("train_step", "compute_loss", "predict_step"):
    case(f"{method} of the model given", lambda method=method: PipelineModel.from_model(overriding(method)))
case("a pipeline pipelined again", lambda: PipelineModel.from_model(compiled(layers())))

# run_eagerly=True is honoured: same training as compiled graphs.
keras.utils.set_random_seed(3)
graph = compiled(layers())
initial = graph.get_weights()
graph_history = graph.fit(x, y, batch_size=32, epochs=2, verbose=0).history
eager = PipelineModel(layers())
eager.set_weights(initial)
arguments = compile_args()
eager.compile(run_eagerly=True, **arguments)
eager_history = eager.fit(x, y, batch_size=32, epochs=2, verbose=0).history
np.testing.assert_allclose(eager_history["loss"], graph_history["loss"], rtol=1e-5)
print("CASE run_eagerly: same as graphs", flush=True)

# Losses whose reduction is "sum" or "mean_with_sample_weight" are split into
# micro-batches with their own weights: training still equals Sequential.
for reduction in ("sum", "mean_with_sample_weight"):
    keras.utils.set_random_seed(4)
    sequential = keras.Sequential(layers())
    start = sequential.get_weights()
    pipeline = PipelineModel(layers(), num_microbatches=3)
    pipeline.set_weights(start)
    results = []
    for model in (sequential, pipeline):
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction))
        history = model.fit(x, y, sample_weight=sw, batch_size=50, epochs=2, shuffle=False, verbose=0).history
        results.append((history["loss"], model.get_weights()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, err_msg=reduction)
    for a, b in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=reduction)
print("CASE loss reductions: same as Sequential", flush=True)
