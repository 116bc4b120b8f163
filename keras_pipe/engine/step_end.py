"""Internal: the end of a stage's step, after its actions: regularization, gradient sums, the update.

What remains of a training step once the schedule's actions have run, on
each stage: the weight regularizers' loss (once per batch, one replica),
the gradients summed over the stage's replicas and over the stages that
hold one weight, the whole model's gradient norm where ``global_clipnorm``
needs it and whether every stage's gradients are finite where a
``LossScaleOptimizer`` needs that, then the optimizer's update, or only its
step counted on a stage without weights. Where nothing has to be summed
first, the stage's last ``W`` applies the update in its own program
(:meth:`StepEnd._plan_update`) and the step ends with nothing left to do.

>>> clip_scale(16.0, 2.0)  # the whole model's norm is 4: every gradient is halved
0.5
"""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.engine.batch import Batch, StepResult
from keras_pipe.stage.update import apply_together, count_step, separable


class StepEnd:
    """The end of :class:`~keras_pipe.engine.executor.Executor`'s step (its chunks, reducer, tied, status...)."""

    def _plan_update(self, batch: Batch) -> tuple[set, int | None]:
        """Which chunks' last ``W`` apply their update themselves, and the position of the one that counts the step.

        A last ``W`` updates the weights in its own program when nothing must
        be summed with other ranks first (replicas, shared weights, the whole
        model's norm). With several chunks each updates its own weights, so
        only where the optimizer updates each weight from its own gradient
        (:func:`~keras_pipe.stage.update.separable`), and one of them, the last,
        counts ``iterations``; a chunk without a ``W`` (its backward
        recorded) is updated at the end of the step, which then counts it.
        """
        if batch.phase != "train" or self.reducer is not None or self.tied is not None or needs_whole_model(batch):
            return set(), None
        if len(self.chunks) == 1:
            return {0} if 0 in self._last_weights else set(), self._last_weights.get(0)
        if not separable(batch.optimizer):
            return set(), None
        weighted = [c for c, chunk in enumerate(self.chunks) if chunk.compute.trainable_variables]
        fused = {c for c in weighted if c in self._last_weights and self.chunks[c].compute.gradients.empty}
        if not fused or len(fused) < len(weighted):
            return fused, None
        return fused, max(self._last_weights[c] for c in fused)

    def _end_step(self, batch: Batch, result: StepResult) -> None:
        training = batch.phase == "train"
        for chunk in self.chunks:
            self._count_regularization(chunk.compute, batch, result, before_actions=False)
        if batch.whole_batch_loss and any(chunk.is_last for chunk in self.chunks):
            divisors = self._batch_divisors(batch, result)
            values = np.divide(result.sums, divisors, out=np.zeros_like(result.sums), where=divisors > 0)
            result.terms = values
            result.loss_part += float(np.dot(values, batch.term_weights))
        if not training:
            return
        if len(self.chunks) > 1:
            self._update_chunks(batch)
            return
        compute = self.compute
        if not compute.trainable_variables:
            finite = True
            if needs_whole_model(batch):  # this stage's share of the norm: none, but the others wait for it
                finite = bool(np.isfinite(self.pipeline_sum(np.zeros(1))[0]))
            count_step(batch.optimizer, finite)
            return
        applied = bool(self._last_weights) and self.reducer is None and self.tied is None and compute.gradients.empty
        if applied:
            return  # the last W updated the weights itself
        summed = None
        if self.reducer is not None:
            self.status.doing = f"train step {self.step}, {self.where}: summing gradients over replicas"
            began = time.perf_counter()
            grads = compute.gradients.result()
            forms = compute.sparse_forms() if any(isinstance(g, tf.IndexedSlices) for g in grads) else {}
            summed = self.reducer.sum(grads, compute.gradients.computed, forms, compute.trainable_variables)
            self._span("allreduce", -1, began)
        if self.tied is not None:
            self.status.doing = f"train step {self.step}, {self.where}: summing the gradients of shared weights"
            began = time.perf_counter()
            summed = self.tied.sum(
                summed if summed is not None else compute.gradients.result(), compute.trainable_variables
            )
            self._span("allreduce", -1, began)
        scale = None
        if needs_whole_model(batch):
            summed = summed if summed is not None else compute.gradients.result()
            self.status.doing = f"train step {self.step}, {self.where}: the whole model's gradient norm"
            counted = self.tied.counted(compute.trainable_variables) if self.tied is not None else None
            squares = self.pipeline_sum(np.array([compute.squared_norm(summed, counted)], np.float64))[0]
            scale = whole_model_scale(batch.optimizer, squares, self._loss_scale)
        self.status.doing = f"train step {self.step}, {self.where}: optimizer update"
        began = time.perf_counter()
        compute.apply(batch.optimizer, summed, scale)
        if self.tracer is not None:
            compute.trainable_variables[0].numpy()
        self._span("optimizer", -1, began)

    def _update_chunks(self, batch: Batch) -> None:
        """Several chunks: one optimizer step over every chunk's summed gradients (the whole model's norm first)."""
        computes = [chunk.compute for c, chunk in enumerate(self.chunks) if c not in self._fused]
        if self._fused and self._counting is not None:
            return  # every chunk's last W updated its weights, and one counted the step
        grads = [compute.gradients.result() if compute.trainable_variables else [] for compute in computes]
        scale = None
        if needs_whole_model(batch):
            self.status.doing = f"train step {self.step}, {self.where}: the whole model's gradient norm"
            squares = sum(compute.squared_norm(g) for compute, g in zip(computes, grads) if g)
            squares = self.pipeline_sum(np.array([squares], np.float64))[0]
            scale = whole_model_scale(batch.optimizer, squares, self._loss_scale)
        self.status.doing = f"train step {self.step}, {self.where}: optimizer update"
        began = time.perf_counter()
        if not any(grads):
            count_step(batch.optimizer, scale is None or bool(np.isfinite(scale)))
        else:
            apply_together(computes, batch.optimizer, grads, scale)
        self._span("optimizer", -1, began)

    def _count_regularization(self, compute, batch: Batch, result: StepResult, before_actions: bool) -> None:
        """Adds the weight regularizers' loss, from the weights before the update, once per batch.

        A recorded backward adds their gradients at the end of the step; a
        split backward adds them in its last ``W``, which may also update the
        weights, so its loss is read before the actions run.
        """
        if not (batch.regularize and compute.has_weight_regularizers and batch.phase != "predict"):
            return
        recorded_training = batch.phase == "train" and not compute.split
        if before_actions != recorded_training:
            loss = compute.regularization_loss() if before_actions else compute.add_regularization(self._loss_scale)
            result.loss_part += float(loss)

    def _batch_divisors(self, batch: Batch, result: StepResult) -> np.ndarray:
        """Last stage, ``whole_batch_loss``: the global batch's divisors, summed over replicas once per step.

        Every replica's last stage asks once per step, at its first backward
        or else (evaluation, or a replica with no share) at the end of the step.
        """
        if result.batch_divisors is None:
            total = result.divisors
            if self.reducer is not None:
                self.status.doing = f"{batch.phase} step {self.step}, {self.where}: counting the masked loss's entries"
                total = self.reducer.sum_values(np.asarray(total, np.float64))
            result.batch_divisors = np.asarray(total, np.float64)
        return result.batch_divisors


