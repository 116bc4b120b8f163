"""Replicas of a pipeline train as one keras.Sequential on the global batch.

Run as ``mpirun -n W python replicas.py [M ...]``: for every ``num_stages`` that
divides ``W`` and leaves at least two replicas and every micro-batch count ``M``
(default 1 and 3), training (with sample
weights, regularizers, a validation split and a final batch smaller than the
number of replicas), evaluate and predict equal single-process Sequential;
then saving, loading with another layout, shuffling, the replicas'
batch check and the layout shown by ``summary()``. Prints one
``REPLICAS OK`` per rank.
"""

import json
import os
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf
from common import RANK, SIZE, assert_close, compile_args, data, layers, split_layers, trained_on_rank_0
from mpi4py import MPI

import keras_pipe
from keras_pipe import PipelineModel, RankMismatchError

x, y, sw = data(n=203)
x_test, y_test, _ = data(n=57, seed=1)
# 203 samples, 10% for validation: 182 to train = 5 x 32 + 22; and 33 = 32 + 1,
# a last batch of one sample, so some replicas get no share of it.
fit_args = dict(batch_size=32, epochs=2, shuffle=False, validation_split=0.1, verbose=0)

keras.utils.set_random_seed(7)
reference = keras.Sequential(layers())
initial = reference.get_weights()


def sequential_run(x_fit, y_fit, sw_fit, evaluate=None, predict=None, **overrides):
    """Sequential from ``initial``, trained on rank 0 (every rank builds it): see ``common.trained_on_rank_0``."""
    model = keras.Sequential(layers())
    model.set_weights(initial)
    model.compile(**compile_args())
    fit = dict(x=x_fit, y=y_fit, sample_weight=sw_fit, **{**fit_args, **overrides})
    return trained_on_rank_0(model, fit, evaluate, predict)


trained = sequential_run(x, y, sw, evaluate=dict(x=x_test, y=y_test), predict=dict(x=x_test))
expected, expected_weights, expected_eval, expected_pred = (
    trained[key] for key in ("history", "weights", "evaluate", "predict")
)
tiny_trained = sequential_run(x[:33], y[:33], sw[:33], predict=dict(x=x_test[:3], batch_size=2), validation_split=0.0)
tiny_expected, tiny_pred = tiny_trained["history"], tiny_trained["predict"]


def check_same_across_replicas(model, what):
    """Every replica of a stage holds bit-identical weights."""
    local = np.concatenate([np.ravel(w.numpy()) for layer in model.stage_layers for w in layer.weights])
    everyone = MPI.COMM_WORLD.allgather((model.stage_index, local))
    for stage, weights in everyone:
        if stage == model.stage_index:
            assert np.array_equal(weights, local), f"rank {RANK}: {what}: replicas of stage {stage} differ"


