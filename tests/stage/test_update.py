"""The update cut into programs by weight groups: which optimizers allow it, how a stage is cut, the same training.

In one process (one rank), no MPI. The real threshold (``GROUP_BYTES``, 64 MiB of
weights a program) is lowered here so that a small model is cut into one program
per layer; ``benchmarks/memory.py`` measures what it saves on a large one.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from keras_pipe import PipelineModel  # noqa: E402
from keras_pipe.stage import update  # noqa: E402


@pytest.mark.parametrize(
    "optimizer, expected",
    [
        (keras.optimizers.Adam(), True),
        (keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=1.0), True),  # clipnorm: each gradient alone
        (keras.optimizers.AdamW(weight_decay=0.01), True),
        (keras.optimizers.RMSprop(clipvalue=0.5), True),
        (keras.optimizers.Nadam(), False),  # its u_product moves once a step
        (keras.optimizers.Adam(global_clipnorm=1.0), False),
        (keras.optimizers.Adam(use_ema=True), False),
        (keras.optimizers.Adam(gradient_accumulation_steps=2), False),
        (keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), False),  # every gradient finite first
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, bool) else str(value),
)
def test_which_optimizers_update_each_variable_alone(optimizer, expected):
    assert update.separable(optimizer) is expected


def _chain():
    return [
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8, activity_regularizer=keras.regularizers.L1(1e-3)),
        keras.layers.Dense(3, activation="softmax", bias_regularizer=keras.regularizers.L1(0.01)),
    ]


def _fit(model, optimizer):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype("float32")
    y = rng.integers(0, 3, size=48)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history


@pytest.mark.parametrize("optimizer", ["adam", "nadam"])
def test_an_update_cut_by_layers_trains_as_sequential(monkeypatch, optimizer):
    keras.utils.set_random_seed(3)
    reference = keras.Sequential(_chain())
    initial = reference.get_weights()
    expected = _fit(reference, keras.optimizers.get(optimizer))
    monkeypatch.setattr(update, "GROUP_BYTES", 1)  # every layer its own program
    model = PipelineModel(_chain(), num_microbatches=4)
    model.set_weights(initial)
    history = _fit(model, keras.optimizers.get(optimizer))
    compute = model.engine.compute
    updates = [key for key in compute._programs if key[0] == "weights_update"]
    assert len(updates) == (4 if optimizer == "adam" else 1), updates  # Nadam keeps the one program
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 6
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_steps_that_share_a_weight_stay_in_one_group(monkeypatch):
    monkeypatch.setattr(update, "GROUP_BYTES", 1)
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    h = shared(keras.layers.Dense(4, name="first")(inputs))
    h = keras.layers.Dense(4, name="middle")(h)
    outputs = keras.layers.Dense(2, name="last")(shared(h))  # `shared` twice, around `middle`
    model = PipelineModel.from_model(keras.Model(inputs, outputs))
    compute = model.engine.compute
    groups = update._grouped(compute._weighted, compute.steps, compute.trainable_variables)
    assert sorted(i for _, indices in groups for i in indices) == list(range(len(compute.trainable_variables)))
    names = [sorted({compute.trainable_variables[i].path.split("/")[0] for i in indices}) for _, indices in groups]
    assert names == [["first"], ["middle", "shared"], ["last"]], names


def test_a_cut_closes_groups_of_the_least_size_where_allowed():
    big = update.GROUP_BYTES
    assert update._cut([big, 1, big, 1], [True, False, True, True]) == [[0], [1, 2, 3]]  # a small rest joins
    assert update._cut([big, big, big], [False, True, True]) == [[0, 1], [2]]  # not before a shared weight's last use
    assert update._cut([1, 1], [True, True]) == [[0, 1]]
