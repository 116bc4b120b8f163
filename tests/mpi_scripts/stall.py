"""Rank 2 of 4 stops answering mid-training: hangs (``hang``) or is killed (``kill``).

``hang-replicas`` trains 2 stages x 2 replicas, so rank 2 is stage 0 of the
second replica, and the first replica's stage 0 waits in the gradient all-reduce.

The others must end within the stall timeout plus a few seconds, reporting
what every rank was last doing; rank 2 prints ``STALLING AT <time.time()>``
as it stops, for the tests to measure from.
"""

import os
import signal
import sys
import time

import keras
import tensorflow as tf
from common import RANK, compile_args, data, layers

from keras_pipe import PipelineModel

mode = sys.argv[1]
# Long enough for a neighbour's first step (tracing, XLA) on four ranks sharing two loaded cores:
# at 5 s the timeout fired there, before rank 2 stopped.
STALL_TIMEOUT = 15
x, y, _ = data(n=640)


class Stop(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if RANK == 2 and batch == 5 and mode != "hang-replicas":
            print(f"STALLING AT {time.time()}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)


class HangOnRank2(keras.layers.Layer):
    """Passes its input through; on rank 2, from its 10th call on, hangs inside the compiled forward."""

    calls = 0

    def call(self, x):
        def maybe_hang(x):
            HangOnRank2.calls += 1
            if RANK == 2 and HangOnRank2.calls >= 10:
                print(f"STALLING AT {time.time()}", flush=True)
                time.sleep(3600)
            return x

        y = tf.stop_gradient(tf.py_function(maybe_hang, [x], x.dtype))  # the input needs no gradient
        y.set_shape(x.shape)
        return y

    def compute_output_shape(self, input_shape):
        return input_shape


if mode == "hang-replicas":
    # Stage 0 of the second replica hangs in its forward pass: the first
    # replica's stage 0 then waits for it in the gradient all-reduce.
    chain = layers()
    chain.insert(1, HangOnRank2())
    model = PipelineModel(chain, num_microbatches=2, stall_timeout=STALL_TIMEOUT, num_stages=2)
else:
    model = PipelineModel(layers(), num_microbatches=2, stall_timeout=STALL_TIMEOUT)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Stop()])
print(f"rank {RANK} finished without noticing", flush=True)
