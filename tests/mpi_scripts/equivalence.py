"""Pipelined training equals keras.Sequential: losses, metrics, weights, evaluate, predict.

Run as ``mpirun -n P python equivalence.py``; prints one ``EQUIVALENCE OK`` per rank.
"""

import sys

import keras
import numpy as np
from common import RANK, SIZE, assert_close, compile_args, data, layers, split_layers

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
# Four ranks train every configuration; one and three ranks (the suite's time: each configuration
# compiles its programs anew) a subset that together covers each of them once more.
SUBSETS = {1: [1, 3, 4, 7], 3: [0, 2, 5, 6]}
CONFIGURATIONS = [CONFIGURATIONS[i] for i in SUBSETS.get(SIZE, range(len(CONFIGURATIONS)))]

references = {}
for chain in (layers, split_layers):
    keras.utils.set_random_seed(7)
    reference = keras.Sequential(chain())
    initial = reference.get_weights()
    reference.compile(**compile_args())
    history = reference.fit(x, y, sample_weight=sw, **fit_args).history
    references[chain] = (
        initial,
        history,
        reference.get_weights(),
        reference.evaluate(x_test, y_test, verbose=0),
        reference.predict(x_test, verbose=0),
    )

checked = 0
results = {}
for chain, m, schedule, jit in CONFIGURATIONS:
    initial, expected, expected_weights, expected_eval, expected_pred = references[chain]
    model = PipelineModel(chain(), num_microbatches=m, schedule=schedule)
    model.set_weights(initial)
    model.compile(**compile_args(jit_compile=jit))
    history = model.fit(x, y, sample_weight=sw, **fit_args).history
    what = f"P={SIZE} {chain.__name__} m={m} {schedule} jit={jit} split={model.engine.compute.split}"
    assert sorted(history) == sorted(expected), (what, sorted(history), sorted(expected))
    for key in expected:
        assert_close(history[key], expected[key], f"{what} history {key}")
    weights = model.get_weights()
    for i, (a, b) in enumerate(zip(weights, expected_weights)):
        assert_close(a, b, f"{what} weight {i}")
    assert_close(model.evaluate(x_test, y_test, verbose=0), expected_eval, f"{what} evaluate")
    assert_close(model.predict(x_test, verbose=0), expected_pred, f"{what} predict")
    results[(chain, m, schedule, jit)] = weights
    checked += 1
# Where the memory bound makes 1F1B run W over fewer micro-batches at a time
# than GPipe, the two sum their weight gradients in other groups: equal to round-off.
for chain, m, schedule, jit in CONFIGURATIONS:
    if schedule != "gpipe" or (chain, m, "1f1b", jit) not in results:
        continue
    for a, b in zip(results[(chain, m, schedule, jit)], results[(chain, m, "1f1b", jit)]):
        assert_close(a, b, f"{chain.__name__} {schedule} and 1f1b at m={m}")
initial = references[layers][0]

# Ranks other than 0 read their data in another order: labels travel with
# the first stage's micro-batches, so training is unchanged.
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
expected = reference.fit(x, y, sample_weight=sw, batch_size=32, epochs=3, shuffle=False, verbose=0).history
for key in expected:
    assert_close(history[key], expected[key], f"P={SIZE} shuffled other ranks, history {key}")
for i, (a, b) in enumerate(zip(model.get_weights(), reference.get_weights())):
    assert_close(a, b, f"P={SIZE} shuffled other ranks, weight {i}")
checked += 1

# Only the first stage reads x: every other rank's Keras loop gets a
# zero-width stand-in of each array (no copy of the data set, none of a
# batch), validation data included, and predict as well.
seen = []
model.train_step = lambda data, step=model.train_step: seen.append(tuple(data[0].shape)) or step(data)
model.test_step = lambda data, step=model.test_step: seen.append(tuple(data[0].shape)) or step(data)
model.fit(x, y, batch_size=32, epochs=1, validation_data=(x_test, y_test), verbose=0)
width = 0 if model.engine.stage > 0 else x.shape[1]
assert seen and all(shape[1:] == (width,) for shape in seen), (RANK, sorted(set(seen)))
assert model.predict(x_test, verbose=0).shape == (len(x_test), 3)

print(f"EQUIVALENCE OK rank {RANK} of {SIZE}: {checked} configurations", flush=True)
sys.exit(0)
