"""After a save was interrupted: plain Keras, one process, opens the previous files. Usage: plain_check.py TMPDIR."""

import sys

import keras
import numpy as np
from common import save_fault_chain

tmp = sys.argv[1]
saved = np.load(f"{tmp}/saved.npy")
model = keras.models.load_model(f"{tmp}/model.keras")
np.testing.assert_array_equal(np.concatenate([w.ravel() for w in model.get_weights()]), saved)
for path in (f"{tmp}/model.weights.h5", f"{tmp}/model.weights.json"):  # (the sharded checkpoint too)
    sequential = keras.Sequential(save_fault_chain())
    sequential.load_weights(path)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in sequential.get_weights()]), saved)
print("PREVIOUS FILES LOAD IN PLAIN KERAS", flush=True)
