"""Saving and loading across rank counts. Usage: saving.py TMPDIR save|resume.

``save`` (4 ranks): 2 epochs, ``model.save``, ``save_weights`` and ``export`` (twice: the second
replaces the first's SavedModel directory), predictions to a file.
``resume`` (2 ranks): ``keras_pipe.load_model`` + 1 epoch equals 3 uninterrupted
epochs of Sequential; ``load_weights`` restores the saved weights.
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
    model.export(f"{tmp}/exported", verbose=False)
    model.export(f"{tmp}/exported")  # over the first: the directory is replaced once the new one is complete
    predictions = model.predict(x, verbose=0)
    if RANK == 0:
        np.save(f"{tmp}/predictions.npy", predictions)
    model.summary()
    print(f"SAVED rank {RANK}", flush=True)
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
    print(f"RESUMED rank {RANK}", flush=True)
