"""PipelineModel in one process (one rank): building, summary, warnings, weights."""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from keras_pipe import PipelineConfigError, PipelineModel  # noqa: E402


def test_batch_normalization_with_microbatches_warns():
    with pytest.warns(UserWarning, match="per micro-batch"):
        PipelineModel([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()], num_microbatches=2)


def test_batch_normalization_inside_a_composite_layer_warns_too():
    # (keras_hub's CNN blocks hold theirs inside their own layers: ResNet, DenseNet, EfficientNet... differed silently)
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense, self.norm = keras.layers.Dense(3), keras.layers.BatchNormalization(name="inner_norm")

        def call(self, x):
            return self.norm(self.dense(x))

    with pytest.warns(UserWarning, match=r"1 BatchNormalization layers \(inner_norm\)"):
        PipelineModel([keras.Input((4,)), keras.layers.Dense(3), Block()], num_microbatches=2)


def test_frozen_batch_normalization_with_microbatches_does_not_warn():
    # trainable=False normalises with the moving statistics (inference mode): nothing differs
    frozen = keras.layers.BatchNormalization()
    frozen.trainable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PipelineModel([keras.Input((4,)), keras.layers.Dense(3), frozen], num_microbatches=2)


def test_from_sequential_keeps_the_weights_and_layers():
    sequential = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model = PipelineModel.from_sequential(sequential, num_microbatches=3)
    assert [type(layer).__name__ for layer in model.layers] == ["Dense", "Dense"]
    for a, b in zip(model.get_weights(), sequential.get_weights()):
        np.testing.assert_array_equal(a, b)
    x = np.random.default_rng(0).normal(size=(7, 5)).astype("float32")
    # micro-batches of 3 make other matrix products than one of 7: equal to float32 round-off,
    # which near zero is absolute (CI saw 1e-8 on a value of 0.0036)
    np.testing.assert_allclose(model.predict(x, verbose=0), sequential.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_set_weights_checks_shapes():
    model = PipelineModel([keras.Input((5,)), keras.layers.Dense(4)])
    with pytest.raises(
        PipelineConfigError, match=r"weight 0 \(.*dense.*/kernel\) has shape \(4, 5\), expected \(5, 4\)"
    ):
        model.set_weights([np.zeros((4, 5)), np.zeros(4)])


@pytest.mark.parametrize("graph", [False, True])
def test_layers_cannot_be_assigned_in_keras_words(graph):
    # a graph's as keras.Model's, a chain's as Sequential's: what code written for Keras (and Keras' own tests) matches
    inputs = keras.Input((3,))
    model = PipelineModel(inputs, keras.layers.Dense(2)(inputs)) if graph else PipelineModel([keras.layers.Dense(2)])
    words = "`Model.layers` attribute is reserved" if graph else r"Use `add\(\)` and `pop\(\)`"
    with pytest.raises(AttributeError, match=words):
        model.layers = [keras.layers.Dense(4)]


def test_predict_step_checks_the_input_shapes_before_it_counts_the_batch():
    # (an eager call on several ranks runs predict_step: a scalar is Keras' shape error, not an IndexError)
    inputs = keras.Input((3,), name="foo")
    model = PipelineModel(inputs, keras.layers.Dense(2)(inputs))
    model.build()  # (an unbuilt model builds from the first batch's size first)
    with pytest.raises(ValueError, match="name 'foo' and path ''"):
        model.predict_step((np.zeros(()),))
