"""The datasets Keras' loop iterates get tf.data's autotuning off, unless the user chose (one process, no MPI)."""

import doctest

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TFEpochIterator

from keras_pipe import PipelineModel
from keras_pipe.model import datasets


def test_the_docstring_examples():
    assert doctest.testmod(datasets).failed == 0


def test_keras_epoch_iterator_gets_arrays_and_datasets_without_autotuning_unless_the_user_set_it():
    # TFEpochIterator is what Keras' fit/evaluate/predict iterate, made as they make it.
    model = PipelineModel([keras.Input((3,)), keras.layers.Dense(2)], num_microbatches=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)

    def iterated(**data):
        iterator = TFEpochIterator(distribute_strategy=model.distribute_strategy, **data)
        return iterator._distributed_dataset.options().autotune.enabled

    assert iterated(x=x, y=y, batch_size=4) is False
    assert iterated(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(4)) is False
    tuned = tf.data.Options()
    tuned.autotune.enabled = True
    assert iterated(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(4).with_options(tuned)) is True
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.distribute_strategy.num_replicas_in_sync == 1  # (the rest is TensorFlow's default strategy)
