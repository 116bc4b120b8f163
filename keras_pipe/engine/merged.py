"""Internal: a rank's chunks seen as one stage at the end of a step — each weight once, with its whole gradient.

With several chunks a rank (virtual stages), a layer may be called on two
of them: Llama's token embedding looks up on the first virtual stage and,
as the head, projects on the last, which ZB-V places on the same rank; a
tied embedding does the same with one weight. Each chunk holds the layer
(the same variables) and sums its own micro-batches' gradients. Before the
update, the rank's weights are listed once each, in chunk order, and a
weight two chunks hold gets the gradient the unsplit model's tape gives
it: the sum of its uses, in the form Keras' step gives it (dense where any
use's is dense; else the uses' slices joined, in virtual-stage order, as
:class:`~keras_pipe.engine.allreduce.TiedReducer` joins those of several
ranks). That list is then summed over replicas and over the other ranks
that hold a weight, exactly as one chunk's.

>>> _merge_sparse_forms("rows", "rows"), _merge_sparse_forms("rows", "fixed")
('rows', 'mixed')
"""

from __future__ import annotations

import tensorflow as tf

from keras_pipe.stage.gradients import MIXED, ROWS, joined


class MergedChunks:
    """The trainable variables of a rank's ``computes`` (one per chunk), each once, and their step's gradients."""

    def __init__(self, computes: list):
        self.computes = computes
        position: dict[int, int] = {}
        self.variables: list = []
        self.places: list[list[int]] = []  # per compute, the position of each of its variables in the list
        for compute in computes:
            places = []
            for variable in compute.trainable_variables:
                if id(variable) not in position:
                    position[id(variable)] = len(self.variables)
                    self.variables.append(variable)
                places.append(position[id(variable)])
            self.places.append(places)
        self.shared = len(self.variables) < sum(len(places) for places in self.places)

    @property
    def computed(self) -> bool:
        """Whether any chunk added a gradient this step (a replica with no share of the batch adds none)."""
        return any(compute.gradients.computed for compute in self.computes)

    def gradients(self) -> list:
        """Each variable's gradient summed over the chunks that use it (``None`` where none reached the loss)."""
        merged: list = [None] * len(self.variables)
        self._parts = [compute.gradients.result() if compute.trainable_variables else [] for compute in self.computes]
        for places, part in zip(self.places, self._parts):
            for p, grad in zip(places, part):
                merged[p] = _add(merged[p], grad, self.variables[p])
        return merged

    def sparse_forms(self, grads: list) -> dict:
        """``{position: form}`` of the merged sparse gradients ``grads`` (each chunk's lookups' forms, joined)."""
        if not any(isinstance(g, tf.IndexedSlices) for g in grads):
            return {}
        forms: dict = {}
        for compute, places, own in zip(self.computes, self.places, self._parts):
            if not any(isinstance(g, tf.IndexedSlices) for g in own):
                continue
            for k, form in compute.sparse_forms().items():
                p = places[k]
                if isinstance(grads[p], tf.IndexedSlices) and isinstance(own[k], tf.IndexedSlices):
                    forms[p] = form if p not in forms else _merge_sparse_forms(forms[p], form)
        return forms

    def reset(self) -> None:
        for compute in self.computes:
            compute.gradients.reset()


def _add(total, grad, variable):
    """Two uses' gradients of one weight, as the tape adds them: dense if either is, else the slices joined."""
    if grad is None:
        return total
    if total is None:
        return grad
    if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        return joined([total, grad], ROWS, variable)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def _merge_sparse_forms(a: str, b: str) -> str:
    """The form of two uses' slices joined: the same where both agree, else slices no sum over parts can give."""
    return a if a == b else MIXED
