"""Saving and loading across rank counts. Usage: saving.py TMPDIR save|resume|replicas.

``save`` (4 ranks): 2 epochs, ``model.save``, ``save_weights`` and ``export`` (twice: the second
replaces the first's SavedModel directory), predictions to a file; two sharded checkpoints
(``.weights.json``: one shard a stage, and a shard a variable).
``resume`` (3 ranks: no stage boundary where the 4 stages had theirs): ``keras_pipe.load_model``
+ 1 epoch equals 3 uninterrupted epochs of Sequential; ``load_weights`` restores the saved
weights. The sharded checkpoints of 4 stages load into 3 stages under 1F1B and into 3 ranks of
interleaved 1F1B (6 virtual stages): the same weights, and the next epoch equals the
uninterrupted run's (the optimizer state came too); it saves a sharded checkpoint of its own.
(4 stages to 2: ``graph_saving.py``.)
``replicas`` (4 ranks, 2 stages x 2 replicas): that checkpoint of 3 ranks loads into each
replica, and the next epoch equals 4 uninterrupted epochs; 4 replicas of one stage read it too.
"""

import sys

import keras
import numpy as np
from common import RANK, assert_close, compile_args, data, layers

import keras_pipe
from keras_pipe import PipelineModel

tmp, mode = sys.argv[1], sys.argv[2]
x, y, sw = data()


def reference(epochs):
    keras.utils.set_random_seed(7)
    sequential = keras.Sequential(layers())
    initial = sequential.get_weights()
    sequential.compile(**compile_args())
    sequential.fit(x, y, sample_weight=sw, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return initial, sequential


if mode == "save":
    initial, _ = reference(0)
    model = PipelineModel(layers(), num_microbatches=2)
    model.set_weights(initial)
    model.compile(**compile_args())
    model.fit(x, y, sample_weight=sw, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model.save(f"{tmp}/model.keras")
    model.save_weights(f"{tmp}/model.weights.h5")
    model.save_weights(f"{tmp}/sharded.weights.json")
    model.save_weights(f"{tmp}/small.weights.json", max_shard_size=1e-6)  # (a shard a variable)
    model.export(f"{tmp}/exported", verbose=False)
    model.export(f"{tmp}/exported")  # over the first: the directory is replaced once the new one is complete
    predictions = model.predict(x, verbose=0)
    if RANK == 0:
        np.save(f"{tmp}/predictions.npy", predictions)
    model.summary()
    print(f"SAVED rank {RANK}", flush=True)
elif mode == "replicas":
    model = PipelineModel(layers(), num_stages=2, num_microbatches=2)
    model.compile(**compile_args())
    model.load_weights(f"{tmp}/resharded.weights.json")
    _, sequential = reference(3)
    for a, b in zip(model.get_weights(), sequential.get_weights()):
        assert_close(a, b, "a checkpoint of 3 ranks, read by 2 replicas of 2 stages")
    model.fit(x, y, sample_weight=sw, batch_size=32, epochs=1, shuffle=False, verbose=0)
    _, sequential = reference(4)
    for a, b in zip(model.get_weights(), sequential.get_weights()):
        assert_close(a, b, "the epoch after a sharded checkpoint was read by replicas")
    single = PipelineModel(layers(), num_stages=1, num_microbatches=2)  # four replicas of the whole model
    single.compile(**compile_args())
    single.load_weights(f"{tmp}/resharded.weights.json")
    _, sequential = reference(3)
    for a, b in zip(single.get_weights(), sequential.get_weights()):
        assert_close(a, b, "a checkpoint of 3 ranks, read by 4 replicas of one stage")
    print(f"REPLICAS RESUMED rank {RANK}", flush=True)
else:
    model = keras_pipe.load_model(f"{tmp}/model.keras", num_microbatches=4)
    assert_close(model.predict(x, verbose=0), np.load(f"{tmp}/predictions.npy"), "predictions after loading")
    saved = model.get_weights()
    model.fit(x, y, sample_weight=sw, batch_size=32, epochs=1, shuffle=False, verbose=0)
    _, sequential = reference(3)
    for a, b in zip(model.get_weights(), sequential.get_weights()):
        assert_close(a, b, "weights after resuming on another number of ranks")
    model.load_weights(f"{tmp}/model.weights.h5")
    for a, b in zip(model.get_weights(), saved):
        assert_close(a, b, "load_weights")
    # four stages' checkpoint, read by three stages and by six virtual stages on three ranks
    for name, schedule, m in (("sharded", "1f1b", 4), ("small", "interleaved-1f1b", 6)):
        chunked = PipelineModel(layers(), num_microbatches=m, schedule=schedule)
        chunked.compile(**compile_args())
        chunked.load_weights(f"{tmp}/{name}.weights.json")
        for a, b in zip(chunked.get_weights(), saved):
            assert_close(a, b, f"{name}.weights.json read on another layout")
        chunked.fit(x, y, sample_weight=sw, batch_size=32, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(chunked.get_weights(), sequential.get_weights()):
            assert_close(a, b, f"the epoch after {name}.weights.json was read on another layout")
    chunked.save_weights(f"{tmp}/resharded.weights.json")
    print(f"RESUMED rank {RANK}", flush=True)
