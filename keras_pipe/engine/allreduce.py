"""Internal: summing a stage's gradients over its replicas before the update.

Every replica scaled its micro-batches' losses by their share of the global
batch, so the sum is the global batch's gradient, as ``keras.Sequential``
computes it. Dense gradients are summed without copies: MPI reads each
gradient's memory through a read-only view and writes the sums into
64-byte-aligned buffers (kept from step to step) that TensorFlow then reads
as tensors without copying (DLPack); the last layers' all-reduces start
first. Sparse gradients (``IndexedSlices``) are gathered, rows and indices,
and joined as :func:`keras_pipe.stage.gradients.joined` joins micro-batches, so
the update sees the same slices as for the whole batch.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_pipe.mpi.comm import Communicator, aligned_empty
from keras_pipe.stage.gradients import FIXED, MIXED, ROWS, joined


class ReplicaReducer:
    """Sums gradients over ``comm`` (the ranks holding the same stage, rank = replica)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self._buffers: dict = {}

    def sum(self, grads: list, computed: bool, forms: dict, like: list) -> list:
        """``grads`` (tensors, ``IndexedSlices`` or ``None``) summed over the replicas, in the same order.

        ``computed=False``: this replica had no share of the batch (its
        gradients are placeholders). ``forms``: this replica's
        :func:`~keras_pipe.stage.gradients.lookup_form` of its sparse gradients;
        ``like``: the variables (their shapes, for a replica that got no
        gradient where another did).
        """
        grads, sparse_forms = self._agree(grads, computed, forms, like)
        dense = [(index, g) for index, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
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
                results[index] = joined(gathered_slices(self.comm, grad), sparse_forms[index], like[index])
        return results

    def _agree(self, grads: list, computed: bool, forms: dict, like) -> tuple[list, dict]:
        """Every replica's gradient of a variable in one form, so that all take the same collective.

        The form the whole batch's gradient has (:mod:`keras_pipe.stage.gradients`):
        dense where any replica's is dense (a weight regularizer's term, which
        one replica counts, added to slices); else sparse where any replica's
        is, a replica with no slices sending none, summed as the lookups'
        forms say; else ``None``. A replica with no share of the batch holds
        placeholders: it counts for nothing. One small all-reduce of the forms.
        """
        what = "the other replicas of this stage (gradient allreduce)"
        mine = grads if computed else [None] * len(grads)
        sparse_somewhere, dense_somewhere, fixed, mixed = forms_everywhere(self.comm, mine, what, forms)
        agreed, sparse_forms = [], {}
        for i, grad in enumerate(mine):
            if dense_somewhere[i]:
                grad = _zeros(like[i]) if grad is None else tf.convert_to_tensor(grad)
            elif sparse_somewhere[i]:
                grad = _no_slices(like[i]) if grad is None or not isinstance(grad, tf.IndexedSlices) else grad
                sparse_forms[i] = MIXED if mixed[i] else FIXED if fixed[i] else ROWS
            else:
                grad = None
            agreed.append(grad)
        return agreed, sparse_forms

    def sum_values(self, values: np.ndarray) -> np.ndarray:
        """A small float64 vector summed over the replicas (a count of the batch, say)."""
        return self.comm.allreduce_sum(values)


def forms_everywhere(comm: Communicator, grads: list, what: str, forms: dict | None = None) -> np.ndarray:
    """For each gradient, how many ranks of ``comm`` hold it sparse, dense, and (sparse) ``FIXED`` or ``MIXED``.

    ``grads``: this rank's (``None`` where it has none); ``forms``: the
    :func:`~keras_pipe.stage.gradients.lookup_form` of its sparse ones. One
    small all-reduce; returns the four rows of counts.
    """
    forms = forms or {}
    flags = np.zeros((4, len(grads)), np.float64)
    for i, g in enumerate(grads):
        if g is not None:
            sparse = isinstance(g, tf.IndexedSlices)
            flags[0 if sparse else 1, i] = 1
            flags[2, i] = sparse and forms.get(i) == FIXED
            flags[3, i] = sparse and forms.get(i) == MIXED
    return comm.allreduce_sum(flags.ravel(), what).reshape(4, len(grads))


def gathered_slices(comm: Communicator, grad: tf.IndexedSlices) -> list[tf.IndexedSlices]:
    """Every rank's ``IndexedSlices`` of one weight, in rank order (collective over ``comm``)."""
    values = np.ascontiguousarray(grad.values.numpy())
    indices = np.ascontiguousarray(grad.indices.numpy().astype(np.int64))
    counts = [int(c) for c in comm.allgather_array(np.array([len(indices)], np.int64)).ravel()]
    all_values = comm.allgather_rows(values, counts)
    all_indices = comm.allgather_rows(indices, counts)
    ends = np.cumsum(counts)
    return [
        tf.IndexedSlices(
            tf.convert_to_tensor(all_values[end - count : end]),
            tf.convert_to_tensor(all_indices[end - count : end]),
            grad.dense_shape,
        )
        for count, end in zip(counts, ends)
    ]


def _zeros(variable) -> tf.Tensor:
    return tf.zeros(variable.shape, variable.dtype)


def _no_slices(variable) -> tf.IndexedSlices:
    """No rows of ``variable``: a rank's sparse gradient where it looked up nothing."""
    shape = tuple(variable.shape)
    return tf.IndexedSlices(
        tf.zeros((0,) + shape[1:], variable.dtype), tf.zeros((0,), tf.int64), tf.constant(shape, tf.int64)
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

    def __init__(self, groups: list):
        # [(communicator, the shared weights it sums (every stage of it lists them in the same order),
        #   whether this is the first stage holding them)]: which of them train, and so their positions
        # among the stage's trainable variables, is read at each step (compile() may have changed it)
        self.groups = groups

    def _positions(self, weights: list, variables: list) -> list:
        position = {id(v): i for i, v in enumerate(variables)}
        return [position[id(w)] for w in weights if id(w) in position]

    def counted(self, variables: list) -> list[bool]:
        """Per trainable variable: whether this stage counts it in the whole model's gradient norm."""
        counted = [True] * len(variables)
        for _, weights, first in self.groups:
            if not first:
                for p in self._positions(weights, variables):
                    counted[p] = False
        return counted

    @classmethod
    def create(cls, pipeline, cut, rank: int, model_graph, ranks_of: list[int] | None = None) -> TiedReducer | None:
        """One communicator per set of ranks sharing weights (collective over ``pipeline``).

        ``cut.shared``: each shared unit's (virtual) stages; ``ranks_of``: each
        virtual stage's rank (``None``: one stage a rank). A unit whose stages
        are all on this rank (two chunks of it) is summed there
        (:mod:`keras_pipe.engine.merged`), not here. ``None`` where this rank
        shares no weight with another.
        """
        from mpi4py import MPI

        from keras_pipe.mpi.comm import Communicator, created

        ranks_of = ranks_of or list(range(len(cut.stages)))
        by_ranks: dict[tuple, list[str]] = {}
        first_stage: dict[tuple, dict[int, int]] = {}
        for unit, stages in sorted(cut.shared.items()):
            ranks = tuple(sorted({ranks_of[k] for k in stages}))
            if len(ranks) > 1:
                by_ranks.setdefault(ranks, []).append(unit)
                firsts = first_stage.setdefault(ranks, {})
                for k in stages:
                    firsts[ranks_of[k]] = min(firsts.get(ranks_of[k], k), k)
        groups = []
        for ranks, units in sorted(by_ranks.items()):
            member = rank in ranks
            comm = None
            if pipeline.size > 1:
                # (ordered by each rank's first virtual stage holding the units: their slices join in that order)
                split = pipeline.comm.Split(0 if member else MPI.UNDEFINED, first_stage[ranks].get(rank, 0))
                if member:
                    comm = Communicator(created(split), pipeline.stall_timeout, parent=pipeline._parent or pipeline)
            if not member:
                continue
            # (each variable once: the units held together share some)
            weights = list({id(v): v for unit in units for v in model_graph.units[unit].weights}.values())
            if comm is not None:
                first = min(first_stage[ranks].values())
                groups.append((comm, weights, first_stage[ranks][rank] == first))
        if not groups:
            return None
        return cls(groups)

    def sum(self, grads: list, like: list) -> list:
        """``grads`` with every shared weight's gradient summed over the stages holding it, in Keras' form.

        Each stage's use of the weight is one more use of it in the whole
        model, as the tape sees them: dense where any stage's gradient is
        dense; else the stages' slices joined (in stage order); ``None`` where
        no stage's use reached the loss. ``like``: the variables.
        """
        results = list(grads)
        for comm, weights, _ in self.groups:
            positions = self._positions(weights, like)
            if not positions:
                continue  # (none of them trains: on every stage holding them, as the flags are the same)
            what = "the other stages holding a shared weight (gradient allreduce)"
            sparse_somewhere, dense_somewhere, _, _ = forms_everywhere(comm, [results[p] for p in positions], what)
            dense = [p for k, p in enumerate(positions) if dense_somewhere[k]]
            arrays = [
                np.array(tf.convert_to_tensor(results[p] if results[p] is not None else _zeros(like[p])), copy=True)
                for p in dense
            ]
            requests = comm.start_allreduce_sum(arrays)
            comm.wait_all(requests, what)
            for p, array in zip(dense, arrays):
                results[p] = tf.convert_to_tensor(array)
            for k, p in enumerate(positions):
                if sparse_somewhere[k] and not dense_somewhere[k]:
                    mine = results[p] if results[p] is not None else _no_slices(like[p])
                    results[p] = joined(gathered_slices(comm, mine), ROWS, like[p])
        return results
