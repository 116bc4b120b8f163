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

from keras_pipe.mpi.comm import Communicator, aligned_empty


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


class TiedReducer:
    """Sums the gradients of weights that several stages hold (a layer called on each of them) over those stages.

    ``GPT2CausalLM``'s token embedding is called by the first stage and, as
    the ``reverse=True`` head, by the last: each holds a copy and computes
    its part of the gradient. Before every update the copies' gradients are
    summed over the stages holding them (one all-reduce per shared weight on
    a communicator of those stages, as DeepSpeed's tied layers and
    Megatron's embedding group do), so every copy takes the same step and
    they stay identical. The whole model's gradient norm counts such a
    weight once, on the first stage holding it (``counted``).
    """

    def __init__(self, groups: list, counted: list[bool]):
        self.groups = groups  # [(communicator, positions of the variables it sums)]
        self.counted = counted

    @classmethod
    def create(cls, pipeline, cut, stage: int, model_graph, variables) -> TiedReducer | None:
        """One communicator per set of stages sharing weights (collective over ``pipeline``).

        ``None`` where this stage shares no weight.
        """
        from mpi4py import MPI

        from keras_pipe.mpi.comm import Communicator, created

        by_stages: dict[tuple, list[str]] = {}
        for unit, stages in sorted(cut.shared.items()):
            by_stages.setdefault(tuple(stages), []).append(unit)
        position = {id(v): i for i, v in enumerate(variables)}
        counted = [True] * len(variables)
        groups = []
        for stages, units in sorted(by_stages.items()):
            member = stage in stages
            comm = None
            if pipeline.size > 1:
                split = pipeline.comm.Split(0 if member else MPI.UNDEFINED, stage)
                if member:
                    comm = Communicator(created(split), pipeline.stall_timeout, parent=pipeline._parent or pipeline)
            if not member:
                continue
            positions = [position[id(v)] for unit in units for v in model_graph.units[unit].trainable_weights]
            if stage != min(stages):
                for p in positions:
                    counted[p] = False
            if comm is not None:
                groups.append((comm, positions))
        if not groups:
            return None
        return cls(groups, counted)

    def sum(self, grads: list) -> list:
        """``grads`` with every shared weight's gradient summed over the stages holding it (dense)."""
        results = list(grads)
        for comm, positions in self.groups:
            arrays = [np.array(tf.convert_to_tensor(results[p]).numpy(), copy=True) for p in positions]
            requests = comm.start_allreduce_sum(arrays)
            comm.wait_all(requests, "the other stages holding a shared weight (gradient allreduce)")
            for p, array in zip(positions, arrays):
                results[p] = tf.convert_to_tensor(array)
        return results
