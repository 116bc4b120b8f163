"""What schedule="auto" needs to time a candidate on another cut, in one process: the optimizer copy, the snapshot.

The cut itself, the weights moving between ranks and the pick are tested under real mpirun
(``mpi_scripts/chunks.py``'s ``equivalence``, ``hub.py``'s ``shared_chunks``): every pick trains as Sequential.
"""

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.engine import placement, recut


def test_the_timing_steps_update_with_a_fresh_copy_of_the_optimizer():
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 100, 0.5)
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.02, beta_1=0.8, global_clipnorm=1.0)
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    copy = recut.timing_optimizer(optimizer)
    assert type(copy) is keras.optimizers.AdamW and copy is not optimizer and not copy.built
    assert copy.get_config() == optimizer.get_config()


def test_an_optimizer_that_cannot_be_made_from_its_configuration_is_timed_with_sgd():
    class Custom(keras.optimizers.SGD):
        def __init__(self, rate):  # (no keyword for get_config's entries: from_config fails)
            super().__init__(learning_rate=rate)

    copy = recut.timing_optimizer(Custom(0.1))
    assert type(copy) is keras.optimizers.SGD


def test_the_snapshot_puts_back_every_allocated_variable_of_the_layers_once():
    layer = keras.layers.BatchNormalization()
    layer.build((None, 2))
    other = keras.layers.Dense(2)
    other.build((None, 2))
    compat.release_variable(other.kernel)  # (another rank's: not read, not restored)
    before = [v.numpy().copy() for v in layer.variables]
    snapshot = recut.Snapshot([layer, layer, other])
    assert len(snapshot.values) == len(layer.variables) + 1  # (the layer's four, the other's bias)
    for variable in layer.variables:
        variable.assign(variable + 1.0)
    snapshot.restore()
    for variable, value in zip(layer.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_a_placement_is_a_key():
    assert placement.key_of([[0, 3], [1, 2]]) == ((0, 3), (1, 2))
    assert placement.key_of([[0], [1]]) != placement.key_of([[0, 3], [1, 2]])
