"""Internal: the end of a stage's step — batched weight gradients, weight regularization, the update.

:class:`StageUpdate` is the part of :class:`~keras_pipe.compute.StageCompute`
that works on the step's gradients rather than on micro-batches: the
batched ``W`` of a split backward (one pass over many micro-batches, fused
with the optimizer update when nothing else must be known first), the
weight regularizers' loss and gradients (counted once per batch, as Keras
does), this stage's share of the whole model's gradient norm, and the
update itself.
"""

from __future__ import annotations

import tensorflow as tf

from keras_pipe import compat, replay


class StageUpdate:
    """Gradient-level methods of a stage's compute (a mixin: ``StageCompute`` provides the state)."""

    def weights(
        self, microbatches, activity_scale: float, regularize: bool, optimizer=None, loss_scale: float = 1.0
    ) -> None:
        """``W`` over ``microbatches``: adds their weight gradients (and, if ``regularize``, the weight regularizers').

        With an ``optimizer`` (the step's last ``W`` and no replica or other
        stage to wait for) the gradients go straight into its update, in the
        same program.
        """
        parts = [self._for_weights.pop(i) for i in microbatches]
        if not self.trainable_variables:
            return
        # per weighted step, its inputs and output gradients over the micro-batches
        count = len(self._weighted)
        inputs = [[p[k][0] for p in parts] if parts[0][k] is not None else None for k in range(count)]
        grads = [[p[k][1] for p in parts] if parts[0][k] is not None else None for k in range(count)]
        weighted = list(self._weighted)

        def weight_grads(inputs, grads, activity_scale, loss_scale):
            full_in, full_g = [None] * len(self.steps), [None] * len(self.steps)
            for position, k in enumerate(weighted):
                full_in[k], full_g[k] = inputs[position], grads[position]
            result = replay.weight_gradients(self.steps, full_in, full_g, activity_scale, self.trainable_variables)
            if regularize:
                regularizers = self._regularization_gradients()
                result = [
                    tf.convert_to_tensor(g) + r * tf.cast(loss_scale, r.dtype) if v.regularizer is not None else g
                    for g, r, v in zip(result, regularizers, self.trainable_variables)
                ]
            return result

        scales = (tf.constant(activity_scale, tf.float32), tf.constant(loss_scale, tf.float32))
        if optimizer is not None and self.gradients.empty:

            def weights_and_update(inputs, grads, activity_scale, loss_scale):
                optimizer.apply(weight_grads(inputs, grads, activity_scale, loss_scale), self.trainable_variables)

            self._program(("weights_update", id(optimizer), regularize), weights_and_update)(inputs, grads, *scales)
            return
        result = self._program(("weights", regularize), weight_grads)(inputs, grads, *scales)
        self.gradients.add(result)
        if optimizer is not None:
            self.apply(optimizer)

    def add_regularization(self, loss_scale: float = 1.0) -> tf.Tensor:
        """Adds the weight regularizers' gradients (recorded backward), times ``loss_scale``; returns their loss."""

        def regularization(loss_scale):
            with tf.GradientTape() as tape:
                loss = self._regularization_loss()
                scaled = loss * loss_scale
            return loss, tape.gradient(scaled, self.trainable_variables)

        loss, grads = self._program("regularization_gradients", regularization)(tf.constant(loss_scale, tf.float32))
        self.gradients.add(
            [tf.zeros(v.shape, v.dtype) if g is None else g for g, v in zip(grads, self.trainable_variables)]
        )
        return loss

    def regularization_loss(self) -> tf.Tensor:
        """The loss of this stage's weight regularizers (counted once per batch, as Keras does)."""
        return self._program("regularization", self._regularization_loss)()

    def _regularization_loss(self):
        loss = tf.constant(0.0, tf.float32)
        for layer in self.regularized_layers:
            for term in compat.weight_regularization_losses(layer):
                loss += tf.cast(term, tf.float32)
        return loss

    def _regularization_gradients(self):
        handles = [compat.variable_handle(v) for v in self.trainable_variables]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(handles)
            loss = self._regularization_loss()
        grads = tape.gradient(loss, handles)
        return [tf.zeros(v.shape, v.dtype) if g is None else g for g, v in zip(grads, self.trainable_variables)]

    def apply(self, optimizer, grads=None, scale: float | None = None) -> None:
        """One optimizer step with ``grads`` (summed over replicas) or this step's summed gradients.

        ``scale``: multiplies every gradient first (the whole model's ``global_clipnorm``).
        """
        if not self.trainable_variables:
            return
        grads = list(grads) if grads is not None else self.gradients.result()

        def update(*grads):
            optimizer.apply(list(grads), self.trainable_variables)

        def scaled_update(scale, *grads):
            optimizer.apply([_scaled(g, scale) for g in grads], self.trainable_variables)

        if scale is None:
            self._program(("apply", id(optimizer)), update)(*grads)
        else:
            self._program(("scaled_apply", id(optimizer)), scaled_update)(tf.constant(scale, tf.float32), *grads)
        self.gradients.reset()

    def squared_norm(self, grads, counted=None) -> float:
        """This stage's share of the whole model's squared gradient norm, as Keras' ``global_norm`` counts it.

        Mirrors ``keras/src/optimizers/base_optimizer.py``'s ``global_norm``:
        ``sum(square(g))`` per gradient, where a sparse gradient
        (``IndexedSlices``, an ``Embedding``'s) is squared as it is, so a
        token id repeated in the batch counts once per occurrence. In float64,
        so that a large loss scale cannot overflow the sum. ``counted``: for
        each gradient, whether this stage counts it (a weight several stages
        hold is counted by one).
        """
        grads = [g for g, c in zip(grads, counted or [True] * len(grads)) if c]
        if not grads:
            return 0.0

        def squares(*grads):
            return tf.add_n([tf.reduce_sum(tf.square(tf.cast(_values(g), tf.float64))) for g in grads])

        return float(self._program("squared_norm", squares)(*grads))


def _values(grad):
    """What Keras squares: a sparse gradient's slices as they are, a dense one whole."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _scaled(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)
