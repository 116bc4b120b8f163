"""Rank 2 of 4 stops answering mid-training: hangs (``hang``) or is killed (``kill``).

``hang-replicas`` trains 2 stages x 2 replicas, so rank 2 is stage 0 of the
second replica, and the first replica's stage 0 waits in the gradient all-reduce.

The others must end within the stall timeout plus a few seconds, reporting
what every rank was last doing; rank 2 prints ``STALLING AT <time.time()>``
as it stops, for the tests to measure from.

A first fit of two batches traces every rank's programs under the default
stall timeout; only then is it cut to 15 s. So the tests run beside others:
on loaded cores a neighbour's first step (tracing, XLA) can take longer than
15 s, a step after it a fraction of a second.
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
# From the second fit on (the first traced every program): steps of this model take milliseconds, a fraction
# of a second on loaded cores.
STALL_TIMEOUT = 15
x, y, _ = data(n=640)
armed = False  # (the warm-up fit neither stops nor hangs)


def tighten_stall_timeout(seconds):
    """Every communicator keras_pipe made (the model's, the agreement's) waits ``seconds`` from now on.

    The public ``stall_timeout`` is fixed when the model is made; this test's
    shortcut cuts it after the warm-up, which a user would do by choosing it
    above their first step's tracing and compiling.
    """
    from keras_pipe.mpi import comm

    for communicator in list(comm._OPEN):
        communicator.stall_timeout = seconds


class Stop(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if armed and RANK == 2 and batch == 5 and mode != "hang-replicas":
            print(f"STALLING AT {time.time()}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)


class HangOnRank2(keras.layers.Layer):
    """Passes its input through; on rank 2, from its 10th call on, hangs inside the compiled forward."""

    calls = 0

    def call(self, x):
        def maybe_hang(x):
            HangOnRank2.calls += armed
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
    model = PipelineModel(chain, num_microbatches=2, num_stages=2)
else:
    model = PipelineModel(layers(), num_microbatches=2)
model.compile(**compile_args())
model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0, callbacks=[Stop()])  # the warm-up
tighten_stall_timeout(STALL_TIMEOUT)
armed = True
model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Stop()])
print(f"rank {RANK} finished without noticing", flush=True)
