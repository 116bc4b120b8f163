"""BackupAndRestore: a run killed mid-epoch, started again, ends as an uninterrupted run.

Usage: backup.py TMPDIR crash|kill-in-backup|resume.

``crash``: rank 1 raises in epoch 2. ``kill-in-backup``: the rank writing the
second Dense's weights is killed (SIGKILL) in the middle of writing its shard of
the backup at the end of epoch 2; the last good backup (end of epoch 1) is
kept, so ``resume`` still ends as an uninterrupted run. The backup is a sharded
checkpoint (``latest.weights.json``), which ``resume`` may read on another
number of ranks.
"""

import sys

import keras
from common import RANK, SaveFault, assert_close, compile_args, data, layers

from keras_pipe import PipelineModel

tmp, mode = sys.argv[1], sys.argv[2]
x, y, sw = data(n=203)


class Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if mode == "kill-in-backup" and epoch == 2:
            SaveFault.armed = "kill"  # the backup written at the end of this epoch, on the rank that writes it

    def on_train_batch_end(self, batch, logs=None):
        if mode == "crash" and self.epoch == 2 and batch == 3 and RANK == 1:
            raise RuntimeError("simulated crash on rank 1")


def chain():
    """``layers()`` with a second Dense that can fail while its weights are written (the same math)."""
    items = layers()
    items[2] = SaveFault(16, activation="tanh")
    return items


keras.utils.set_random_seed(5)
reference = keras.Sequential(chain())
initial = reference.get_weights()
model = PipelineModel(chain(), num_microbatches=2)
model.set_weights(initial)
model.compile(**compile_args())
backup = keras.callbacks.BackupAndRestore(f"{tmp}/backup")
model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[backup, Crash()])

reference.compile(**compile_args())
reference.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
for a, b in zip(model.get_weights(), reference.get_weights()):
    assert_close(a, b, "weights after resuming")
print(f"RESUMED OK rank {RANK}", flush=True)
