"""Each loss term and its divisor, computed as Keras computes them: micro-batches add up to the batch (one process)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_pipe import compat  # noqa: E402
from keras_pipe.stage.losses import reduce_with_divisor  # noqa: E402

rng = np.random.default_rng(0)
y_true = rng.integers(0, 4, size=(8, 5))
y_pred = tf.nn.softmax(tf.constant(rng.normal(size=(8, 5, 4)), tf.float32))
weights = tf.constant(rng.uniform(0.5, 1.5, size=(8, 5)), tf.float32)
mask = tf.constant(rng.uniform(size=(8, 5)) > 0.3)


def masked(tensor, rows):
    tensor = tf.identity(tensor[rows])
    compat.set_mask(tensor, mask[rows])
    return tensor


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum"])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_weights", [False, True])
def test_micro_batches_combine_into_the_batchs_loss(reduction, with_mask, with_weights):
    loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
    rows = [slice(0, 3), slice(3, 8)]
    predictions = [masked(y_pred, r) if with_mask else y_pred[r] for r in rows]
    parts = [
        reduce_with_divisor(loss, y_true[r], p, weights[r] if with_weights else None) for r, p in zip(rows, predictions)
    ]
    for r, p, (value, _) in zip(rows, predictions, parts):  # each micro-batch's value is Keras' own
        np.testing.assert_allclose(value, loss(y_true[r], p, weights[r] if with_weights else None), rtol=1e-6)
    whole = loss(y_true, masked(y_pred, slice(0, 8)) if with_mask else y_pred, weights if with_weights else None)
    if reduction == "sum":
        combined = sum(float(v) for v, _ in parts)
    else:
        combined = sum(float(v) * float(d) for v, d in parts) / sum(float(d) for _, d in parts)
    np.testing.assert_allclose(combined, whole, rtol=1e-6)
