"""Internal: a step's weight gradients, summed over its micro-batches, in the form Keras' own step gives them.

The optimizer must see each weight's gradient in the form
``keras.Model.train_step`` hands it for the whole batch (TensorFlow's tape
decides it), not only with its value: Keras' TensorFlow optimizers update
an ``IndexedSlices`` gradient slice by slice (Adam squares each slice, then
adds the squares of an id's slices), so an optimizer that is not linear in
the gradient tells two forms of one sum apart. The forms, and how each is
kept here and in :mod:`keras_pipe.engine.allreduce`:

- ``None``: no use of the weight reached the loss. Keras' optimizer skips
  the weight (no step, no decay, its slots untouched), so it stays ``None``.
- dense (a tensor): any dense use of a weight makes its whole gradient dense
  (the tape adds the uses' gradients). Summed in place, in micro-batch order
  (g0, then + g1, + g2, ...), so every schedule sums identically; a first
  gradient is kept as it is, without a copy.
- sparse (``tf.IndexedSlices``, an ``Embedding``'s lookups and no dense use):
  one slice per id looked up, by each lookup (the tape joins the lookups'
  slices). Across micro-batches that depends on where a lookup's ids come
  from (:data:`ROWS`, :data:`FIXED`), which :func:`lookup_form` reads from
  the stage's graph traced without a batch size.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError

ROWS = "rows"
"""A lookup whose ids are read from the batch's rows: the batch's slices are its micro-batches' slices, joined."""
FIXED = "fixed"
"""A lookup whose ids are known without the batch (ViT's positions, T5's relative buckets): the whole batch has
one slice per id, whose value is the sum of the micro-batches' slices of that id."""
MIXED = "mixed"
"""A weight looked up both ways on one stage: its slices cannot be told apart once joined (refused)."""


class GradientSum:
    """The running sum of one step's gradients of ``variables``.

    Args:
        variables: the stage's trainable variables, in order.
        program: ``(key, function) -> callable``, compiling the additions.
        forms: ``() -> {position: ROWS | FIXED | MIXED}`` of the sparse
            gradients, asked only where a sparse gradient has several parts
            (default: every lookup's ids come from the batch, ``ROWS``).
    """

    def __init__(self, variables, program, forms=None):
        self.variables = list(variables)
        self._program = program
        self._forms = forms
        self._accumulators: list | None = None
        self._sparse_positions: list[int] = []  # (set while a program traces: see add_in_graph)
        self._dense_positions: list[int] = []
        self.reset()

    def reset(self) -> None:
        """Forgets the step's gradients (after the update)."""
        self._direct: list | None = None  # the first gradients, not yet copied anywhere
        self._accumulated = False  # whether the accumulators hold the sum
        self._sparse: dict[int, list] = {}
        self._dense: set[int] = set()  # the positions given a dense gradient (the rest hold placeholder zeros)

    @property
    def empty(self) -> bool:
        return self._direct is None and not self._accumulated

    @property
    def computed(self) -> bool:
        """Whether the step added any gradient (a replica with no share of the batch adds none)."""
        return not self.empty or bool(self._sparse)

    def add(self, grads: list) -> None:
        """Adds one micro-batch's (or one ``W``'s) gradients (``None`` where a weight got none), eagerly."""
        dense = [self._take(i, g) for i, g in enumerate(grads)]
        if self.empty:
            self._direct = dense
            return
        self._accumulate(dense)

    def _accumulate(self, dense: list) -> None:
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
            self._accumulate([tf.zeros(v.shape, v.dtype) for v in self.variables])
        self._ensure_accumulators()
        return tf.constant(not self._accumulated)

    def add_in_graph(self, grads: list, first) -> list:
        """Inside a compiled program: adds the dense gradients to the accumulators; returns the sparse ones.

        ``first`` is what :meth:`prepare` returned before the program; call
        :meth:`added` after it.
        """
        self._sparse_positions = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        self._dense_positions = [i for i, g in enumerate(grads) if g is not None and i not in self._sparse_positions]
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
        self._dense.update(self._dense_positions)
        self._accumulated = True

    def result(self) -> list:
        """The summed gradients, in variable order, each in Keras' form: a tensor, ``IndexedSlices`` or ``None``."""
        if self._direct is not None:
            dense = list(self._direct)
        elif self._accumulated:
            dense = [a.read_value() for a in self._accumulators]
        else:
            dense = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        result = [d if i in self._dense else None for i, d in enumerate(dense)]
        several = self._forms is not None and any(len(parts) > 1 for parts in self._sparse.values())
        forms = self._forms() if several else {}
        for index, parts in self._sparse.items():
            slices = joined(parts, forms.get(index, ROWS), self.variables[index])
            # a dense use too (a weight regularizer's gradient): the tape adds them, dense
            result[index] = slices if result[index] is None else tf.convert_to_tensor(slices) + result[index]
        return result

    def _take(self, index: int, grad):
        """The dense part of a gradient for the accumulators: zeros where it is sparse (kept aside) or ``None``."""
        if isinstance(grad, tf.IndexedSlices):
            self._sparse.setdefault(index, []).append(grad)
        elif grad is not None:
            self._dense.add(index)
            return grad
        return tf.zeros(self.variables[index].shape, self.variables[index].dtype)

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


