"""Sharded checkpoints and the whole-model routes in one process: the optimizer's order, the memory check."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from keras_pipe import PipelineIOError, PipelineModel, compat  # noqa: E402

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam_amsgrad": lambda: keras.optimizers.Adam(amsgrad=True),
    "adamw_ema": lambda: keras.optimizers.AdamW(use_ema=True),
    "adam_accumulation": lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(momentum=0.5, centered=True),
    "adadelta": lambda: keras.optimizers.Adadelta(),
    "adagrad": lambda: keras.optimizers.Adagrad(),
    "adamax": lambda: keras.optimizers.Adamax(),
    "nadam": lambda: keras.optimizers.Nadam(),
    "ftrl": lambda: keras.optimizers.Ftrl(),
    "adafactor": lambda: keras.optimizers.Adafactor(),
    "lion": lambda: keras.optimizers.Lion(),
    "lamb": lambda: keras.optimizers.Lamb(),
    "muon": lambda: keras.optimizers.Muon(),
    "loss_scale_adam": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
}


def _model():
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(11, 4, name="token_embedding"),
            keras.layers.Dense(6),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_unsplit_optimizer_order_is_read_from_its_own_build(name):
    """optimizer_layout on every weight is the real optimizer's list, variable by variable (shapes), and on a
    stage's weights the part of it those weights own, in the same order: so a stage's slots have a position."""
    model = _model()
    optimizer = OPTIMIZERS[name]()
    optimizer.build(model.trainable_variables)
    weights = [(i, v.path, v.shape, v.dtype) for i, v in enumerate(model.trainable_variables)]
    whole = compat.optimizer_layout(optimizer, weights)
    assert [tuple(shape) for _, shape in whole] == [tuple(v.shape) for v in optimizer.variables], name
    for part in (weights[:2], weights[2:], weights[1:3]):
        indices = {index for index, _, _, _ in part}
        stage = compat.optimizer_layout(optimizer, part)
        expected = [(key, shape) for key, shape in whole if key[0] == "own" or key[0] in indices]
        assert stage == expected, (name, indices)


def test_a_route_that_builds_the_whole_model_is_refused_where_rank_0_lacks_the_memory():
    model = PipelineModel.from_sequential(_model())
    model.compile(optimizer="adam", loss="mse")
    model.build()
    with pytest.raises(PipelineIOError, match=r"to_keras\(\) builds the whole model on rank 0.*ck\.weights\.json"):
        model._saver.check_whole_fits("to_keras()", available=1000)
    model._saver.check_whole_fits("to_keras()", available=10**12)


def test_one_process_writes_the_sharded_layout_plain_keras_reads(tmp_path):
    keras.utils.set_random_seed(1)
    plain = _model()
    plain.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).integers(0, 11, size=(16, 5)).astype("int32")
    y = np.random.default_rng(1).integers(0, 3, size=16)
    model = PipelineModel.from_sequential(plain)
    model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, verbose=0)
    model.save_weights(str(tmp_path / "ck.weights.json"), max_shard_size=1e-6)
    index = json.loads((tmp_path / "ck.weights.json").read_text())
    assert index["metadata"]["keras_pipe"]["stages"] == 1
    assert (tmp_path / "ck_00000.weights.h5").exists()
    other = _model()
    other.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy")
    other.optimizer.build(other.trainable_variables)
    other.load_weights(str(tmp_path / "ck.weights.json"))
    for a, b in zip(other.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(other.optimizer.iterations.numpy()) == 2
    # a second save replaces the first's shards once its index is in place
    first = {p.name for p in tmp_path.glob("ck_stage*")}
    model.save_weights(str(tmp_path / "ck.weights.json"), max_shard_size=1e-6)
    assert not first & {p.name for p in tmp_path.glob("ck_stage*")}


@pytest.mark.parametrize("name", ["adafactor", "adam_amsgrad", "adamw_ema", "muon"])
def test_to_keras_gives_each_slot_its_own_weights_state(name):
    """``to_keras()`` places the optimizer's state by its build's order, not by the slots' names: Adafactor names
    its factors after the weight's name (``kernel``), which every Dense shares (they were swapped before)."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,)), *[keras.layers.Dense(8) for _ in range(3)], keras.layers.Dense(3)]
    model = PipelineModel(layers, num_microbatches=1)
    model.compile(optimizer=OPTIMIZERS[name](), loss="mse", jit_compile=False)
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    model.fit(x, x[:, :3], batch_size=16, epochs=2, verbose=0)
    whole = model.to_keras()
    mine, theirs = model.optimizer.variables, whole.optimizer.variables
    assert len(mine) == len(theirs)
    for position, (a, b) in enumerate(zip(mine, theirs)):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{name}: optimizer variable {position} {a.path}")