def needs_whole_model(batch: Batch) -> bool:
    """Whether the update needs the whole model's gradient first: no fused W+update then.

    ``global_clipnorm`` needs its norm; a ``LossScaleOptimizer`` (``mixed_float16``)
    needs to know whether every stage's gradients are finite, so that every stage
    applies the step, or every stage skips it and lowers the scale.
    """
    optimizer = batch.optimizer
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or bool(_global_clipnorm(optimizer))


def _global_clipnorm(optimizer):
    return getattr(getattr(optimizer, "inner_optimizer", optimizer), "global_clipnorm", None)


def loss_scale(optimizer) -> float:
    """What the optimizer multiplies the loss by before gradients are taken (``mixed_float16``'s loss scale).

    1 without an op for an optimizer that scales nothing (the common case: this runs every step).
    """
    if not hasattr(optimizer, "scale_loss"):
        return 1.0
    plain = getattr(type(optimizer), "scale_loss", None) is keras.optimizers.Optimizer.scale_loss
    if plain and optimizer.loss_scale_factor is None:
        return 1.0  # what Keras' scale_loss would return
    return float(optimizer.scale_loss(tf.constant(1.0, tf.float32)))


def whole_model_scale(optimizer, squared_norm: float, loss_scale: float) -> float:
    """What this stage's gradients are multiplied by before its optimizer sees them.

    NaN when any stage's gradients are not finite (so that a loss-scale optimizer
    skips the step and lowers its scale on every stage, as it does for the whole
    model); else the ``global_clipnorm`` factor of the whole model's (unscaled)
    norm, or 1.
    """
    if not np.isfinite(squared_norm):
        return float("nan")
    clipnorm = _global_clipnorm(optimizer)
    return clip_scale(squared_norm / loss_scale**2, clipnorm) if clipnorm else 1.0


def clip_scale(squared_norm: float, clipnorm: float) -> float:
    """What every gradient is multiplied by so that the whole model's norm is at most ``clipnorm``.

    As Keras' ``clip_by_global_norm`` (``keras/src/optimizers/base_optimizer.py``):
    ``clipnorm * min(1 / norm, 1 / clipnorm)``, and NaN when the norm is (so
    that a non-finite gradient stays non-finite).

    >>> clip_scale(16.0, 2.0), clip_scale(1.0, 2.0)
    (0.5, 1.0)
    """
    norm = float(np.sqrt(squared_norm))
    if not np.isfinite(norm):
        return float("nan")
    return clipnorm * min(1.0 / norm if norm else float("inf"), 1.0 / clipnorm)
