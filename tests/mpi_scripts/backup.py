"""BackupAndRestore: a run killed mid-epoch, started again, ends as an uninterrupted run.

Usage: backup.py TMPDIR crash|resume.
"""

import sys

import keras
from common import RANK, assert_close, compile_args, data, layers

from keras_pipe import PipelineModel

tmp, mode = sys.argv[1], sys.argv[2]
x, y, sw = data(n=203)


class Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if mode == "crash" and self.epoch == 2 and batch == 3 and RANK == 1:
            raise RuntimeError("simulated crash on rank 1")


keras.utils.set_random_seed(5)
reference = keras.Sequential(layers())
initial = reference.get_weights()
model = PipelineModel(layers(), num_microbatches=2)
model.set_weights(initial)
model.compile(**compile_args())
backup = keras.callbacks.BackupAndRestore(f"{tmp}/backup")
model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[backup, Crash()])

reference.compile(**compile_args())
reference.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
for a, b in zip(model.get_weights(), reference.get_weights()):
    assert_close(a, b, "weights after resuming")
print(f"RESUMED OK rank {RANK}", flush=True)