def joined(parts: list, form: str, variable=None) -> tf.IndexedSlices:
    """The sparse gradients of several parts of one batch (micro-batches, replicas) as the whole batch's.

    ``ROWS``: the parts' slices joined, in order. ``FIXED``: every part looked
    up the same ids (checked on the real indices), so the batch's slice of
    each id is the sum of the parts'. A part with no slices (a replica with
    no share of the batch) adds nothing.

    >>> a = tf.IndexedSlices(tf.ones((2, 1)), tf.constant([0, 1]), tf.constant([3, 1]))
    >>> joined([a, a], ROWS).indices.numpy().tolist(), joined([a, a], FIXED).values.numpy().ravel().tolist()
    ([0, 1, 0, 1], [2.0, 2.0])
    """
    if len(parts) > 1 and form != ROWS:
        parts = [p for p in parts if p.indices.shape[0] != 0] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    if form == ROWS:
        values = tf.concat([p.values for p in parts], axis=0)
        indices = tf.concat([tf.cast(p.indices, tf.int64) for p in parts], axis=0)
        return tf.IndexedSlices(values, indices, parts[0].dense_shape)
    name = getattr(variable, "path", None) or getattr(variable, "name", "a weight")
    if form == MIXED:
        raise PipelineConfigError(
            f"{name!r} is looked up both with ids read from the batch and with ids known without it (positions) on "
            "one stage: its sparse gradient's slices cannot be summed over micro-batches as Keras' whole batch "
            "has them, and a non-linear optimizer (Adam) would step differently. Look the two up in two "
            "Embedding layers, or use num_microbatches=1."
        )
    first = np.asarray(parts[0].indices)
    for part in parts[1:]:
        if not np.array_equal(np.asarray(part.indices), first):
            raise PipelineConfigError(
                f"{name!r}: a lookup whose ids are known without the batch (its graph says so) looked up other ids "
                "in another micro-batch; the whole batch's sparse gradient cannot be made from the micro-batches'. "
                "Use num_microbatches=1."
            )
    return tf.IndexedSlices(tf.add_n([p.values for p in parts]), parts[0].indices, parts[0].dense_shape)


def lookup_form(indices) -> str:
    """How a sparse gradient's slices, traced without a batch size, add up over micro-batches.

    A lookup's slices are its ids, flattened: where the ids come from the
    batch their count is unknown without the batch size (``ROWS``); where it
    is known, the ids do not depend on the batch (``FIXED``). The tape joins
    several lookups of one weight with a concatenation: each is read apart.
    """
    counts = [part.shape[0] for part in _joined_parts(indices)]
    if all(c is None for c in counts):
        return ROWS
    return FIXED if all(c is not None for c in counts) else MIXED


def _joined_parts(tensor) -> list:
    op = tensor.op
    if op.type in ("Cast", "Identity"):
        return _joined_parts(op.inputs[0])
    if op.type == "ConcatV2":
        return [part for t in op.inputs[:-1] for part in _joined_parts(t)]
    return [tensor]


def watch_weights(tape, variables) -> None:
    """Watches the weights that train: a tape watches only variables whose ``tf.Variable`` is trainable, and
    one allocated while its layer was frozen (a model frozen before the pipeline gave it memory, then
    unfrozen) is not, whatever its Keras flag says now; Keras' flag decides (``compat.trained_weights``), which
    made ``variables``."""
    tape.watch([compat.variable_handle(v) for v in variables])
