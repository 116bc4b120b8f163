"""The compiled loss, term by term and micro-batch by micro-batch, computed Keras' way.

Keras' ``CompileLoss`` sums one term per output (``loss_weights`` times
that output's loss); each term is a ``keras.losses.Loss`` that reduces its
per-entry values by a divisor it counts over the batch: the number of
entries (``sum_over_batch_size``), the unmasked ones where the output
carries a Keras mask, the summed sample weights
(``mean_with_sample_weight``), or nothing (``sum``). A micro-batch holds a
part of that divisor, so :class:`MicrobatchLoss` returns, per term, the
micro-batch's value and its divisor (mirroring ``Loss.__call__``,
``reduce_weighted_values`` and ``reduce_values`` in
``keras/src/losses/loss.py``), and the batch's loss is

    sum over terms k of  weight_k * sum_i value_ki * divisor_ki / sum_i divisor_ki

(for ``sum``: ``weight_k * sum_i value_ki``). Where the divisors' shares are
known before the forward (no mask), each micro-batch's terms are weighted
by them at once; a masked output under a mean counts its unmasked entries
only in the forwards, so its micro-batches are weighted once all are
counted (see ``Executor``).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
REDUCTIONS = MEAN_REDUCTIONS + ("sum",)


class MicrobatchLoss:
    """The terms of a model's compiled loss, each with its reduction (built on the last stage's first batch).

    Args:
        compile_loss: the model's ``CompileLoss`` (``None`` when ``compile()`` had no loss).
        output_structure: the model's outputs as ``KerasTensor``s, to build it with.
        masked: for each flat model output, whether it carries a Keras mask.
    """

    def __init__(self, compile_loss, output_structure, masked: list[bool]):
        self.compile_loss = compile_loss
        self.output_structure = output_structure
        self.masked = list(masked)
        self.terms: list | None = None  # [(path, loss, weight, name)] once built

    def build(self, y_true) -> None:
        """Resolves the terms as ``CompileLoss.build`` does, from the labels' structure and the outputs'."""
        if self.terms is not None or self.compile_loss is None:
            self.terms = self.terms or []
            return
        y_true = keras.tree.map_structure(lambda a: keras.KerasTensor(np.shape(a), _dtype(a)), y_true)
        y_pred = self.output_structure
        y_true = self.align(y_true, y_pred)
        if not self.compile_loss.built:
            self.compile_loss.build(y_true, y_pred)
        self.terms = list(compat.loss_terms(self.compile_loss))
        for _, loss, _, name in self.terms:
            reduction = getattr(loss, "reduction", "sum_over_batch_size")
            if reduction not in REDUCTIONS:
                raise PipelineConfigError(
                    f"the loss {name!r} has reduction={reduction!r}, which cannot be combined over micro-batches; "
                    f"use one of {', '.join(map(repr, REDUCTIONS))}."
                )

    @property
    def size(self) -> int:
        return len(self.terms or [])

    def reductions(self) -> list[str]:
        return [_reduction(loss) for _, loss, _, _ in self.terms]

    def weights(self) -> list[float]:
        return [1.0 if weight is None else float(weight) for _, _, weight, _ in self.terms]

    def names(self) -> list[str]:
        return [name for _, _, _, name in self.terms]

    def term_masked(self) -> list[bool]:
        """Whether each term's prediction carries a Keras mask."""
        flat = keras.tree.flatten(self.output_structure)
        positions = {id(kt): i for i, kt in enumerate(flat)}
        result = []
        for path, _, _, _ in self.terms:
            leaves = keras.tree.flatten(_resolve(path, self.output_structure))
            result.append(any(self.masked[positions[id(kt)]] for kt in leaves if id(kt) in positions))
        return result

    def whole_batch(self) -> bool:
        """Whether a term's divisor is known only after every forward (a masked output under a mean)."""
        return any(m and r in MEAN_REDUCTIONS for m, r in zip(self.term_masked(), self.reductions()))

    def align(self, y_true, y_pred):
        """``y_true`` in ``y_pred``'s structure, as ``CompileLoss.call`` reconciles them."""
        if not keras.tree.is_nested(y_true) and not keras.tree.is_nested(y_pred):
            return y_true
        try:
            keras.tree.assert_same_structure(y_pred, y_true)
            return y_true
        except (ValueError, TypeError):
            pass
        if not keras.tree.is_nested(y_true) and isinstance(y_pred, (list, tuple)) and len(y_pred) == 1:
            y_true = [y_true]
        elif isinstance(y_pred, (list, tuple)) and isinstance(y_true, dict):
            names = self.compile_loss.output_names or []
            if set(names) == set(y_true):
                y_true = [y_true[name] for name in names]
        flat = keras.tree.flatten(y_true)
        if len(flat) != len(keras.tree.flatten(y_pred)):
            raise PipelineConfigError(
                f"the labels hold {len(flat)} arrays but the model has {len(keras.tree.flatten(y_pred))} outputs; "
                "give one label array per output (a list in the outputs' order, or a dict by output name)."
            )
        return keras.tree.pack_sequence_as(y_pred, flat)

    def values(self, y_true, y_pred, sample_weight):
        """Inside a program: ``(values, divisors)``, one entry per term, as float32 vectors."""
        y_true = self.align(y_true, y_pred)
        values, divisors = [], []
        for path, loss, _, _ in self.terms:
            y_t, y_p = _resolve(path, y_true), _resolve(path, y_pred)
            weight = _resolve(path, sample_weight) if keras.tree.is_nested(sample_weight) else sample_weight
            value, divisor = reduce_with_divisor(loss, y_t, y_p, weight)
            values.append(tf.cast(value, tf.float32))
            divisors.append(tf.cast(divisor, tf.float32))
        if not values:
            return tf.zeros((0,), tf.float32), tf.zeros((0,), tf.float32)
        return tf.stack(values), tf.stack(divisors)

    def label_ranges(self, y_true, y_pred) -> list:
        """Inside a program: ``((note, 0, classes), [smallest, largest])`` for each sparse cross-entropy's labels.

        TensorFlow's sparse softmax cross-entropy kernel refuses a label
        outside ``[0, classes)``; under XLA it gives NaN silently. The
        program returns the labels' range so that the pipeline refuses them
        as the unsplit model does (see ``programs.StageProgram``).
        """
        y_true = self.align(y_true, y_pred)
        ranges = []
        for path, loss, _, name in self.terms:
            if not _is_sparse_crossentropy(loss):
                continue
            labels = tf.reshape(tf.cast(tf.convert_to_tensor(_resolve(path, y_true)), tf.int64), [-1])
            classes = _resolve(path, y_pred).shape[-1]
            if classes is None:
                continue
            ignore = _ignore_class(loss)
            kept = labels if ignore is None else tf.boolean_mask(labels, tf.not_equal(labels, ignore))
            smallest = tf.reduce_min(tf.concat([kept, [0]], 0))
            largest = tf.reduce_max(tf.concat([kept, [0]], 0))
            note = (
                f"the loss of output {name!r} (sparse categorical cross-entropy over {classes} classes) was given label"
            )
            ranges.append(((note, 0, int(classes)), tf.stack([smallest, largest])))
        return ranges


