"""Internal: a step's weight gradients, summed over its micro-batches in a fixed order.

Dense gradients are summed in place, in micro-batch order (g0, then + g1,
+ g2, ...), so every schedule sums identically. A first gradient is kept as
it is, without a copy: with one micro-batch (or one batched ``W``) nothing
is ever accumulated. Sparse gradients (``tf.IndexedSlices``, from an
``Embedding``) stay sparse: their slices are concatenated, which is what
``keras.Sequential`` hands the optimizer for the whole batch, so optimizers
that treat sparse gradients differently (Adam) update as they do there.
"""

from __future__ import annotations

import tensorflow as tf


class GradientSum:
    """The running sum of one step's gradients of ``variables``.

    Args:
        variables: the stage's trainable variables, in order.
        program: ``(key, function) -> callable``, compiling the additions.
    """

    def __init__(self, variables, program):
        self.variables = list(variables)
        self._program = program
        self._accumulators: list | None = None
        self._sparse_positions: list[int] = []
        self.reset()

    def reset(self) -> None:
        """Forgets the step's gradients (after the update)."""
        self._direct: list | None = None  # the first gradients, not yet copied anywhere
        self._accumulated = False  # whether the accumulators hold the sum
        self._sparse: dict[int, list] = {}

    @property
    def empty(self) -> bool:
        return self._direct is None and not self._accumulated

    @property
    def computed(self) -> bool:
        """Whether the step added any gradient (a replica with no share of the batch adds none)."""
        return not self.empty or bool(self._sparse)

    def add(self, grads: list) -> None:
        """Adds one micro-batch's (or one ``W``'s) gradients, eagerly."""
        dense = [self._take_sparse(i, g) for i, g in enumerate(grads)]
        if self.empty:
            self._direct = dense
            return
        self._ensure_accumulators()
        if self._direct is not None:
            first, self._direct = self._direct, None
            self._program("sum_two", self._assign_sum)(first, dense)
        else:
            self._program("sum_add", self._assign_add)(dense)
        self._accumulated = True

    def prepare(self) -> tf.Tensor:
        """Creates the accumulators eagerly, before a program that adds to them; the program's ``first`` argument.

        One program serves every micro-batch: ``first`` (a scalar bool
        tensor, true on a step's first addition) selects the gradient over
        the sum, where a program per case would cost a second compilation
        and, measured, tens of MiB of a rank's peak memory.
        """
        if self._direct is not None:
            self.add([tf.zeros(v.shape, v.dtype) for v in self.variables])
        self._ensure_accumulators()
        return tf.constant(not self._accumulated)

    def add_in_graph(self, grads: list, first) -> list:
        """Inside a compiled program: adds the dense gradients to the accumulators; returns the sparse ones.

        ``first`` is what :meth:`prepare` returned before the program; call
        :meth:`added` after it.
        """
        self._sparse_positions = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        sparse = []
        for grad, accumulator in zip(grads, self._accumulators):
            if grad is None:
                grad = tf.zeros(accumulator.shape, accumulator.dtype)
            if isinstance(grad, tf.IndexedSlices):
                sparse.append(grad)
                continue
            grad = tf.cast(grad, accumulator.dtype)  # a select, not first * sum: a sum of inf or nan stays out
            accumulator.assign(tf.where(first, grad, accumulator + grad))
        return sparse

    def added(self, sparse: list) -> None:
        """Records what :meth:`add_in_graph` returned (the program traced it, so positions are known)."""
        for index, grad in zip(self._sparse_positions, sparse):
            self._sparse.setdefault(index, []).append(grad)
            if not self._accumulated:  # the program left this accumulator as it was: zero it once
                self._accumulators[index].assign(tf.zeros_like(self._accumulators[index]))
        self._accumulated = True

    def result(self) -> list:
        """The summed gradients, in variable order (``IndexedSlices`` where sparse)."""
        if self._direct is not None:
            dense = list(self._direct)
        elif self._accumulated:
            dense = [a.read_value() for a in self._accumulators]
        else:
            dense = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        for index, slices in self._sparse.items():
            dense[index] = _concat_slices(slices, dense[index])
        return dense

    def _take_sparse(self, index: int, grad):
        if isinstance(grad, tf.IndexedSlices):
            self._sparse.setdefault(index, []).append(grad)
            return tf.zeros(self.variables[index].shape, self.variables[index].dtype)
        return grad

    def _ensure_accumulators(self) -> None:
        if self._accumulators is None:
            with tf.init_scope():  # created eagerly, even on a first call inside a program
                self._accumulators = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="gradient_sum")
                    for v in self.variables
                ]

    def _assign_sum(self, first, second):
        for accumulator, a, b in zip(self._accumulators, first, second):
            accumulator.assign(tf.cast(a, accumulator.dtype) + tf.cast(b, accumulator.dtype))

    def _assign_add(self, grads):
        for accumulator, grad in zip(self._accumulators, grads):
            accumulator.assign_add(tf.cast(grad, accumulator.dtype))


def _concat_slices(slices: list, dense_part) -> tf.IndexedSlices:
    """The slices of several micro-batches as one ``IndexedSlices`` (plus any dense part, e.g. a regularizer's)."""
    values = tf.concat([s.values for s in slices], axis=0)
    indices = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0)
    shape = slices[0].dense_shape
    merged = tf.IndexedSlices(values, indices, shape)
    if dense_part is not None and bool(tf.reduce_any(tf.not_equal(dense_part, 0))):
        return tf.convert_to_tensor(merged) + dense_part
    return merged
