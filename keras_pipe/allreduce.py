"""Internal: summing a stage's gradients over its replicas before the update.

Every replica scaled its micro-batches' losses by their share of the global
batch, so the sum is the global batch's gradient, as ``keras.Sequential``
computes it. Dense gradients are summed without copies: MPI reads each
gradient's memory through a read-only view and writes the sums into
64-byte-aligned buffers (kept from step to step) that TensorFlow then reads
as tensors without copying (DLPack); the last layers' all-reduces start
first. Sparse gradients (``IndexedSlices``) are gathered, rows and indices,
so the update sees the same slices as for the whole batch.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_pipe.comm import Communicator, aligned_empty


class ReplicaReducer:
    """Sums gradients over ``comm`` (the ranks holding the same stage, rank = replica)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self._buffers: dict = {}

    def sum(self, grads: list, computed: bool = True) -> list:
        """``grads`` (tensors or ``IndexedSlices``) summed over the replicas, in the same order.

        ``computed=False``: this replica had no share of the batch (its
        gradients are placeholder zeros).
        """
        grads = self._agree_on_sparse(grads, computed)
        dense = [(index, g) for index, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        results = list(grads)
        if dense:
            key = tuple((tuple(g.shape), g.dtype.name) for _, g in dense)
            if key not in self._buffers:
                self._buffers[key] = [aligned_empty(g.shape, g.dtype.as_numpy_dtype) for _, g in dense]
            buffers = self._buffers[key]
            sources = [_host_view(g) for _, g in reversed(dense)]
            requests = self.comm.start_allreduce_sum(sources, buffers[::-1])
            self.comm.wait_all(requests, "the other replicas of this stage (gradient allreduce)")
            del sources
            for (index, _), buffer in zip(dense, buffers):
                results[index] = tf.experimental.dlpack.from_dlpack(buffer.__dlpack__())
        for index, grad in enumerate(grads):
            if isinstance(grad, tf.IndexedSlices):
                results[index] = self._gather_slices(grad)
        return results

    def _agree_on_sparse(self, grads: list, computed: bool) -> list:
        """Every replica's gradient of a variable in one form, so that all take the same collective.

        A replica with no share holds zeros where the others hold slices: it
        sends no slices. A replica whose sparse gradient has a dense part (a
        weight regularizer's, which one replica counts) makes every replica's
        dense, as ``Sequential``'s gradient of slices plus a dense term is.
        One small all-reduce of the forms.
        """
        sparse = [isinstance(g, tf.IndexedSlices) for g in grads]
        forms = np.array([computed and s for s in sparse] + [computed and not s for s in sparse], np.float64)
        forms = self.comm.allreduce_sum(forms, "the other replicas of this stage (gradient allreduce)")
        agreed = []
        for grad, is_sparse, sparse_somewhere, dense_somewhere in zip(
            grads, sparse, forms[: len(grads)], forms[len(grads) :]
        ):
            if dense_somewhere and is_sparse:
                grad = tf.convert_to_tensor(grad)
            elif sparse_somewhere and not dense_somewhere and not is_sparse:
                grad = _no_slices(grad)
            agreed.append(grad)
        return agreed

    def sum_values(self, values: np.ndarray) -> np.ndarray:
        """A small float64 vector summed over the replicas (a count of the batch, say)."""
        return self.comm.allreduce_sum(values)

    def _gather_slices(self, grad: tf.IndexedSlices) -> tf.IndexedSlices:
        values = np.ascontiguousarray(grad.values.numpy())
        indices = np.ascontiguousarray(grad.indices.numpy().astype(np.int64))
        counts = [int(c) for c in self.comm.allgather_array(np.array([len(indices)], np.int64)).ravel()]
        all_values = self.comm.allgather_rows(values, counts)
        all_indices = self.comm.allgather_rows(indices, counts)
        return tf.IndexedSlices(tf.convert_to_tensor(all_values), tf.convert_to_tensor(all_indices), grad.dense_shape)


def _no_slices(zeros) -> tf.IndexedSlices:
    """No rows of a variable shaped like ``zeros``: a replica's sparse gradient when it had no share."""
    shape = tuple(zeros.shape)
    return tf.IndexedSlices(
        tf.zeros((0,) + shape[1:], zeros.dtype), tf.zeros((0,), tf.int64), tf.constant(shape, tf.int64)
    )


def _host_view(tensor) -> np.ndarray:
    """A read-only numpy view of a tensor in host memory, or a copy where it lives on a device."""
    try:
        return np.from_dlpack(tensor)
    except (BufferError, TypeError, RuntimeError, ValueError):  # an accelerator's memory: copy to the host
        return tensor.numpy()
