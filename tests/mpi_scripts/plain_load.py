"""Plain Keras opens a file a PipelineModel saved, TensorFlow serves its export: one process, no MPI, no keras_pipe."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tmp = sys.argv[1]
model = keras.models.load_model(f"{tmp}/model.keras")
assert isinstance(model, keras.Sequential), type(model)
x = np.random.default_rng(0).normal(size=(203, 12)).astype("float32")
np.testing.assert_allclose(model.predict(x, verbose=0), np.load(f"{tmp}/predictions.npy"), rtol=1e-5, atol=1e-6)
# model.export's SavedModel serves what the pipeline predicted
exported = tf.saved_model.load(f"{tmp}/exported")  # (kept: its functions read its variables)
served = exported.serve(x).numpy()
np.testing.assert_allclose(served, np.load(f"{tmp}/predictions.npy"), rtol=1e-5, atol=1e-6)
assert model.optimizer is not None and int(model.optimizer.iterations.numpy()) == 14, model.optimizer.iterations
# the sharded checkpoints four stages wrote (one shard a stage, and a shard a variable): Keras' own load_weights
# reads their weights and optimizer state, equal to what the .keras file holds
for name in ("sharded", "small"):
    plain = keras.models.clone_model(model)
    plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(f"{tmp}/{name}.weights.json")
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(plain.optimizer.variables) == len(model.optimizer.variables), name
    for a, b in zip(plain.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{name}: {b.path}")
assert "keras_pipe" not in sys.modules and "mpi4py" not in sys.modules
print("PLAIN KERAS OK", flush=True)
