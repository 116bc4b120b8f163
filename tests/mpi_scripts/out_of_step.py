"""Rank 0 alone raises in an eager call of the model, the script catches it and goes on to ``predict``.

Usage: out_of_step.py before|inside

``before``: rank 0's call is refused by Keras before the pipeline's ``call()``
(an unknown keyword), so rank 1 alone enters it: the two meet in different
collective methods (rank 1 in ``call()``, rank 0 in ``predict()``), and both
must raise the same error at once, naming both places, never wait on or read
each other's messages. ``inside``: a layer of rank 0's stage raises inside the
call (rank 1 waits for its activations): the job must end within seconds,
naming rank 0. Rank 0 prints ``FAILING AT <time.time()>`` as it raises.
"""

import sys
import time

import keras
import numpy as np
import tensorflow as tf
from common import RANK

from keras_pipe import PipelineModel

mode = sys.argv[1]


class FailOnRank0(keras.layers.Layer):
    """Identity, except on rank 0 once ``armed``."""

    armed = False

    def call(self, x):
        def check(batch):
            if mode == "inside" and RANK == 0 and FailOnRank0.armed:
                print(f"FAILING AT {time.time()}", flush=True)
                raise ValueError("a layer failed on rank 0 inside the call")
            return batch

        return tf.numpy_function(check, [x], x.dtype, stateful=True)

    def compute_output_shape(self, shape):
        return shape


model = PipelineModel(
    [keras.Input((4,)), keras.layers.Dense(4), FailOnRank0(), keras.layers.Dense(3), keras.layers.Dense(2)],
    balance=[2, 2],
)
x = np.ones((8, 4), "float32")
print("first call", np.asarray(model(x)).shape, flush=True)
FailOnRank0.armed = True
try:
    if mode == "before" and RANK == 0:
        print(f"FAILING AT {time.time()}", flush=True)
        model(x, not_an_argument=1)
    else:
        model(x)
except Exception as error:
    print(f"rank {RANK} caught {type(error).__name__}: {error}", flush=True)
result = model.predict(x, verbose=0)
print(f"rank {RANK} went on: predict gave {np.shape(result)}", flush=True)
