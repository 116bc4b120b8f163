"""The form of a sparse gradient summed over micro-batches is the whole batch's, as Keras' step gives it (no MPI).

Keras' TensorFlow optimizers update ``IndexedSlices`` slice by slice (Adam
squares each slice before an id's slices are added), so the form decides the
update, not only the value. A lookup whose ids come from the batch has one
slice per row's id (micro-batches' slices joined); a lookup of ids known
without the batch (ViT's positions) has one slice per id for the whole batch
(micro-batches' slices of an id summed). Multi-rank equivalence, every
optimizer: ``tests/mpi_scripts/sparse_optimizers.py``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_pipe.errors import PipelineConfigError
from keras_pipe.stage.gradients import FIXED, MIXED, ROWS, GradientSum, joined, lookup_form

TABLE = tf.Variable(tf.random.stateless_normal((6, 3), seed=(1, 2)))


def _form_of(function, spec):
    forms = []

    def trace(x):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(function(x))
        forms.append(lookup_form(tape.gradient(total, TABLE).indices))
        return total

    tf.function(trace, autograph=False).get_concrete_function(spec)
    return forms[0]


def test_a_lookups_form_is_read_from_its_graph_without_a_batch_size():
    ids = tf.TensorSpec([None, 4], tf.int32)
    rows = lambda x: tf.gather(TABLE, x)  # noqa: E731
    fixed = lambda x: tf.cast(x, tf.float32)[..., None] + tf.gather(TABLE, tf.range(4))[None]  # noqa: E731
    assert _form_of(rows, ids) == ROWS
    assert _form_of(fixed, ids) == FIXED
    assert _form_of(lambda x: rows(x) + fixed(x), ids) == MIXED
    assert _form_of(lambda x: rows(x) + rows(x + 1), ids) == ROWS  # two lookups from the batch, joined


def _slices(values, indices):
    return tf.IndexedSlices(tf.constant(values, tf.float32), tf.constant(indices, tf.int64), tf.constant([6, 1]))


def test_joined_slices_rows_and_fixed_ids():
    a, b = _slices([[1.0], [2.0]], [0, 3]), _slices([[4.0], [8.0]], [0, 3])
    rows = joined([a, b], ROWS)
    assert rows.indices.numpy().tolist() == [0, 3, 0, 3] and rows.values.numpy().ravel().tolist() == [1, 2, 4, 8]
    fixed = joined([a, b, _slices(np.zeros((0, 1)), [])], FIXED)  # (a replica with no share sends no slices)
    assert fixed.indices.numpy().tolist() == [0, 3] and fixed.values.numpy().ravel().tolist() == [5, 10]
    with pytest.raises(PipelineConfigError, match="other ids"):
        joined([a, _slices([[1.0], [1.0]], [0, 2])], FIXED)  # checked on the real indices
    with pytest.raises(PipelineConfigError, match="both with ids read from the batch"):
        joined([a, b], MIXED)


@pytest.mark.parametrize("form", [ROWS, FIXED])
def test_micro_batches_summed_give_adams_whole_batch_update(form):
    """Adam stepped with the micro-batches' sum equals Adam stepped with the whole batch's tape gradient."""
    rng = np.random.default_rng(0)
    ids = tf.constant(rng.integers(0, 6, size=(8, 4)), tf.int32)
    weights = tf.constant(rng.normal(size=(8, 4, 3)), tf.float32)
    lookup = (lambda x: tf.gather(TABLE, x)) if form == ROWS else (lambda x: tf.gather(TABLE, tf.range(4))[None])

    def gradient(rows):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(tf.square(lookup(tf.gather(ids, rows))) * tf.gather(weights, rows))
        return tape.gradient(total, TABLE)

    whole = gradient(tf.range(8))
    summed = GradientSum([TABLE], lambda key, f: f, lambda: {0: form})
    for part in (tf.range(0, 4), tf.range(4, 8)):
        summed.add([gradient(part)])
    (parts,) = summed.result()
    assert isinstance(parts, tf.IndexedSlices) and parts.indices.shape == whole.indices.shape

    def adam_step(grad):
        variable = keras.Variable(TABLE.numpy())
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.apply([grad], [variable])
        optimizer.apply([grad], [variable])
        return variable.numpy()

    np.testing.assert_allclose(adam_step(parts), adam_step(whole), rtol=1e-5, atol=1e-6)
    if form == FIXED:  # the joined slices (what the pipeline gave before) step elsewhere
        concatenated = joined([gradient(tf.range(0, 4)), gradient(tf.range(4, 8))], ROWS)
        assert np.abs(adam_step(concatenated) - adam_step(whole)).max() > 1e-3


def test_the_modules_examples_run():
    import doctest

    from keras_pipe.stage import gradients

    assert doctest.testmod(gradients).failed == 0
