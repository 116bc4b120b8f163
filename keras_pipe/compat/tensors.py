"""Internal: TensorFlow's internals and a tensor's Keras mask: the global seed, a ``tf.Variable``, calling a trace."""

from __future__ import annotations

import contextlib

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


def borrowed_tensor(array):
    """A tensor over ``array``'s own buffer (DLPack); ``array`` itself where it cannot be (a buffer not on a 64-byte
    boundary, as NumPy's own are not: TensorFlow's kernels check it; a read-only or non-contiguous array; a dtype
    DLPack lacks, as bfloat16 in NumPy).

    Why: converting an array to a tensor copies it; :func:`assign_in_place`
    copies a value read from a file or received from rank 0 straight into
    the variable's buffer.
    """
    import numpy as np

    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or not array.flags.writeable:
        return array
    if array.size == 0 or array.ctypes.data % 64:  # (an assigned variable may keep the buffer as its own)
        return array
    try:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError):
        return array


def read_into(dataset, allocate):
    """An HDF5 dataset's value read straight into ``allocate(shape, dtype)``'s array, or ``None`` where it is not a
    plain array (a scalar, an empty one, Keras' bfloat16 stored as its bits with a ``dtype`` attribute).

    Why: read with ``np.array`` (as Keras' stores read) the value lands in
    NumPy's own buffer, which TensorFlow cannot borrow
    (:func:`borrowed_tensor`): assigning it copies it again.
    """
    if not hasattr(dataset, "read_direct") or not dataset.shape or dataset.size == 0:
        return None
    if dataset.attrs.get("dtype") == "bfloat16":
        return None
    out = allocate(dataset.shape, dataset.dtype)
    dataset.read_direct(out)
    return out


def assign_in_place(variable, value) -> bool:
    """Copies ``value`` (a NumPy array of the variable's shape and dtype) into ``variable``'s own buffer, a strided
    assignment over all of it; ``False`` (nothing done) where it cannot, for the caller to assign as Keras does
    (another shape, whose error is Keras'; another dtype; a variable that is not TensorFlow's; outside eager mode).

    Why: ``Variable.assign`` (Keras 3, TensorFlow backend) converts the array
    to a tensor and the variable takes that tensor's buffer as its own,
    leaving its old one to TensorFlow's allocator, where a later value may
    or may not reuse it: loading a stage's values one by one grew a rank by
    up to its share again (``benchmarks/saving_memory.py``). Assigned in
    place, a value costs one buffer while it is read, none after.
    """
    import numpy as np

    handle = variable_handle(variable)
    if not isinstance(value, np.ndarray) or not isinstance(handle, tf.Variable) or not tf.executing_eagerly():
        return False
    if tuple(handle.shape) != value.shape or handle.dtype.as_numpy_dtype != value.dtype or value.ndim == 0:
        return False
    handle[...].assign(borrowed_tensor(value))
    return True


@contextlib.contextmanager
def assigning_in_place():
    """Inside, ``Variable.assign`` of a NumPy array of the variable's shape and dtype copies it into the variable's
    buffer (:func:`assign_in_place`); any other value as Keras assigns it (``KerasVariable.assign``, Keras 3.0-3.15).

    Why: a layer's ``load_own_variables`` assigns each value it is given;
    loading a whole stage so, value by value, is where the copies of
    :func:`assign_in_place` added up.
    """
    from keras.src.backend.common.variables import Variable

    original = Variable.assign

    def assign(variable, value):
        if assign_in_place(variable, value):
            return value
        return original(variable, value)

    Variable.assign = assign
    try:
        yield
    finally:
        Variable.assign = original
