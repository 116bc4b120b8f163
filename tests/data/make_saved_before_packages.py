"""How saved_before_packages.keras and .json were made, once, by the code before the packages (cc251e2).

Run from the repository root: ``.venv/bin/python tests/data/make_saved_before_packages.py``.
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import json

import keras
import numpy as np

import keras_pipe

keras.utils.set_random_seed(0)
model = keras_pipe.PipelineModel(
    [keras.Input((4,)), keras.layers.Dense(3), keras_pipe.DeferredBatchNormalization(), keras.layers.Dense(2)]
)
model.compile(optimizer="adam", loss="mse")
x = np.arange(32, dtype="float32").reshape(8, 4) / 10
y = np.ones((8, 2), "float32")
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
model.save("tests/data/saved_before_packages.keras")
predictions = model.predict(x, verbose=0)
with open("tests/data/saved_before_packages.json", "w") as file:
    json.dump({"x": x.tolist(), "predictions": predictions.tolist()}, file, indent=1)
