"""Functional models, pipelined, against the unsplit model on the same weights and data.

Run as ``mpirun -n P python graphs.py [CASE ...]``; prints ``GRAPH OK <case>``
per rank and case. Cases: ``skip`` (a skip edge over two stages, one Dense
called on two branches that fall on different stages: tied weights),
``multi`` (two inputs as a dict, two outputs with a loss each,
``loss_weights`` and per-output metrics; ``predict`` returns the dict),
``dynamic`` (a time axis that is ``None`` in the model: batches of lengths
8, 12 and 16 cross the stages, each length compiled once), ``resnet``
(keras.applications' ResNet: residual adds across stage boundaries; with one
micro-batch its BatchNormalization sees the batch the unsplit model sees),
``child`` (OPT's head: a layer's child called on the last stage, its parent
on the first: one variable, two layers, tied), ``partial`` (DistilBERT's
masked-LM head: a layer holding the first stage's token table beside weights
of its own; the two layers are held together and tied).
"""

import sys

import keras
import numpy as np
import tensorflow as tf
from common import RANK, SIZE, assert_close, trained_on_rank_0

from keras_pipe import PipelineModel

rng = np.random.default_rng(3)


def compare(case, make, compile_args, x, y, fit_args=None, tolerance=(1e-5, 1e-6), **pipeline_args):
    """Trains the unsplit model (on rank 0) and the pipeline from its weights; compares everything."""
    fit_args = dict(dict(batch_size=16, epochs=2, shuffle=False, verbose=0), **(fit_args or {}))
    data = (x, y) if y is not None or not isinstance(x, tf.data.Dataset) else (x,)
    evaluate = dict(verbose=0) if isinstance(x, tf.data.Dataset) else dict(batch_size=24, verbose=0)

    keras.utils.set_random_seed(5)
    reference = make()
    handed_in = make()
    handed_in.set_weights(reference.get_weights())
    reference.compile(**compile_args())  # (every rank builds both, so that auto-named objects stay alike)

    expected = trained_on_rank_0(
        reference, dict(x=x, y=y, **fit_args), evaluate=dict(x=x, y=y, **evaluate), predict=dict(x=x, **evaluate)
    )
    model = PipelineModel.from_model(handed_in, **pipeline_args)
    model.compile(**compile_args())
    history = model.fit(*data, **fit_args).history
    rtol, atol = tolerance
    assert sorted(history) == sorted(expected["history"]), (sorted(history), sorted(expected["history"]))
    for key in expected["history"]:
        assert_close(history[key], expected["history"][key], f"{case} history {key}", rtol, atol)
    for i, (a, b) in enumerate(zip(model.get_weights(), expected["weights"])):
        assert_close(a, b, f"{case} weight {i}", rtol, atol)
    assert_close(model.evaluate(*data, **evaluate), expected["evaluate"], f"{case} evaluate", rtol, atol)
    predicted, wanted = model.predict(x, **evaluate), expected["predict"]
    assert type(predicted) is type(wanted), (type(predicted), type(wanted))
    keras.tree.map_structure(lambda a, b: assert_close(a, b, f"{case} predict", rtol, atol), predicted, wanted)
    return model


def adam(**extra):
    return lambda: dict(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
        **extra,
    )


def skip(case):
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 3, size=64)

    def make():
        inputs = keras.Input((12,), name="features")
        a = keras.layers.Dense(16, activation="relu", name="a")(inputs)
        b = keras.layers.Dense(16, activation="tanh", name="b")(a)
        c = keras.layers.Dense(16, activation="relu", name="c")(b)
        shared = keras.layers.Dense(8, name="shared")  # called on two branches
        joined = keras.layers.Add(name="skip")([a, c])  # a skip edge from the first stage
        both = keras.layers.Concatenate(name="both")([shared(a), shared(joined)])
        outputs = keras.layers.Dense(3, activation="softmax", name="head")(both)
        return keras.Model(inputs, outputs)

    # the two calls of `shared` on two stages; on 4, `a` goes straight from stage 0 to stage 2
    split = {2: ["shared:1"], 3: ["c", "shared:1"], 4: ["b", "c", "shared:1"]}.get(SIZE)
    model = compare(case, make, adam(), x, y, num_microbatches=2, split_before=split)
    if SIZE > 1:
        assert "shared" in model.engine.cut.shared, model.engine.cut.shared
        if SIZE > 3:  # the skip edge goes straight over the stage between
            assert any(max(c.destinations) > c.source + 1 for c in model.engine.cut.crossings), model.engine.cut


def multi(case):
    x = {"numbers": rng.normal(size=(64, 6)).astype("float32"), "codes": rng.integers(0, 10, size=(64, 3))}
    y = {"kind": rng.integers(0, 4, size=64), "size": rng.normal(size=(64, 1)).astype("float32")}

    def make():
        numbers = keras.Input((6,), name="numbers")
        codes = keras.Input((3,), dtype="int32", name="codes")
        embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 4, name="embed")(codes))
        h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu", name="d1")(numbers), embedded])
        h = keras.layers.Dense(16, activation="relu", name="d2")(h)
        h = keras.layers.Dense(16, activation="relu", name="d3")(h)
        kind = keras.layers.Dense(4, activation="softmax", name="kind")(h)
        size = keras.layers.Dense(1, name="size")(h)
        return keras.Model({"numbers": numbers, "codes": codes}, {"kind": kind, "size": size})

    def two_losses():
        return dict(
            optimizer=keras.optimizers.Adam(1e-2),
            loss={"kind": "sparse_categorical_crossentropy", "size": "mse"},
            loss_weights={"kind": 1.0, "size": 0.25},
            metrics={"kind": ["sparse_categorical_accuracy"], "size": ["mae"]},
        )

    compare(case, make, two_losses, x, y, num_microbatches=2)


