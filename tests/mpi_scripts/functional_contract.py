"""The Functional side of Keras' model contract (issue 41), on one rank and on several: one launch, every case.

Run as ``mpirun -n P python functional_contract.py``; prints ``CONTRACT <case> ok rank R`` per case and rank.
Each case compares with ``keras.Model`` on the same weights, or expects the same error on every rank.
"""

import pickle
import sys

import keras
import numpy as np
from common import RANK, SIZE, assert_close
from mpi4py import MPI

from keras_pipe import PipelineConfigError, PipelineModel

COMM = MPI.COMM_WORLD
L = keras.layers
x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")


def ok(case):
    print(f"CONTRACT {case} ok rank {RANK}", flush=True)


def raises(kind, match, action):
    """``action()`` raises ``kind`` with ``match`` in its text (on this rank: every rank runs this)."""
    try:
        action()
    except kind as error:
        assert match in str(error), (match, str(error))
        return
    raise AssertionError(f"no {kind.__name__} ({match})")


def graph(cls, **options):
    keras.utils.set_random_seed(3)
    given = keras.Input((3,), name="x")
    hidden = L.Dense(4, activation="tanh", name="hidden")(given)
    return cls(given, L.Dense(2, name="out")(hidden), **options)


def same_weights_as(reference, **options):
    model = graph(PipelineModel, **options)
    model.set_weights(reference.get_weights())
    return model


# 1. Built once constructed, as a Functional model: its weights (this rank's stage), state trees, count_params.
reference = graph(keras.Model)
model = graph(PipelineModel)
mine = len(model.weights)
assert model.built and COMM.allreduce(mine) == len(reference.weights) == 4, (model.built, mine)
assert model.count_params() == reference.count_params()
if SIZE == 1:
    model.compile(optimizer="adam", loss="mse")
    tree = model.get_state_tree()
    assert sorted(tree["trainable_variables"]) == ["hidden", "out"], tree["trainable_variables"]
    model.set_state_tree(tree)
ok("built")

# 2. quantize(): as Keras' on one stage (the pipeline built again over the quantized layers); refused on several.
model = same_weights_as(reference)
if SIZE == 1:
    quantized = graph(keras.Model)
    quantized.set_weights(reference.get_weights())
    quantized.quantize("int8")
    model.quantize("int8")
    assert_close(model.predict(x, verbose=0), quantized.predict(x, verbose=0), "quantized predict")
    assert_close(model(x), quantized(x), "quantized call")
else:
    raises(PipelineConfigError, "Quantize the Keras model before pipelining it", lambda: model.quantize("int8"))
ok("quantize")


# 3. None for an optional input, as Keras' Functional model takes it (the first stage's layers get None);
# Keras' error for an input that is not optional.
class Either(L.Layer):
    def call(self, a, b=None):
        return a if b is None else a + b


def optional_model(cls, **options):
    keras.utils.set_random_seed(3)
    a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b", optional=True)
    hidden = L.Dense(4, activation="tanh", name="o1")(Either(name="either")(L.Dense(3, name="o0")(a), b))
    return cls({"a": a, "b": b}, L.Dense(2, name="o2")(L.Dense(4, name="o3")(hidden)), **options)


unsplit = optional_model(keras.Model)
optional = optional_model(PipelineModel, num_microbatches=2, split_before=["o3"] if SIZE > 1 else None)
optional.set_weights(unsplit.get_weights())
for each in (unsplit, optional):
    each.compile(optimizer="adam", loss="mse")
