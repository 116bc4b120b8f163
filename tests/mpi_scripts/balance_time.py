"""balance="time" splits by measured time, the same on every rank.

Convolutions have few parameters and much work; a wide Dense the opposite:
balanced by parameters the convolutions share a stage, balanced by time they
spread out.
"""

import keras
from common import RANK

from keras_pipe import PipelineModel
from keras_pipe.mpi.comm import Communicator


def chain():
    return [
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ]


by_params = PipelineModel(chain(), num_microbatches=2)
by_params.build()
by_time = PipelineModel(chain(), num_microbatches=2, balance="time")
by_time.build()
everyone = Communicator().allgather_json([by_params.balance, by_time.balance])
assert all(e == everyone[0] for e in everyone), everyone
assert by_time.balance[0] < by_params.balance[0], (by_params.balance, by_time.balance)
print(f"BALANCE rank {RANK}: by parameters {by_params.balance}, by time {by_time.balance}", flush=True)