def _is_sparse_crossentropy(loss) -> bool:
    return isinstance(loss, keras.losses.SparseCategoricalCrossentropy) or (
        getattr(loss, "fn", None) is keras.losses.sparse_categorical_crossentropy
    )


def _ignore_class(loss):
    return compat.loss_function_kwargs(loss).get("ignore_class")


def reduce_with_divisor(loss, y_true, y_pred, sample_weight=None):
    """``(loss(y_true, y_pred, sample_weight), the divisor it used)``, as ``keras.losses.Loss.__call__`` computes.

    Mirrors ``Loss.__call__`` -> ``reduce_weighted_values`` -> ``apply_mask``
    and ``reduce_values`` (Keras 3.15): the divisor is the entries' count
    (``sum_over_batch_size``, ``mean``), the unmasked ones' count where a
    mask rides on ``y_pred`` (``apply_mask`` weights each unmasked entry by
    ``total / valid``, so the mean is over the valid ones), the summed
    (masked) sample weights (``mean_with_sample_weight``), or 1 (``sum``).
    """
    reduction = _reduction(loss)
    if type(loss).__call__ is not keras.losses.Loss.__call__:
        # a loss of its own making: its value as it computes it; a plain share of the rows
        value = loss(y_true, y_pred, sample_weight)
        if compat.get_mask(y_pred) is not None and reduction in MEAN_REDUCTIONS:
            raise PipelineConfigError(
                f"the loss {type(loss).__name__} overrides __call__ and its prediction carries a Keras mask: "
                "keras_pipe cannot count the entries it divides by. Implement call() instead of __call__()."
            )
        rows = tf.cast(tf.shape(tf.nest.flatten(y_pred)[0])[0], tf.float32)
        return value, (tf.constant(1.0) if reduction == "sum" else rows)
    ops = keras.ops
    in_mask = compat.get_mask(y_pred)
    with keras.name_scope(loss.name):
        y_pred = keras.tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_pred)
        y_true = keras.tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_true)
        values = loss.call(y_true, y_pred)
        out_mask = compat.get_mask(values)
        if in_mask is not None and out_mask is not None:
            mask = in_mask & out_mask
        else:
            mask = in_mask if in_mask is not None else out_mask
        dtype = loss.dtype
        values = ops.convert_to_tensor(values, dtype=dtype)
        if sample_weight is not None:
            sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
        if mask is not None:
            mask = ops.convert_to_tensor(mask, dtype=dtype)
        sample_weight = compat.apply_mask(sample_weight, mask, values.dtype, reduction)
        if sample_weight is not None:
            sample_weight = ops.cast(sample_weight, values.dtype)
            values, sample_weight = compat.squeeze_or_expand_to_same_rank(values, sample_weight)
            values = values * sample_weight
        if tuple(values.shape) in ((), (0,)):
            return values, ops.ones((), values.dtype)
        total = ops.sum(values)
        if reduction == "sum":
            return total, ops.ones((), total.dtype)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            divisor = ops.cast(ops.sum(sample_weight), total.dtype)
        else:
            divisor = ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32")), total.dtype)
        value = compat.scale_loss_for_distribution(ops.divide_no_nan(total, divisor))
        if mask is not None and reduction in ("sum_over_batch_size", "mean"):
            # apply_mask weighted the unmasked entries total / valid: the value is a mean over the valid ones
            divisor = ops.sum(ops.cast(mask, total.dtype))
        return value, divisor


