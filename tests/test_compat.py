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
