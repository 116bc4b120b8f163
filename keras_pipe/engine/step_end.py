"""Internal: the end of a stage's step, after its actions: regularization, gradient sums, the update.

What remains of a training step once the schedule's actions have run, on
each stage: the weight regularizers' loss (once per batch, one replica),
the gradients summed over the stage's replicas and over the stages that
hold one weight, the whole model's gradient norm where ``global_clipnorm``
needs it and whether every stage's gradients are finite where a
``LossScaleOptimizer`` needs that, then the optimizer's update, or only its
step counted on a stage without weights. Where nothing has to be summed
first, the stage's last ``W`` applies the update in its own program
(:meth:`StepEnd.plan`) and the step ends with nothing left to do.

The executor holds one :class:`StepEnd`, made with what every step's end
needs (the chunks, the reducers, the pipeline's sum, the status record),
and calls it with what one step needs: :meth:`StepEnd.plan` before the
actions (a :class:`StepPlan`, which the ``W`` actions read too), then
:meth:`StepEnd.finish` after them.

>>> clip_scale(16.0, 2.0)  # the whole model's norm is 4: every gradient is halved
0.5
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.engine.batch import Batch, StepResult
from keras_pipe.engine.merged import MergedChunks
from keras_pipe.schedules.actions import Action, Kind
from keras_pipe.stage.update import apply_together, count_step, separable


@dataclass(frozen=True)
class StepPlan:
    """What one step's end is planned with, before its actions run (the ``W`` actions read it too)."""

    step: int  # the executor's step count, for the status record
    loss_scale: float  # every gradient of a training step is multiplied by it (mixed_float16)
    last_weights: dict  # chunk -> position of the step's last W action (it may apply the update)
    fused: frozenset  # the chunks whose last W applies the update in its own program
    counting: int | None  # the position of the W that counts the optimizer's step (None: the end counts it)
    traced: bool  # a tracer listens: the update is waited for, so that its span shows its cost