def dynamic(case):
    def batches():
        for length in (8, 12, 16, 8, 12, 16):
            tokens = rng.integers(1, 30, size=(16, length))
            yield tokens, (tokens[:, 0] % 3)

    data = list(batches())
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(data),
        output_signature=(tf.TensorSpec((None, None), tf.int64), tf.TensorSpec((None,), tf.int64)),
    )

    def make():
        tokens = keras.Input((None,), dtype="int32")
        h = keras.layers.Embedding(30, 8)(tokens)
        h = keras.layers.Conv1D(8, 3, padding="same", activation="relu")(h)
        h = keras.layers.Conv1D(8, 3, padding="same", activation="relu")(h)
        h = keras.layers.Dense(8, activation="tanh")(h)
        h = keras.layers.GlobalMaxPooling1D()(h)
        return keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(h))

    def sgd():  # (an update proportional to the gradient: round-off stays round-off)
        return dict(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")

    model = compare(case, make, sgd, dataset, None, fit_args=dict(batch_size=None), num_microbatches=2)
    if SIZE > 1:  # the time axis crossed the stages at each of its three lengths, one trace each
        assert model.engine.cut.graph.tensors[model.engine.cut.crossings[0].tensor].dynamic


def resnet(case):
    x = rng.normal(size=(16, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=16)

    def make():
        model = keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10)
        for layer in model.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False  # inference mode, as when fine-tuning (see below)
        return model

    def sgd():
        return dict(optimizer=keras.optimizers.SGD(1e-3), loss="sparse_categorical_crossentropy", jit_compile=False)

    # Its batch normalization is frozen (Keras' fine-tuning convention: moving statistics, no
    # update). Training it on batches of 8 whose last blocks are 1 x 1 makes the comparison
    # meaningless: the unsplit model with and without XLA alone then ends 2 steps with weights
    # apart by 13 % of their update (round-off amplified by variances near zero); frozen, their
    # losses agree exactly and their weights within 1 % of the update (which is what it is
    # compared with here, to 1e-4). Batch normalization in training, whole batch and micro-batched,
    # is compared on well-conditioned models in features.py.
    compare(case, make, sgd, x, y, fit_args=dict(batch_size=8, epochs=1), tolerance=(1e-4, 1e-5), num_microbatches=2)


class TokenAndPosition(keras.layers.Layer):
    """keras_hub's TokenAndPositionEmbedding, small: a child ``ReversibleEmbedding`` and a position table."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.token = keras.layers.ReversibleEmbedding(20, 8, tie_weights=True, name="token")

    def build(self, shape):
        self.token.build(shape)
        self.position = self.add_weight(shape=(shape[-1], 8), name="position")

    def call(self, ids):
        return self.token(ids) + self.position


class Head(keras.layers.Layer):
    """keras_hub's MaskedLMHead, small: a dense layer, then the token table (another layer's) reversed, a bias."""

    def __init__(self, token, **kwargs):
        super().__init__(**kwargs)
        self.token = token
        self.dense = keras.layers.Dense(8, activation="tanh", name="transform")

    def build(self, shape):
        self.dense.build(shape)
        self.bias = self.add_weight(shape=(20,), initializer="zeros", name="bias")

    def call(self, h):
        return self.token(self.dense(h), reverse=True) + self.bias


def tied_token_table(case, head):
    """A token table looked up on the first stage and read by ``head`` on the last (AdamW): tied, as Keras' step."""
    x = rng.integers(0, 20, size=(64, 6))
    y = rng.integers(0, 20, size=(64, 6))

    def make():
        ids = keras.Input((6,), dtype="int32", name="ids")
        embed = TokenAndPosition(name="embeddings")
        h = embed(ids)
        for k in range(3):
            h = keras.layers.Dense(8, activation="tanh", name=f"d{k}")(h)
        return keras.Model(ids, head(embed)(h))

    def adamw():
        return dict(
            optimizer=keras.optimizers.AdamW(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
        )

    return compare(case, make, adamw, x, y, num_microbatches=2)


def child(case):
    # the child itself, as OPTCausalLM's head: its parent's unit, on both stages
    model = tied_token_table(case, lambda embed: lambda h: embed.token(h, reverse=True))
    if SIZE > 1:
        assert model.engine.cut.shared == {"embeddings": (0, SIZE - 1)}, model.engine.cut.shared


def partial(case):
    # a head holding the child beside weights of its own, as MaskedLMHead: the two units held together
    model = tied_token_table(case, lambda embed: Head(embed.token, name="head"))
    if SIZE > 1:
        assert model.engine.cut.shared == {"embeddings": (0, SIZE - 1), "head": (0, SIZE - 1)}, model.engine.cut.shared


CASES = {"skip": skip, "multi": multi, "dynamic": dynamic, "resnet": resnet, "child": child, "partial": partial}
for name in sys.argv[1:] or list(CASES):
    CASES[name](name)
    print(f"GRAPH OK {name} rank {RANK}", flush=True)
