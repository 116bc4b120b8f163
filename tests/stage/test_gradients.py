"""A step's weight gradients summed inside compiled programs: one program for every micro-batch (no MPI)."""

import numpy as np
import tensorflow as tf

from keras_pipe.stage.gradients import GradientSum
from keras_pipe.stage.programs import Program


class _Programs:
    """``(key, function) -> Program``, counting the distinct keys asked for."""

    def __init__(self):
        self.programs = {}

    def __call__(self, key, function):
        if key not in self.programs:
            self.programs[key] = Program(function, jit=True)
        return self.programs[key]


def _backward(gradients, programs):
    """A stand-in backward program: ``scale * [1, 2, 3]`` for the dense variable, a slice for the sparse one."""

    def backward(scale, first):
        dense = scale * tf.constant([1.0, 2.0, 3.0])
        sparse = tf.IndexedSlices(tf.reshape(scale, (1, 1)), tf.constant([1], tf.int64), tf.constant([2, 1], tf.int64))
        return gradients.add_in_graph([dense, sparse, None], first)

    def run(scale):
        first = gradients.prepare()
        gradients.added(programs("backward", backward)(tf.constant(scale), first))

    return run


def test_every_micro_batch_adds_in_one_program_and_a_step_starts_afresh():
    variables = [tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros((2, 1))), tf.Variable(tf.zeros(2))]
    programs = _Programs()
    gradients = GradientSum(variables, programs)
    backward = _backward(gradients, programs)
    for scale in (1.0, 2.0, 4.0):
        backward(scale)
    dense, sparse, untouched = gradients.result()
    np.testing.assert_array_equal(dense.numpy(), [7.0, 14.0, 21.0])
    np.testing.assert_array_equal(tf.convert_to_tensor(sparse).numpy(), [[0.0], [7.0]])
    assert untouched is None  # no micro-batch gave it a gradient: Keras' optimizer skips it

    gradients.reset()  # the next step: a first micro-batch replaces the sum, even a sum that is not finite
    backward(float("nan"))
    gradients.reset()
    backward(0.5)
    dense, sparse, _ = gradients.result()
    np.testing.assert_array_equal(dense.numpy(), [0.5, 1.0, 1.5])
    np.testing.assert_array_equal(tf.convert_to_tensor(sparse).numpy(), [[0.0], [0.5]])
    assert list(programs.programs) == ["backward"]  # (the first micro-batch is no program of its own)
    assert len(programs.programs["backward"]._concrete) == 1  # (one trace)
    assert programs.programs["backward"].compiled_with_xla
