"""Pipelined training equals keras.Sequential: losses, metrics, weights, evaluate, predict.

Run as ``mpirun -n P python equivalence.py [--extras]``; prints one ``EQUIVALENCE OK`` per rank. The checks
after the configurations (data in another order on other ranks, the update cut by layers, the labels' stand-ins) run
on three ranks, or on any number above one with ``--extras``.
"""

import sys

import keras
import numpy as np
from common import RANK, SIZE, assert_close, compile_args, data, layers, on_rank_0, split_layers, trained_on_rank_0

from keras_pipe import PipelineModel

x, y, sw = data()
x_test, y_test, _ = data(n=57, seed=1)
fit_args = dict(batch_size=32, epochs=3, shuffle=False, validation_split=0.1, verbose=0)
# The recorded backward (layers() has an activity regularizer after an
# activation) and the split backward with one batched W (split_layers()),
# each with XLA programs, and once without (jit_compile=False).
CONFIGURATIONS = [(layers, 1, "1f1b", "auto")] + [(layers, 4, s, "auto") for s in ("1f1b", "gpipe")]
CONFIGURATIONS += [(split_layers, 1, "1f1b", "auto")] + [
    (split_layers, 4, s, "auto") for s in ("1f1b", "gpipe", "zb-h1")
]
CONFIGURATIONS += [(split_layers, 2, "1f1b", False)]
# schedule="auto": its first step times 1F1B, ZB-H1 and (where the chain has 2P layers: three ranks) ZB-V on
# the batch, none of it training, then every rank trains with the one it picked (the same on every rank); the
# fit is the same either way.
CONFIGURATIONS += [(split_layers, 4, "auto", False)]
# Several chunks a rank (4 ranks only; tests/mpi_scripts/chunks.py runs them on 2): interleaved 1F1B
# over 8 virtual stages, and ZB-V with the recorded backward on some chunks
CONFIGURATIONS += [(split_layers, 8, "interleaved-1f1b", False), (layers, 4, "zb-v", False)]
# num_microbatches="auto" (four ranks): its first step times m = P, 2P, 4P (1F1B), then every rank trains with
# the one it picked; the fit equals Sequential's whichever it picked
CONFIGURATIONS += [(split_layers, "auto", "1f1b", False)]
# The suite's time (each configuration compiles its programs anew): four ranks (with --extras, the suite's launch)
# train seven, every schedule, chunked and automatic choice among them; three ranks (the slow tier) a subset on
# stages of unequal size, the rest of the twelve (one micro-batch; the plain chain under GPipe; the split chain under
# 1F1B, which four ranks train plainly and under schedule="auto") among them, and one rank four as a single stage.
# Any other number of ranks (by hand) trains every configuration.
SUBSETS = {1: [1, 3, 4, 7], 3: [0, 2, 4, 5, 6, 8], 4: [1, 5, 6, 8, 9, 10, 11]}
CONFIGURATIONS = [CONFIGURATIONS[i] for i in SUBSETS.get(SIZE, range(len(CONFIGURATIONS)))]


references = {}
for chain in (layers, split_layers):
    keras.utils.set_random_seed(7)
    reference = keras.Sequential(chain())
    initial = reference.get_weights()
    reference.compile(**compile_args())
    trained = trained_on_rank_0(
        reference,
        dict(x=x, y=y, sample_weight=sw, **fit_args),
        evaluate=dict(x=x_test, y=y_test),
        predict=dict(x=x_test),
        key=chain.__name__,  # (the same on every rank count)
    )
    references[chain] = (initial, *(trained[key] for key in ("history", "weights", "evaluate", "predict")))

