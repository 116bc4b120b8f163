"""A compiled program returns each tensor once and none it was given (in one process, no MPI)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_pipe import PipelineModel
from keras_pipe.stage.programs import Program


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


def test_the_first_step_holds_no_more_tensors_than_the_next():
    """In a process of its own, with oneDNN's CPU operations on: TensorFlow counts the CPU's tensors only under
    the allocator those bring, which it turns on by itself only on the processors it optimizes them for
    ("Allocator stats not available for device 'CPU:0'" on an AVX2 machine)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", "import test_programs; test_programs.first_step_against_the_next()"],
        cwd=here,
        env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", PYTHONPATH=str(here.parent.parent)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "FIRST STEP OK" in done.stdout, done.stdout + done.stderr


def first_step_against_the_next():
    # A backward that pulled a gradient back through the scalar sum(y * g) had
    # the ones of y's shape folded into a constant while XLA compiled each I and
    # W program: a micro-batch-sized buffer per layer, allocated in the first
    # step while it holds its micro-batches (1F1B's bound). TensorFlow's own
    # count of the tensors it holds, per step, on one rank.
    width, layers, batch = 256, 6, 2048  # a micro-batch's activation of one layer: 0.5 MiB
    model = PipelineModel(
        [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(layers)],
        num_microbatches=4,
    )
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    peaks = []

    class Peak(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20)
            tf.config.experimental.reset_memory_stats("CPU:0")

    x = np.random.default_rng(0).standard_normal((3 * batch, width), dtype="float32")
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(x, x, batch_size=batch, epochs=1, verbose=0, callbacks=[Peak()])
    micro_batch = batch // 4 * width * 4 / 2**20
    assert peaks[0] - max(peaks[1:]) < 2 * micro_batch, peaks  # (it was 9 MiB more)
    print("FIRST STEP OK", peaks, flush=True)
