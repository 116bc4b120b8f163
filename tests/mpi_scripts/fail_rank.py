"""One rank raises in the middle of an epoch; every rank must end, non-zero, quickly.

Usage: fail_rank.py FAILING_RANK WHERE, with WHERE one of ``callback`` (a
callback raises), ``layer`` (a layer raises inside the compiled step),
``data`` (the data generator raises on the first stage, the only one that calls it), ``label`` (a label outside the
classes, which the last stage finds under XLA) or ``validation`` (every rank is
given validation data of the wrong shape). The failing rank prints ``FAILING AT
<time.time()>`` as it raises (``label``, ``validation``: as its ``fit`` begins),
for the tests to measure from.
"""

import sys
import time

import keras
import tensorflow as tf
from common import RANK, SIZE, compile_args, data, layers

from keras_pipe import PipelineModel

failing_rank, where = int(sys.argv[1]), sys.argv[2]
x, y, sw = data(n=640)


def failing():
    print(f"FAILING AT {time.time()}", flush=True)


class Boom(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if RANK == failing_rank and self.params and batch == 5 and self._epoch == 1:
            failing()
            raise RuntimeError(f"boom from a callback on rank {RANK}")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


class FailingLayer(keras.layers.Layer):
    """Identity that fails once it has seen enough samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0

    def call(self, x):
        def check(batch):
            self.seen += len(batch)
            if where == "layer" and RANK == failing_rank and self.seen > 400:
                failing()
                raise ValueError(f"a layer failed on rank {RANK}")
            return batch

        return tf.numpy_function(check, [x], x.dtype, stateful=True)

    def compute_output_shape(self, shape):
        return shape


chain = layers()
chain.insert(-1, FailingLayer(name="failing"))  # layer 5 of 7: on rank 2 with this balance
model = PipelineModel(chain, num_microbatches=2, balance=[2, 2, 2, 1])
model.compile(**compile_args())

if where == "data":

    def batches():
        for step in range(1000):
            if RANK == failing_rank and step == 7:
                failing()
                raise OSError(f"the data reader failed on rank {RANK}")
            yield x[:32], y[:32]

    model.fit(batches(), steps_per_epoch=20, epochs=3, verbose=0)
elif where == "label":
    # a label of 3 for 3 classes: XLA would give NaN silently, TensorFlow's own kernel refuses it
    bad = y.copy()
    bad[100] = 3
    model.compile(**dict(compile_args(), jit_compile=True))
    if RANK == SIZE - 1:  # (the last stage computes the loss)
        failing()
    model.fit(x, bad, batch_size=32, epochs=1, verbose=0)
elif where == "validation":
    # 12 features as (-1, 4, 3): only the first stage reads x, so only it can find out
    bad = (x[:64].reshape((-1, 4, 3)), y[:64])
    if RANK == 0:
        failing()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, validation_data=bad)
else:
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Boom()] if where == "callback" else [])
print(f"rank {RANK} finished without noticing the failure", flush=True)