checked = 0
results = {}
for chain, m, schedule, jit in CONFIGURATIONS:
    initial, expected, expected_weights, expected_eval, expected_pred = references[chain]
    model = PipelineModel(chain(), num_microbatches=m, schedule=schedule)
    model.set_weights(initial)
    model.compile(**compile_args(jit_compile=jit))
    history = model.fit(x, y, sample_weight=sw, **fit_args).history
    what = f"P={SIZE} {chain.__name__} m={m} {schedule} jit={jit} split={model.engine.compute.split}"
    if schedule == "auto":  # (ZB-V's V where the chain has its 2P layers: three ranks, not four)
        expected_candidates = ("1f1b", "zb-h1", "zb-v") if len(chain()) - 1 >= 2 * SIZE else ("1f1b", "zb-h1")
        assert model.engine.picker.schedules() == expected_candidates, (what, model.engine.picker.describe())
    assert sorted(history) == sorted(expected), (what, sorted(history), sorted(expected))
    for key in expected:
        assert_close(history[key], expected[key], f"{what} history {key}")
    weights = model.get_weights()
    for i, (a, b) in enumerate(zip(weights, expected_weights)):
        assert_close(a, b, f"{what} weight {i}")
    assert_close(model.evaluate(x_test, y_test, verbose=0), expected_eval, f"{what} evaluate")
    assert_close(model.predict(x_test, verbose=0), expected_pred, f"{what} predict")
    results[(chain, m, schedule, jit)] = weights
    if schedule == "auto":
        picker = model.engine.picker
        assert picker.picked in ("1f1b", "zb-h1", "zb-v") and picker.steps_left() == 0, (what, picker.describe())
        assert len(set(model.engine.world.allgather_json(picker.picked))) == 1, (what, "ranks picked apart")
        lines = []
        model.summary(print_fn=lines.append)
        assert RANK or any(line.startswith(f"Schedule auto: {picker.picked} (median step") for line in lines), lines
        print(f"rank {RANK}: {what}: {picker.describe()}", flush=True) if RANK == 0 else None
    if m == "auto":
        picker = model.engine.picker
        assert picker.steps_left() == 0 and model.num_microbatches in (SIZE, 2 * SIZE, 4 * SIZE), picker.describe()
        assert picker.picked == f"1f1b m={model.num_microbatches}", (what, picker.describe())
        assert len(set(model.engine.world.allgather_json(picker.picked))) == 1, (what, "ranks picked apart")
        lines = []
        model.summary(print_fn=lines.append)
        assert RANK or lines[0].endswith(f"{model.num_microbatches} (auto) micro-batches, schedule 1f1b"), lines
        assert RANK or any(line.startswith(f"Schedule auto: {picker.picked} (median step") for line in lines), lines
        print(f"rank {RANK}: {what}: {picker.describe()}", flush=True) if RANK == 0 else None
    checked += 1
# Where the memory bound makes 1F1B run W over fewer micro-batches at a time
# than GPipe, the two sum their weight gradients in other groups: equal to round-off.
for chain, m, schedule, jit in CONFIGURATIONS:
    if schedule != "gpipe" or (chain, m, "1f1b", jit) not in results:
        continue
    for a, b in zip(results[(chain, m, schedule, jit)], results[(chain, m, "1f1b", jit)]):
        assert_close(a, b, f"{chain.__name__} {schedule} and 1f1b at m={m}")
initial = references[layers][0]

# The checks below depend on which rank is the first stage and which are not, the same on any number of ranks
# above one: the suite's four ranks run them (--extras; middle stages among them), and three in the slow tier.
EXTRAS = SIZE == 3 or (SIZE > 1 and "--extras" in sys.argv)

# Ranks other than 0 read their data in another order: labels travel with
# the first stage's micro-batches, so training is unchanged. (Not on one
# rank, which has no other rank: there it would repeat the first configuration.)
if EXTRAS:
    order = np.random.default_rng(100 + RANK).permutation(len(x)) if RANK else np.arange(len(x))
    model = PipelineModel(layers(), num_microbatches=4)
    model.set_weights(initial)
    model.compile(**compile_args())
    history = model.fit(
        x[order], y[order], sample_weight=sw[order], batch_size=32, epochs=3, shuffle=False, verbose=0
    ).history
    reference = keras.Sequential(layers())
    reference.set_weights(initial)
    reference.compile(**compile_args())
    expected = trained_on_rank_0(reference, dict(x=x, y=y, sample_weight=sw, batch_size=32, epochs=3, shuffle=False))
    for key in expected["history"]:
        assert_close(history[key], expected["history"][key], f"P={SIZE} shuffled other ranks, history {key}")
    for i, (a, b) in enumerate(zip(model.get_weights(), expected["weights"])):
        assert_close(a, b, f"P={SIZE} shuffled other ranks, weight {i}")
    checked += 1

