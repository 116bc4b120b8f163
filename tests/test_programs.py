"""A compiled program returns each tensor once and none it was given (in one process, no MPI)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_pipe import PipelineModel
from keras_pipe.programs import Program


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("jit", [True, False])
def test_a_returned_argument_or_repeated_tensor_is_the_same_object(jit):
    def function(kept, scale):
        y = tf.nn.relu(kept[0] * scale)
        return {"kept": kept, "twice": [y, y], "none": None, "sum": tf.reduce_sum(y)}

    program = Program(function, jit=jit)
    kept = [tf.constant(np.arange(6.0, dtype=np.float32).reshape(2, 3)), tf.ones((2, 3))]
    result = program(kept, tf.constant(2.0))
    assert result["kept"][0] is kept[0] and result["kept"][1] is kept[1]
    assert result["twice"][0] is result["twice"][1]
    assert result["none"] is None
    np.testing.assert_allclose(result["twice"][0].numpy(), np.arange(6.0).reshape(2, 3) * 2)
    assert float(result["sum"]) == 30.0
    again = program(kept, tf.constant(3.0))  # (the same trace, rebuilt the same way)
    assert again["kept"][0] is kept[0] and float(again["sum"]) == 45.0


def test_xla_would_copy_a_tensor_returned_twice():
    # Why the program returns each tensor once: XLA gives every returned
    # reference its own buffer. Eight references to a 128 MiB result cost
    # about 1 GiB a call under tf.function(jit_compile=True) alone.
    x = tf.ones((8192, 4096))

    @tf.function(jit_compile=True)
    def eight(x):
        return [tf.nn.relu(x * 2)] * 8

    program = Program(lambda x: [tf.nn.relu(x * 2)] * 8, jit=True)
    kept = [eight(x), program(x)]  # (compiled; the allocator has room for one call of each)
    before = _rss_mib()
    kept.append(eight(x))
    plain = _rss_mib() - before
    before = _rss_mib()
    kept.append(program(x))
    ours = _rss_mib() - before
    assert plain > 600, plain
    assert ours < 300, ours
    assert all(t is kept[-1][0] for t in kept[-1])


class PythonIf(keras.layers.Layer):
    """A layer whose Python ``if`` reads a tensor: AutoGraph would make it a ``tf.cond``, had it reached ``call``."""

    def call(self, x):
        if tf.reduce_sum(x) > 0:
            return x
        return -x

    def compute_output_shape(self, shape):
        return shape


def test_programs_are_traced_without_autograph_as_keras_traces_its_steps():
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 3), "float32")
    for make in (keras.Sequential, PipelineModel):
        model = make([keras.Input((3,)), PythonIf()])
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
            model.fit(x, y, epochs=1, verbose=0)
