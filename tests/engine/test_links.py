"""What a stage receives becomes a tensor over the received buffer, without a copy (in one process, no MPI)."""

import numpy as np
import tensorflow as tf
from ml_dtypes import bfloat16

from keras_pipe.engine.links import _tensor
from keras_pipe.mpi.comm import aligned_empty


def test_a_received_array_is_wrapped_not_copied_and_other_dtypes_are_copied():
    for dtype in ("float32", "float16", "int64", "uint8"):
        array = aligned_empty((64, 32), dtype)
        array[:] = 1
        tensor = _tensor(array)
        array[0, 0] = 7  # (nothing writes a received buffer; here it shows the tensor reads it)
        assert tensor.dtype == tf.as_dtype(dtype) and tensor.shape == (64, 32)
        assert int(tensor[0, 0]) == 7 and int(tf.reduce_sum(tf.cast(tensor, tf.int64))) == 64 * 32 - 1 + 7
    for array in (aligned_empty((4, 3), bfloat16), np.ones((4, 3), "float32")[:, :2], aligned_empty((0, 3), "float32")):
        array[...] = 1
        tensor = _tensor(array)  # copied: a dtype DLPack does not carry, a view that is not contiguous, no rows
        np.testing.assert_array_equal(tensor.numpy(), np.asarray(array))