for given in ({"a": x, "b": None}, {"a": x, "b": 2 * x}):
    expected = unsplit.fit(given, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    got = optional.fit(given, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert_close(got, expected, f"optional input {given['b'] is None}")
    assert_close(optional.predict(given, verbose=0), unsplit.predict(given, verbose=0), "optional predict")
for got, want in zip(optional.get_weights(), unsplit.get_weights()):
    assert_close(got, want, "optional weights")
if SIZE > 1:  # (b read on the second stage: it would have to cross)
    later = optional_model(PipelineModel, split_before=["either"])
    later.compile(optimizer="adam", loss="mse")
    raises(PipelineConfigError, "a later stage reads them", lambda: later.fit({"a": x, "b": None}, y, verbose=0))
    later.fit({"a": x, "b": x}, y, verbose=0)  # (the ranks are in step after the error)
model = same_weights_as(reference)
model.compile(optimizer="sgd", loss="mse")
raises(ValueError, "is not optional", lambda: model.fit([None], y, verbose=0))
ok("none inputs")

# 4. from_config of a Functional model's config: its graph, two outputs and all.
keras.utils.set_random_seed(3)
given = keras.Input((3,), name="x")
hidden = L.Dense(4, name="hidden")(given)
two = keras.Model(given, [L.Dense(1, name="first")(hidden), L.Dense(2, name="second")(hidden)], name="two")
model = PipelineModel.from_config(two.get_config())
model.set_weights(two.get_weights())
assert model.output_names == ["first", "second"], model.output_names
for got, want in zip(model.predict(x, verbose=0), two.predict(x, verbose=0)):
    assert_close(got, want, "from_config predict")
assert PipelineModel.from_config(model.get_config()).output_names == ["first", "second"]
ok("from_config")

# 5. trainable=False at construction: nothing trains, and the layers keep their own flags and config.
model = same_weights_as(reference, trainable=False)
config, before = model.get_config(), model.get_weights()
model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=8, epochs=2, verbose=0)
assert [layer.trainable for layer in model.layers] == [True, True, True]
assert model.get_config() == config and not model.trainable_weights
for got, want in zip(model.get_weights(), before):
    assert np.array_equal(got, want)
ok("frozen")

# 7. Eager calls check the inputs' structure on every rank, and nest in other layers.
keras.utils.set_random_seed(3)
a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
pair = PipelineModel({"a": a, "b": b}, L.Dense(2, name="p2")(L.Dense(4, name="p1")(L.Concatenate()([a, b]))))
raises(ValueError, 'Missing data for input "b"', lambda: pair({"a": x, "c": x}))
raises(ValueError, "expects 2 named input(s)", lambda: pair([x, x, x]))
raises(ValueError, 'Missing data for input "b"', lambda: pair.predict({"a": x}, verbose=0))
model = same_weights_as(reference)
steps = np.stack([x[:8], x[8:]], axis=1)  # (8, 2, 3): two time steps
assert_close(L.TimeDistributed(model)(steps), L.TimeDistributed(reference)(steps), "TimeDistributed")
if SIZE > 1:  # a pipeline inside another pipeline's layer: refused on every rank, saying what to do
    sequence = keras.Input((2, 3))
    raises(
        PipelineConfigError,
        "cannot run inside one stage of another",
        lambda: PipelineModel(sequence, L.TimeDistributed(model)(sequence)),
    )
ok("calls")

# 8. pickle: the whole model, trained and compiled, on every rank; trains on as the original does.
model = same_weights_as(reference, num_microbatches=2)
model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=8, verbose=0)
copy = pickle.loads(pickle.dumps(model))
assert_close(copy.predict(x, verbose=0), model.predict(x, verbose=0), "pickled predict")
after = model.fit(x, y, batch_size=8, verbose=0).history["loss"]
assert_close(copy.fit(x, y, batch_size=8, verbose=0).history["loss"], after, "pickled, trained on")
for got, want in zip(copy.get_weights(), model.get_weights()):
    assert_close(got, want, "pickled weights")
ok("pickle")

# 9. The model handed to from_model says, when used, that the pipeline holds its layers now.
handed_in = graph(keras.Model)
model = PipelineModel.from_model(handed_in)
if SIZE > 1:
    raises(RuntimeError, "use the pipeline from then on", lambda: handed_in.predict(x, verbose=0))
ok("handed in")

# 10. keras.models.clone_model (on every rank): a new pipeline of the same graph and options, with new weights, as Keras
# clones a model of a class of its own; clone_function, input_tensors and call_function are Keras' for its own
# Sequential and Functional classes only (Keras' ValueError, on every rank): clone the Keras model before pipelining it.
model = same_weights_as(reference, num_microbatches=2)
clone = keras.models.clone_model(model)
assert type(clone) is PipelineModel and clone.num_microbatches == 2, (type(clone), clone.num_microbatches)
assert clone.count_params() == model.count_params() and clone is not model
clone.set_weights(reference.get_weights())
assert_close(clone.predict(x, verbose=0), reference.predict(x, verbose=0), "clone_model, predict")
raises(
    ValueError,
    "only supported for Sequential models or Functional models",
    lambda: keras.models.clone_model(model, clone_function=lambda layer: layer),
)
ok("clone_model")

print(f"CONTRACT done rank {RANK} of {SIZE}", flush=True)
sys.exit(0)