class StepEnd:
    """The end of a stage's step, after its actions: regularization, sums, the update (the executor holds one).

    Args:
        chunks: this rank's :class:`~keras_pipe.engine.chunks.Chunk` list (one, but with a chunked schedule).
        reducer: sums gradients over the stage's replicas (``None`` with one replica).
        tied: sums the gradients of weights other stages hold too (``None`` where there are none).
        pipeline_sum: sums a float64 vector over the stages of this pipeline (the whole model's
            gradient norm, the loss scale's finiteness check).
        status: an object whose ``doing`` attribute stall reports read (the world communicator).
        where: how this rank's place is named in those reports.
        span: ``span(name, microbatch, began)`` reports a span to the tracer, if one listens.
    """

    def __init__(self, chunks: list, reducer, tied, pipeline_sum, status, where: str, span):
        self.chunks = chunks
        self.compute = chunks[0].compute
        self.reducer = reducer
        self.tied = tied
        self.pipeline_sum = pipeline_sum
        self.status = status
        self.where = where
        self._span = span

    def plan(self, actions: list[Action], batch: Batch, step: int, traced: bool) -> StepPlan:
        """What step ``step``'s end will do, from its actions: the loss scale, and which ``W`` updates."""
        last_weights = {a.chunk: p for p, a in enumerate(actions) if a.kind is Kind.BACKWARD_WEIGHT}  # (positions grow)
        fused, counting = self._plan_update(batch, last_weights)
        scale = loss_scale(batch.optimizer) if batch.phase == "train" else 1.0
        return StepPlan(step, scale, last_weights, frozenset(fused), counting, traced)

    def _plan_update(self, batch: Batch, last_weights: dict) -> tuple[set, int | None]:
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
            return {0} if 0 in last_weights else set(), last_weights.get(0)
        if not separable(batch.optimizer) or MergedChunks([chunk.compute for chunk in self.chunks]).shared:
            return set(), None  # (a weight two chunks hold takes one update, of both chunks' gradients)
        weighted = [c for c, chunk in enumerate(self.chunks) if chunk.compute.trainable_variables]
        fused = {c for c in weighted if c in last_weights and self.chunks[c].compute.gradients.empty}
        if not fused or len(fused) < len(weighted):
            return fused, None
        return fused, max(last_weights[c] for c in fused)

    def finish(self, batch: Batch, result: StepResult, plan: StepPlan) -> None:
        """Ends the step once its actions have run: regularization, the masked loss's division, the update."""
        training = batch.phase == "train"
        for chunk in self.chunks:
            self.count_regularization(chunk.compute, batch, result, plan, before_actions=False)
        if batch.whole_batch_loss and any(chunk.is_last for chunk in self.chunks):
            divisors = self.batch_divisors(batch, result, plan.step)
            values = np.divide(result.sums, divisors, out=np.zeros_like(result.sums), where=divisors > 0)
            result.terms = values
            result.loss_part += float(np.dot(values, batch.term_weights))
        if not training:
            return
        if len(self.chunks) > 1:
            self._update_chunks(batch, plan)
            return
        compute = self.compute
        if not compute.trainable_variables:
            finite = True
            if needs_whole_model(batch):  # this stage's share of the norm: none, but the others wait for it
                finite = bool(np.isfinite(self.pipeline_sum(np.zeros(1))[0]))
            count_step(batch.optimizer, finite)
            return
        applied = bool(plan.last_weights) and self.reducer is None and self.tied is None and compute.gradients.empty
        if applied:
            return  # the last W updated the weights itself
        step = plan.step
        summed = None
        if self.reducer is not None:
            self.status.doing = f"train step {step}, {self.where}: summing gradients over replicas"
            began = time.perf_counter()
            grads = compute.gradients.result()
            forms = compute.sparse_forms() if any(isinstance(g, tf.IndexedSlices) for g in grads) else {}
            summed = self.reducer.sum(grads, compute.gradients.computed, forms, compute.trainable_variables)
            self._span("allreduce", -1, began)
        if self.tied is not None:
            self.status.doing = f"train step {step}, {self.where}: summing the gradients of shared weights"
            began = time.perf_counter()
            summed = self.tied.sum(
                summed if summed is not None else compute.gradients.result(), compute.trainable_variables
            )
            self._span("allreduce", -1, began)
        scale = None
        if needs_whole_model(batch):
            summed = summed if summed is not None else compute.gradients.result()
            self.status.doing = f"train step {step}, {self.where}: the whole model's gradient norm"
            counted = self.tied.counted(compute.trainable_variables) if self.tied is not None else None
            squares = self.pipeline_sum(np.array([compute.squared_norm(summed, counted)], np.float64))[0]
            scale = whole_model_scale(batch.optimizer, squares, plan.loss_scale)
        self.status.doing = f"train step {step}, {self.where}: optimizer update"
        began = time.perf_counter()
        compute.apply(batch.optimizer, summed, scale)
        if plan.traced:
            compute.trainable_variables[0].numpy()
        self._span("optimizer", -1, began)

    def _update_chunks(self, batch: Batch, plan: StepPlan) -> None:
        """Several chunks: one optimizer step over the rank's weights, each once (:mod:`keras_pipe.engine.merged`).

        A weight two chunks hold gets both chunks' gradients; the list is
        summed over replicas and over the other ranks holding a weight, as one
        chunk's is, and the whole model's norm taken from it.
        """
        computes = [chunk.compute for c, chunk in enumerate(self.chunks) if c not in plan.fused]
        if plan.fused and plan.counting is not None:
            return  # every chunk's last W updated its weights, and one counted the step
        merged = MergedChunks(computes)
        variables, grads = merged.variables, merged.gradients()
        step = plan.step
        if self.reducer is not None:
            self.status.doing = f"train step {step}, {self.where}: summing gradients over replicas"
            began = time.perf_counter()
            grads = self.reducer.sum(grads, merged.computed, merged.sparse_forms(grads), variables)
            self._span("allreduce", -1, began)
        if self.tied is not None:
            self.status.doing = f"train step {step}, {self.where}: summing the gradients of shared weights"
            began = time.perf_counter()
            grads = self.tied.sum(grads, variables)
            self._span("allreduce", -1, began)
        scale = None
        if needs_whole_model(batch):
            self.status.doing = f"train step {step}, {self.where}: the whole model's gradient norm"
            counted = self.tied.counted(variables) if self.tied is not None else None
            squares = computes[0].squared_norm(grads, counted) if variables else 0.0
            squares = self.pipeline_sum(np.array([squares], np.float64))[0]
            scale = whole_model_scale(batch.optimizer, squares, plan.loss_scale)
        self.status.doing = f"train step {step}, {self.where}: optimizer update"
        began = time.perf_counter()
        if all(g is None for g in grads):
            count_step(batch.optimizer, scale is None or bool(np.isfinite(scale)))
            merged.reset()
        else:
            apply_together(computes, batch.optimizer, grads, scale, variables)  # (which resets the sums)
        self._span("optimizer", -1, began)

    def count_regularization(
        self, compute, batch: Batch, result: StepResult, plan: StepPlan, before_actions: bool
    ) -> None:
        """Adds the weight regularizers' loss, from the weights before the update, once per batch.

        A recorded backward adds their gradients at the end of the step; a
        split backward adds them in its last ``W``, which may also update the
        weights, so its loss is read before the actions run.
        """
        if not (batch.regularize and compute.has_weight_regularizers and batch.phase != "predict"):
            return
        recorded_training = batch.phase == "train" and not compute.split
        if before_actions != recorded_training:
            loss = compute.regularization_loss() if before_actions else compute.add_regularization(plan.loss_scale)
            result.loss_part += float(loss)

    def batch_divisors(self, batch: Batch, result: StepResult, step: int) -> np.ndarray:
        """Last stage, ``whole_batch_loss``: the global batch's divisors, summed over replicas once per step.

        Every replica's last stage asks once per step, at its first backward
        or else (evaluation, or a replica with no share) at the end of the step.
        """
        if result.batch_divisors is None:
            total = result.divisors
            if self.reducer is not None:
                self.status.doing = f"{batch.phase} step {step}, {self.where}: counting the masked loss's entries"
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
