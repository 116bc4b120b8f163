"""Rank 2 of 4 stops answering mid-training: hangs (``hang``) or is killed (``kill``).

The others must end within the stall timeout plus a few seconds, reporting
what every rank was last doing.
"""

import os
import signal
import sys
import time

import keras
from common import RANK, compile_args, data, layers

from keras_pipe import PipelineModel

mode = sys.argv[1]
x, y, _ = data(n=640)


class Stop(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if RANK == 2 and batch == 5:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)


model = PipelineModel(layers(), num_microbatches=2, stall_timeout=5)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Stop()])
print(f"rank {RANK} finished without noticing", flush=True)