def divisor_shares(reductions: list[str], bounds: list, sample_weight, batch_size: int, paths=None) -> np.ndarray:
    """``(micro-batches, terms)``: each micro-batch's share of each term's divisor, where no mask decides it.

    ``sum`` terms get 1 (their values add up); a mean over entries the
    micro-batch's share of the rows; ``mean_with_sample_weight`` with sample
    weights its share of their sum.
    """
    shares = np.zeros((len(bounds), len(reductions)), np.float64)
    for k, reduction in enumerate(reductions):
        weight = sample_weight
        if paths is not None and keras.tree.is_nested(sample_weight):
            weight = _resolve(paths[k], sample_weight)
        for i, (start, stop) in enumerate(bounds):
            if reduction == "sum":
                shares[i, k] = 1.0
            elif reduction == "mean_with_sample_weight" and weight is not None:
                total = float(np.sum(weight))
                shares[i, k] = float(np.sum(np.asarray(weight)[start:stop])) / total if total else 0.0
            else:
                shares[i, k] = (stop - start) / batch_size
    return shares


def _reduction(loss) -> str:
    return getattr(loss, "reduction", "sum_over_batch_size") or "none"


def _resolve(path, value):
    for key in path:
        value = value[key]
    return value


def _dtype(array) -> str:
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        return str(np.asarray(array).dtype)
    return dtype.name if hasattr(dtype, "name") else str(dtype)
