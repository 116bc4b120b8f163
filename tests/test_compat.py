"""Every Keras/TensorFlow internal keras_pipe relies on still exists (keras_pipe/compat/)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from keras_pipe import compat  # noqa: E402


def test_every_internal_is_there():
    compat.check()  # raises AttributeError naming what a Keras upgrade removed


def test_seed_generators_are_found_in_nested_layers():
    dropout = keras.layers.Dropout(0.5, seed=1)
    assert compat.seed_generators(dropout) == [dropout.seed_generator]
    assert compat.seed_generators(keras.layers.Dense(2)) == []


def test_no_module_outside_compat_reaches_into_keras_src():
    root = os.path.join(os.path.dirname(__file__), "..", "keras_pipe")
    offenders = []
    for folder, _, names in os.walk(root):
        if os.path.relpath(folder, root).split(os.sep)[0] == "compat":
            continue
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            text = open(path).read()
            if "keras.src" in text or "tensorflow.python" in text:
                offenders.append(os.path.relpath(path, root))
    assert not offenders, f"Keras/TensorFlow internals outside keras_pipe/compat/: {offenders}"


@pytest.mark.parametrize("shape", [(2, 3), (2, 4, 5)])
def test_input_shape_checks_say_what_keras_says(shape):
    # Every rank checks a batch's shapes (only the first stage converts it): in Keras' words, as one rank says them
    inputs = keras.Input((4,), name="foo")
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    x = np.zeros(shape, "float32")
    with pytest.raises(ValueError) as by_keras:
        model(x)
    with pytest.raises(ValueError) as by_check:
        compat.check_input_shapes(model, x)
    words = str(by_check.value)
    if len(shape) == 2:
        assert words in str(by_keras.value), (words, str(by_keras.value))
    else:  # (Keras prints the whole array too: the rest is the same)
        assert words.split(". ")[1] in str(by_keras.value) and "with name 'foo' and path ''" in words, words


def test_values_go_into_keras_stores_and_variables_without_extra_copies(tmp_path):
    # (issue 59: rank 0 writes and reads a whole model's file one value at a time; Keras' own store copies each
    # value it is given, and an array assigned to a variable is copied again)
    from keras.src.saving import saving_lib

    from keras_pipe.mpi.comm import aligned_empty

    value = np.arange(12, dtype="float32").reshape(3, 4)
    handed = compat.handed_over(value)
    assert np.shares_memory(np.array(handed), value)  # (Keras' convert_to_numpy is np.array: it takes it as is)
    path = str(tmp_path / "x.weights.h5")
    store = saving_lib.H5IOStore(path, mode="w")
    entry = store.make("layers/dense/vars")
    entry["0"] = handed
    entry["1"] = compat.handed_over(keras.Variable(value + 1))
    store.close()
    store = saving_lib.H5IOStore(path, mode="r")
    entry = store.get("layers/dense/vars")
    for key, expected in (("0", value), ("1", value + 1)):
        read = compat.read_value(entry, key, aligned_empty)
        np.testing.assert_array_equal(read, expected)
        assert read.ctypes.data % 64 == 0, "read into the caller's (aligned) buffer"
        variable = keras.Variable(np.zeros((3, 4), "float32"))
        assert compat.assign_in_place(variable, read)  # (into the variable's own buffer)
        np.testing.assert_array_equal(variable.numpy(), expected)
        assert not compat.assign_in_place(variable, read[:2]), "another shape: Keras' assign says what is wrong"
        assert not compat.assign_in_place(variable, read.astype("float64")), "another dtype: Keras' assign casts"
    store.close()
    # NumPy's own buffers (16-byte aligned), read-only or strided arrays, bfloat16: given back, assigned as Keras does
    unaligned = np.frombuffer(np.zeros(17, "float32").tobytes(), "float32", count=16, offset=4).copy()[1:]
    for array in (np.zeros((4, 3), "float32")[:, :2], np.zeros(3, "float32")[:0]):
        assert compat.borrowed_tensor(array) is array
    if unaligned.ctypes.data % 64:
        assert compat.borrowed_tensor(unaligned) is unaligned
    readonly = aligned_empty((2, 2), "float32")
    readonly.flags.writeable = False
    assert compat.borrowed_tensor(readonly) is readonly