# A stage's last W and update cut into one program a layer (the real threshold is 64 MiB of weights a
# program, which no model here reaches): every rank's stage trains as its part of Sequential.
if EXTRAS:
    from keras_pipe.stage import update

    update.GROUP_BYTES, bytes_before = 1, update.GROUP_BYTES
    initial, expected, expected_weights, _, _ = references[split_layers]
    model = PipelineModel(split_layers(), num_microbatches=4)
    model.set_weights(initial)
    model.compile(**compile_args())
    history = model.fit(x, y, sample_weight=sw, **fit_args).history
    update.GROUP_BYTES = bytes_before
    programs = [key for key in model.engine.compute._programs if key[0] == "weights_update"]
    weighted = len(model.engine.compute._weighted)
    assert len(programs) == weighted, (RANK, weighted, programs)  # one W and update a weighted layer
    for key in expected:
        assert_close(history[key], expected[key], f"P={SIZE} update cut by layers, history {key}")
    for i, (a, b) in enumerate(zip(model.get_weights(), expected_weights)):
        assert_close(a, b, f"P={SIZE} update cut by layers, weight {i}")
    checked += 1

# Only the first stage reads x and y: every other rank's Keras loop gets a
# zero-size stand-in of each array (no copy of the data set, none of a
# batch), validation data included, and predict as well. The labels keep
# their dtype and shape after the zero, (n, 0, *shape[1:]): each rank builds
# the same loss from them, and the last stage receives the first one's.
# Not with class_weight (Keras weighs the samples by their labels on every
# rank); one-hot labels (float, three numbers a sample) stand in as (n, 0, 3).
# (Not on one rank, where the first stage is the only one.)
onehot, onehot_test = np.eye(3, dtype="float32")[y], np.eye(3, dtype="float32")[y_test]
CASES = [
    ("sparse labels", y, y_test, "sparse_categorical_crossentropy", {}),
    ("class_weight", y, y_test, "sparse_categorical_crossentropy", {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}),
    ("one-hot labels", onehot, onehot_test, "categorical_crossentropy", {}),
]
CASES = CASES if EXTRAS else []


def recording(step, shapes: set):
    """``step``, noting the trailing shapes of each batch's x and y that Keras hands it."""
    return lambda data: shapes.add((tuple(data[0].shape[1:]), tuple(data[1].shape[1:]))) or step(data)


def fitted(model, labels, labels_test, kwargs):
    """History, weights and predictions after two epochs with validation data."""
    history = model.fit(
        x,
        labels,
        batch_size=32,
        epochs=2,
        shuffle=False,
        validation_data=(x_test, labels_test),
        verbose=0,
        **kwargs,
    ).history
    return history, model.get_weights(), model.predict(x_test, verbose=0)


for what, labels, labels_test, loss, kwargs in CASES:
    seen = {"train": set(), "test": set()}
    models = (PipelineModel(layers(), num_microbatches=2), keras.Sequential(layers()))
    for model in models:
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"], jit_compile=False)
    models[0].train_step = recording(models[0].train_step, seen["train"])
    models[0].test_step = recording(models[0].test_step, seen["test"])

    history, weights, predicted = fitted(models[0], labels, labels_test, kwargs)
    expected, expected_weights, expected_pred = on_rank_0(fitted, models[1], labels, labels_test, kwargs)
    for key in expected:
        assert_close(history[key], expected[key], f"P={SIZE} {what}: history {key}")
    for i, (a, b) in enumerate(zip(weights, expected_weights)):
        assert_close(a, b, f"P={SIZE} {what}: weight {i}")
    assert_close(predicted, expected_pred, f"P={SIZE} {what}: predict")
    reads = RANK == 0  # (one replica: world rank 0 is the first stage)
    trailing = labels.shape[1:]
    stood_in = (0, *trailing)
    train_y = trailing if reads or kwargs else stood_in
    wanted = {
        "train": {((12,) if reads else (0,), train_y)},
        "test": {((12,) if reads else (0,), trailing if reads else stood_in)},
    }
    assert seen == wanted, (RANK, what, seen, wanted)
    checked += 1

print(f"EQUIVALENCE OK rank {RANK} of {SIZE}: {checked} configurations", flush=True)
sys.exit(0)
