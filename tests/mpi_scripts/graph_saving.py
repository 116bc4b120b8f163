"""A keras_hub GPT-2 saved from a pipeline, opened by plain Keras, resumed on another number of ranks.

Usage: graph_saving.py TMPDIR save|resume. ``save`` (4 ranks): 2 epochs of a
``GPT2CausalLM`` (its token embedding on the first and the last stage),
``model.save``, a sharded checkpoint and ``model.export``, predictions to a
file. ``resume`` (2 ranks): ``keras_pipe.load_model`` + 1 epoch equals 3
uninterrupted epochs of the unsplit model; the sharded checkpoint read into a
pipeline of 2 stages gives the saved predictions.
"""

import sys

import keras
import keras_hub
import numpy as np
from common import RANK, assert_close

import keras_pipe

tmp, mode = sys.argv[1], sys.argv[2]
VOCAB, LENGTH = 40, 12
rng = np.random.default_rng(1)
tokens = rng.integers(1, VOCAB, size=(32, LENGTH))
tokens[:, 9:] = 0
x = {"token_ids": tokens, "padding_mask": (tokens != 0).astype("int32")}
y = np.concatenate([tokens[:, 1:], np.zeros((32, 1), tokens.dtype)], axis=1)
fit_args = dict(batch_size=16, shuffle=False, verbose=0)


def make():
    keras.utils.set_random_seed(2)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=3,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=0.0,
        max_sequence_length=LENGTH,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def compile_args():
    return dict(optimizer=keras.optimizers.SGD(0.2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


if mode == "save":
    model = keras_pipe.PipelineModel.from_model(make(), num_microbatches=2)
    model.compile(**compile_args())
    model.fit(x, y, epochs=2, **fit_args)
    assert "token_embedding" in model.engine.cut.shared, model.engine.cut.shared
    model.save(f"{tmp}/model.keras")
    model.save_weights(f"{tmp}/sharded.weights.json")  # (the tied embedding: written once, by its first holder)
    model.export(f"{tmp}/exported", verbose=False)
    predictions = model.predict(x, verbose=0)
    if RANK == 0:
        np.save(f"{tmp}/predictions.npy", predictions)
    print(f"SAVED rank {RANK}", flush=True)
else:
    model = keras_pipe.load_model(f"{tmp}/model.keras", num_microbatches=4)
    assert type(model.engine.graph.model).__name__ == "GPT2CausalLM", type(model.engine.graph.model)
    assert_close(model.predict(x, verbose=0), np.load(f"{tmp}/predictions.npy"), "predictions after loading")
    sharded = keras_pipe.PipelineModel.from_model(make(), num_microbatches=2)
    sharded.compile(**compile_args())
    sharded.load_weights(f"{tmp}/sharded.weights.json")
    assert_close(sharded.predict(x, verbose=0), np.load(f"{tmp}/predictions.npy"), "predictions of the sharded one")
    model.fit(x, y, epochs=1, **fit_args)
    reference = make()
    reference.compile(**compile_args())
    reference.fit(x, y, epochs=3, **fit_args)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        assert_close(a, b, "weights after resuming on another number of ranks", 1e-4, 1e-5)
    print(f"RESUMED rank {RANK}", flush=True)