checked = 0
MICROBATCH_COUNTS = [int(m) for m in sys.argv[1:]] or [1, 3]
# (REPLICA_STAGES=2: only that layout trained, as the launch over TCP does; the checks after the loop run on the last)
STAGES = [int(s) for s in os.environ.get("REPLICA_STAGES", "").split(",") if s]
for num_stages in [s for s in range(1, SIZE + 1) if SIZE % s == 0 and SIZE // s > 1 and (not STAGES or s in STAGES)]:
    for m in MICROBATCH_COUNTS:
        what = f"{num_stages} stages x {SIZE // num_stages} replicas, m={m}"
        model = PipelineModel(layers(), num_stages=num_stages, num_microbatches=m)
        assert (model.num_stages, model.num_replicas) == (num_stages, SIZE // num_stages), what
        model.set_weights(initial)
        model.compile(**compile_args())
        history = model.fit(x, y, sample_weight=sw, **fit_args).history
        assert sorted(history) == sorted(expected), (what, sorted(history), sorted(expected))
        for key in expected:
            assert_close(history[key], expected[key], f"{what} history {key}")
        for i, (a, b) in enumerate(zip(model.get_weights(), expected_weights)):
            assert_close(a, b, f"{what} weight {i}")
        check_same_across_replicas(model, what)
        assert_close(model.evaluate(x_test, y_test, verbose=0), expected_eval, f"{what} evaluate")
        assert_close(model.predict(x_test, verbose=0), expected_pred, f"{what} predict")

        # A last batch of one sample: the replicas without a share contribute zeros.
        tiny = PipelineModel(layers(), num_stages=num_stages, num_microbatches=m)
        tiny.set_weights(initial)
        tiny.compile(**compile_args())
        history = tiny.fit(x[:33], y[:33], sample_weight=sw[:33], **{**fit_args, "validation_split": 0.0}).history
        for key in tiny_expected:
            assert_close(history[key], tiny_expected[key], f"{what} one-sample batch, history {key}")
        assert_close(tiny.predict(x_test[:3], batch_size=2, verbose=0), tiny_pred, f"{what} predict in pairs")
        checked += 1

# The split backward (I + one batched W, whose gradients the replicas sum
# before the update) with XLA programs, on the layout with the most stages.
keras.utils.set_random_seed(8)
split_reference = keras.Sequential(split_layers())
split_initial = split_reference.get_weights()
split_reference.compile(**compile_args())
split_trained = trained_on_rank_0(split_reference, dict(x=x, y=y, sample_weight=sw, **fit_args))
split_expected, split_weights = split_trained["history"], split_trained["weights"]
stages = max(s for s in range(1, SIZE + 1) if SIZE % s == 0 and SIZE // s > 1)
model = PipelineModel(split_layers(), num_stages=stages, num_microbatches=3)
model.set_weights(split_initial)
model.compile(**compile_args(jit_compile="auto"))
history = model.fit(x, y, sample_weight=sw, **fit_args).history
assert model.engine.compute.split
for key in split_expected:
    assert_close(history[key], split_expected[key], f"split backward, {stages} stages, history {key}")
for i, (a, b) in enumerate(zip(model.get_weights(), split_weights)):
    assert_close(a, b, f"split backward weight {i}")
check_same_across_replicas(model, "split backward")
checked += 1

# Saving from 2 stages x replicas, loading as 1 stage x SIZE replicas, one more epoch.
num_stages = 2 if SIZE % 2 == 0 and SIZE > 2 else 1
model = PipelineModel(layers(), num_stages=num_stages, num_microbatches=2)
model.set_weights(initial)
model.compile(**compile_args())
model.fit(x, y, sample_weight=sw, **fit_args)
directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if RANK == 0 else None)
path = os.path.join(directory, "replicas.keras")
model.save(path)
if RANK == 0:
    plain = keras.models.load_model(path)
    assert_close(plain.predict(x_test, verbose=0), expected_pred, "plain Keras loads the saved replicas")
loaded = keras_pipe.load_model(path, num_stages=1, num_microbatches=2)
assert loaded.num_replicas == SIZE
assert_close(loaded.predict(x_test, verbose=0), expected_pred, "loaded on another layout: predict")
history = loaded.fit(x, y, sample_weight=sw, **{**fit_args, "epochs": 1}).history
expected3 = sequential_run(x, y, sw, epochs=3)["history"]
for key in expected3:
    assert_close(history[key][-1], expected3[key][-1], f"save, load on {SIZE} replicas, 3rd epoch: {key}")
check_same_across_replicas(loaded, "after loading")
checked += 1

# shuffle=True with no global seed: fit seeds TensorFlow alike on every rank,
# so the replicas still read one global batch and stay identical.
tf.random.set_seed(None)
model = PipelineModel(layers(), num_stages=1, num_microbatches=2)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
check_same_across_replicas(model, "shuffle=True without a seed")
checked += 1

# Replicas given differently ordered data: an error on every rank, not silent training.
order = np.random.default_rng(100 + RANK).permutation(len(x)) if RANK else np.arange(len(x))
model = PipelineModel(layers(), num_stages=1, num_microbatches=2)
model.compile(**compile_args())
try:
    model.fit(x[order], y[order], batch_size=32, epochs=1, shuffle=False, verbose=0)
    raise AssertionError(f"rank {RANK}: replicas with different data trained without an error")
except RankMismatchError as error:
    assert "the replicas read different batches at train step 0" in str(error), str(error)
checked += 1

# summary() shows which rank is which stage of which replica.
lines = []
model = PipelineModel(layers(), num_stages=num_stages)
model.build()
model.summary(print_fn=lines.append)
if "EXPECT_PIPELINES" in os.environ:  # launched with a host per rank: placement follows the hosts
    assert model.engine.layout.pipelines == json.loads(os.environ["EXPECT_PIPELINES"]), model.engine.layout.pipelines
if RANK == 0:
    text = "\n".join(lines)
    assert f"{num_stages} stages x {SIZE // num_stages} replicas" in text, text
    assert f"replica {SIZE // num_stages - 1}: stage 0: rank" in text, text
    print(text, flush=True)

# balance="time": every rank computes the same split from every replica's timings.
model = PipelineModel(layers(), num_stages=num_stages, balance="time")
model.build()
balances = MPI.COMM_WORLD.allgather([int(n) for n in model.balance])
assert all(b == balances[0] for b in balances), balances

print(f"REPLICAS OK rank {RANK} of {SIZE}: {checked} configurations", flush=True)
sys.exit(0)
