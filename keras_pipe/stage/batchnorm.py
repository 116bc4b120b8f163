"""Batch normalization whose moving statistics are those of the whole batch, as torchgpipe's deferred batch norm.

Under a pipeline, Keras' ``BatchNormalization`` sees one micro-batch at a
time: it normalizes each with that micro-batch's statistics (as GPipe does)
and moves its moving mean and variance once per micro-batch, ending each step
with statistics weighted towards the last micro-batch.
:class:`DeferredBatchNormalization` still normalizes each micro-batch with
its own statistics (what can be exact without a second pass), but moves the
moving statistics once per batch, with the mean and variance of the whole
batch, combined from the micro-batches': after a step, its moving statistics
equal those of ``BatchNormalization`` in ``keras.Sequential`` on the same
batch, to round-off. In one process (no pipeline) it is ``BatchNormalization``.

Example:

```python
from keras_pipe.stage.batchnorm import DeferredBatchNormalization

model = PipelineModel([..., keras.layers.Dense(64), DeferredBatchNormalization(), ...], num_microbatches=4)
```
"""

from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="keras_pipe")
class DeferredBatchNormalization(keras.layers.BatchNormalization):
    """``BatchNormalization`` whose moving statistics move once per batch, by the whole batch's (see the module)."""

    def build(self, input_shape):
        super().build(input_shape)
        shape = tuple(self.moving_mean.shape)
        # Plain TensorFlow variables, not the layer's weights: a step's running sums are not model state.
        object.__setattr__(self, "_deferring", False)
        object.__setattr__(
            self,
            "_sums",
            [tf.Variable(tf.zeros(shape), trainable=False) for _ in range(2)] + [tf.Variable(0.0, trainable=False)],
        )
        object.__setattr__(self, "_before", [tf.Variable(tf.zeros(shape), trainable=False) for _ in range(2)])

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        if getattr(self, "_deferring", False) and not self.renorm:
            if mask is None:
                count = tf.cast(tf.size(inputs) // tf.size(mean), tf.float32)
            else:
                count = tf.reduce_sum(tf.cast(mask, tf.float32))
            mean_sum, square_sum, total = self._sums
            mean_sum.assign_add(tf.cast(mean, tf.float32) * count)
            square_sum.assign_add(tf.cast(variance + tf.square(mean), tf.float32) * count)
            total.assign_add(count)
        return mean, variance

    # -- called by the pipeline around each training step --------------------

    def begin_batch(self) -> None:
        """Before a training step's first micro-batch: remember the moving statistics, clear the sums."""
        self._deferring = True
        self._before[0].assign(self.moving_mean.value)
        self._before[1].assign(self.moving_variance.value)
        for variable in self._sums:
            variable.assign(tf.zeros_like(variable))

    def commit_batch(self) -> None:
        """After the step: the moving statistics move once, by the whole batch's mean and variance."""
        mean_sum, square_sum, total = self._sums
        if float(total.numpy()) == 0:
            return
        mean = mean_sum / total
        variance = square_sum / total - tf.square(mean)
        momentum = self.momentum
        self.moving_mean.assign(self._before[0] * momentum + mean * (1.0 - momentum))
        self.moving_variance.assign(self._before[1] * momentum + variance * (1.0 - momentum))

    def step_variables(self) -> list:
        """The variables a micro-batch's forward updates (a recomputed forward must restore them)."""
        return list(self._sums)
