"""Plain Keras (with keras_hub) opens the GPT-2 a PipelineModel saved, and TensorFlow serves its export: one process,
no MPI, no keras_pipe."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tmp = sys.argv[1]
model = keras.models.load_model(f"{tmp}/model.keras")
assert isinstance(model, keras_hub.models.GPT2CausalLM), type(model)
rng = np.random.default_rng(1)
tokens = rng.integers(1, 40, size=(32, 12))
tokens[:, 9:] = 0
x = {"token_ids": tokens, "padding_mask": (tokens != 0).astype("int32")}
np.testing.assert_allclose(model.predict(x, verbose=0), np.load(f"{tmp}/predictions.npy"), rtol=1e-4, atol=1e-5)
# the sharded checkpoint four stages wrote: plain Keras' load_weights reads it into a GPT-2 of its own
sharded = keras_hub.models.GPT2CausalLM.from_config(model.get_config())
sharded.load_weights(f"{tmp}/sharded.weights.json")
np.testing.assert_allclose(sharded.predict(x, verbose=0), np.load(f"{tmp}/predictions.npy"), rtol=1e-4, atol=1e-5)
exported = tf.saved_model.load(f"{tmp}/exported")  # (kept: its functions read its variables)
served = exported.serve({k: v.astype("int32") for k, v in x.items()}).numpy()
np.testing.assert_allclose(served, np.load(f"{tmp}/predictions.npy"), rtol=1e-4, atol=1e-5)
# (its optimizer is keras_hub's default: Keras skips compile_from_config for a class with its own compile())
assert "keras_pipe" not in sys.modules and "mpi4py" not in sys.modules
print("PLAIN KERAS OK", flush=True)
