"""Random configurations, one after another: training equals Sequential, or a clear error on every rank.

Usage: property.py '[{"m": 3, "batch": 7, "n": 20, "width": 5, "depth": 3, "schedule": "gpipe"}, ...]'
"""

import json
import sys

import keras
import numpy as np
from common import RANK, SIZE, trained_on_rank_0

from keras_pipe import PipelineConfigError, PipelineModel


def check(config: dict) -> None:
    rng = np.random.default_rng(config["n"])
    x = rng.normal(size=(config["n"], 6)).astype("float32")
    y = rng.normal(size=(config["n"], 2)).astype("float32")

    def chain():
        return (
            [keras.Input((6,))]
            + [keras.layers.Dense(config["width"], activation="tanh") for _ in range(config["depth"])]
            + [keras.layers.Dense(2)]
        )

    keras.utils.set_random_seed(0)
    reference = keras.Sequential(chain())
    initial = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    trained = trained_on_rank_0(reference, dict(x=x, y=y, batch_size=config["batch"], epochs=2, shuffle=False))
    expected, expected_weights = trained["history"], trained["weights"]

    try:
        model = PipelineModel(chain(), num_microbatches=config["m"], schedule=config["schedule"])
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=config["batch"], epochs=2, shuffle=False, verbose=0).history
    except PipelineConfigError as error:
        print(f"PROPERTY error rank {RANK}: {error} :: {json.dumps(config)}", flush=True)
        return
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=f"rank {RANK} {key}")
    for a, b in zip(model.get_weights(), expected_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"rank {RANK} weights")
    print(f"PROPERTY equal rank {RANK} of {SIZE}: {json.dumps(config)}", flush=True)


for config in json.loads(sys.argv[1]):
    check(config)
