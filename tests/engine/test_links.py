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


def test_a_chunk_hands_its_tensors_to_a_chunk_of_its_own_rank_without_a_message():
    """ZB-V's turn (virtual stages 1 -> 2 on rank 1): the tensor itself, in order; other stages still get messages."""
    from types import SimpleNamespace

    import pytest

    from keras_pipe.engine.chunks import ChunkComm, Mailbox
    from keras_pipe.engine.links import Links
    from keras_pipe.errors import RankMismatchError

    class Comm:  # the pipeline's communicator: what went through MPI
        world_rank, size = 1, 2

        def __init__(self):
            self.sent = []

        def world_rank_of(self, rank):
            return rank

        def send(self, array, dest, tag):
            self.sent.append((dest, tag, np.array(array)))

    spec = SimpleNamespace(shape=(None, 4), dtype="float32", dynamic=False)
    out = SimpleNamespace(tensor=0, destinations=[2], gradient=True)
    into = SimpleNamespace(tensor=0, source=1, gradient=True)
    back = SimpleNamespace(tensor=1, destinations=[0], gradient=True)
    comm, mailbox, ranks = Comm(), Mailbox(), [0, 1, 1, 0]  # (the V of two ranks)
    first = Links(ChunkComm(comm, ranks, 1, mailbox), SimpleNamespace(sends=[out], receives=[]), [spec, spec])
    second = Links(ChunkComm(comm, ranks, 2, mailbox), SimpleNamespace(sends=[back], receives=[into]), [spec, spec])
    with pytest.raises(RuntimeError, match="before it was sent"):
        second.receive_activations(3)
    sent = [tf.fill((3, 4), float(k)) for k in range(2)]
    for tensor in sent:
        first.send_activations([tensor])
    assert comm.sent == [] and len(mailbox) == 2
    received = [second.receive_activations(3)[0] for _ in sent]
    assert all(a is b for a, b in zip(received, sent)) and len(mailbox) == 0  # (in order, not copied)
    second.send_activations([tf.ones((3, 4))])  # (to virtual stage 3, on rank 0: a message)
    assert [(dest, array.shape) for dest, _, array in comm.sent] == [(0, (3, 4))]
    first.send_activations([tf.ones((2, 4))])
    with pytest.raises(RankMismatchError, match="expected a micro-batch of 3 samples from virtual stage 1"):
        second.receive_activations(3)
    first.send_activations([tf.ones((3, 4), tf.float16)])
    with pytest.raises(RankMismatchError, match="expected float32 from virtual stage 1"):
        second.receive_activations(3)
    second.send_gradients([tf.ones((3, 4))])  # (the gradient goes back to virtual stage 1: handed over too)
    assert first.receive_gradients(3)[0].shape == (3, 4) and len(comm.sent) == 1
