"""Internal: TensorFlow's internals and a tensor's Keras mask: the global seed, a ``tf.Variable``, calling a trace."""

from __future__ import annotations

import keras
import tensorflow as tf


def global_seed():
    """TensorFlow's global seed, or ``None`` (``tensorflow.python.eager.context.global_seed``, TF 2.x).

    Why: replicas must shuffle alike; ``fit`` seeds TensorFlow only when the
    script did not.
    """
    from tensorflow.python.eager import context

    return context.global_seed()


def variable_handle(variable):
    """The ``tf.Variable`` behind a Keras variable (``KerasVariable.value`` is it on the TF backend)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def call_concrete(concrete, flat_inputs: list):
    """Calls a traced ``tf.function`` graph with its flat tensor inputs (``ConcreteFunction._call_flat``, TF 2.x).

    Why: a ``tf.function`` call first matches its arguments against its
    traces, which costs 100-200 us a call; keras_pipe keeps the traces
    itself, by shape, and calls them directly (62 us for a small program).
    """
    return concrete._call_flat(flat_inputs, concrete.captured_inputs)


def executing_eagerly() -> bool:
    """Whether code runs op by op, not inside a ``tf.function`` being traced."""
    return tf.executing_eagerly()


def get_mask(tensor):
    """The Keras mask a tensor carries, or ``None`` (``keras.src.backend.get_keras_mask``, Keras 3.0-3.15).

    Why: a mask (``Embedding(mask_zero=True)``, ``Masking``) rides on the
    tensor as an attribute; at a stage boundary it must travel beside it.
    """
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def set_mask(tensor, mask) -> None:
    """Attaches a Keras mask to a tensor (``keras.src.backend.set_keras_mask``, Keras 3.0-3.15)."""
    from keras.src.backend import set_keras_mask

    set_keras_mask(tensor, mask)
