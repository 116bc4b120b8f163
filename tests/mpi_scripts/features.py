"""The models people pipeline, each against keras.Sequential on the same weights and data.

Run as ``mpirun -n P python features.py [CASE ...]``; prints ``FEATURE OK <case>``
per rank and case. Cases: ``clipnorm`` (global_clipnorm that clips, one pipeline),
``clipnorm-replicas`` (the same, 2 stages x P/2 replicas), ``bfloat16``,
``float16`` (mixed precision with loss scaling), ``float16-overflow`` (a step whose
gradients overflow on stage 0 only is skipped on every stage), ``masks`` (a padding
mask crosses each boundary of a masked LSTM stack), ``masked-outputs`` (a per-token
tagger's loss and metrics skip the masked entries of the whole batch), ``recompute`` (activation
recomputation with dropout and batch normalization changes nothing),
``deferred-batchnorm`` (moving statistics of the whole batch, not the last micro-batch),
``several-tensors`` (a skip connection crosses boundaries as a tuple of two tensors),
``batch-statistic-loss`` (a layer whose added loss is a statistic of the whole batch, as a mixture of
experts' load-balancing loss is: every rank warns at the first batch, naming it).
"""

import sys
import warnings

import keras
import numpy as np
import tensorflow as tf
from common import RANK, SIZE, assert_close, data, trained_on_rank_0

from keras_pipe import PipelineModel
from keras_pipe.errors import PipelineConfigError
from keras_pipe.stage.batchnorm import DeferredBatchNormalization

x, y, sw = data(n=96)
fit_args = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)


def mlp():
    return [
        keras.Input((12,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(3, activation="softmax", dtype="float32"),
    ]


def compare(case, chain, compile_args, tolerance=(1e-5, 1e-6), data=None, evaluate=False, **pipeline_args):
    """Trains ``Sequential`` (on rank 0) and the pipeline from the same weights; compares history and weights."""
    inputs, labels, weights = data or (x, y, sw)
    keras.utils.set_random_seed(3)
    reference = keras.Sequential(chain())
    initial = reference.get_weights()
    reference.compile(**compile_args())  # (every rank builds it, so that auto-named objects stay alike)
    evaluate_args = dict(sample_weight=weights, batch_size=48, verbose=0)

    expected = trained_on_rank_0(
        reference,
        dict(x=inputs, y=labels, sample_weight=weights, **fit_args),
        evaluate=dict(x=inputs, y=labels, **evaluate_args) if evaluate else None,
    )
    keras.utils.set_random_seed(3)  # dropout layers get the reference's seeds
    model = PipelineModel(chain(), **pipeline_args)
    model.set_weights(initial)
    model.compile(**compile_args())
    history = model.fit(inputs, labels, sample_weight=weights, **fit_args).history
    rtol, atol = tolerance
    for key in expected["history"]:
        assert_close(history[key], expected["history"][key], f"{case} history {key}", rtol, atol)
    for i, (a, b) in enumerate(zip(model.get_weights(), expected["weights"])):
        assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), f"{case} weight {i}", rtol, atol)
    steps = (int(model.optimizer.iterations), expected["steps"])
    assert steps[0] == steps[1] > 0, f"{case}: optimizer steps {steps}"
    if evaluate:
        evaluated = model.evaluate(inputs, labels, **evaluate_args)
        assert_close(evaluated, expected["evaluate"], f"{case} evaluate", rtol, atol)
    return initial


def clipnorm(case):
    def sgd():
        return dict(optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05), loss="sparse_categorical_crossentropy")

    stages = {"clipnorm": None, "clipnorm-replicas": 2}[case]
    initial = compare(case, mlp, sgd, num_microbatches=2, num_stages=stages)
    # the norm clipped: the first batch's gradient is longer than the limit
    probe = keras.Sequential(mlp())
    probe.set_weights(initial)
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y[:32], probe(x[:32]))
        loss = tf.reduce_mean(loss * sw[:32])
    norm = float(tf.linalg.global_norm(tape.gradient(loss, probe.trainable_variables)))
    assert norm > 0.05 * 2, f"the gradient norm {norm} does not exceed global_clipnorm: nothing was clipped"


def clipnorm_embedding(case):
    """global_clipnorm clips by Keras' norm of an Embedding's sparse gradient: its slices, a repeated id per use."""
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 6, size=(96, 10))  # few ids, each used many times per batch

    def chain():
        return [
            keras.Input((10,), dtype="int32"),
            keras.layers.Embedding(6, 8),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def adam():
        return dict(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=0.05), loss="sparse_categorical_crossentropy")

    compare(case, chain, adam, (1e-5, 1e-6), (tokens, y, sw), evaluate=True, num_microbatches=2)
    # the norm clipped: the first batch's gradient is longer than the limit
    probe = keras.Sequential(chain())
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y[:32], probe(tokens[:32])) * sw[:32])
    grads = tape.gradient(loss, probe.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices), type(grads[0])
    norm = float(keras.ops.sqrt(sum(keras.ops.sum(keras.ops.square(g)) for g in grads)))
    assert norm > 0.05 * 2, f"the gradient norm {norm} does not exceed global_clipnorm: nothing was clipped"


def dropout_stream(case):
    """jit_compile="auto": a stage with dropout trains without XLA, drawing Sequential's masks (one micro-batch)."""

    def chain():
        return [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.5, seed=42),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dropout(0.5, seed=43),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def adam():
        return dict(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")

    compare(case, chain, adam, (2e-6, 2e-7), num_microbatches=1)


def precision(case):
    policy = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}[case]
    keras.mixed_precision.set_global_policy(policy)
    try:
        # SGD: an update proportional to the gradient keeps differences at the dtype's precision (Adam's
        # near-sign update turns a rounding difference in a tiny gradient into a whole step)
        def sgd():
            return dict(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")

        # micro-batches sum their gradients in another order: equal to the dtype's precision
        epsilon = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[case]
        compare(case, mlp, sgd, tolerance=(4 * epsilon, 4 * epsilon), num_microbatches=2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def masks(case):
    """A padding mask from Embedding(mask_zero=True) crosses every boundary of a masked recurrent stack."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 20, size=(96, 10))
    lengths = rng.integers(2, 11, size=96)
    tokens[np.arange(10)[None, :] >= lengths[:, None]] = 0  # padded at the end, as text batches are

    def chain():
        return [
            keras.Input((10,), dtype="int32"),
            keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def adam():
        return dict(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")

    splits = {2: [[1, 4], [2, 3], [3, 2]], 3: [[1, 1, 3], [2, 1, 2]], 4: [[1, 1, 1, 2]]}.get(SIZE, [None])
    for balance in splits:
        compare(case, chain, adam, (1e-5, 1e-5), (tokens, y, sw), num_microbatches=2, balance=balance)


def masked_outputs(case):
    """A per-token tagger: the loss and the metrics see the output's padding mask, as Sequential's do."""
    rng = np.random.default_rng(5)
    # 97 rows: the last batch has 1, so with replicas one of them has no share of it
    tokens = rng.integers(1, 20, size=(97, 10))
    lengths = rng.integers(2, 11, size=97)  # so each micro-batch holds its own count of unmasked entries
    tokens[np.arange(10)[None, :] >= lengths[:, None]] = 0
    tags = rng.integers(0, 3, size=(97, 10))
    token_weights = rng.uniform(0.5, 1.5, size=(97, 10)).astype("float32")

    def chain(regularize=True):  # an Embedding: sparse gradients, plus a dense part where regularized
        regularizer = keras.regularizers.L2(1e-3) if regularize else None
        return [
            keras.Input((10,), dtype="int32"),
            keras.layers.Embedding(20, 8, mask_zero=True, embeddings_regularizer=regularizer),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def adam(reduction="sum_over_batch_size"):
        return lambda: dict(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction),
            metrics=["sparse_categorical_accuracy", keras.metrics.SparseCategoricalCrossentropy(name="xent")],
        )

    balance = {1: None, 2: [2, 2], 3: [1, 2, 1], 4: [1, 1, 1, 1]}[SIZE]
    data = (tokens, tags, token_weights)
    pipeline = dict(num_microbatches=3, balance=balance, recompute="except_last")  # the rerun carries the loss
    compare(case, chain, adam(), (1e-5, 1e-5), data, True, **pipeline)
    # replicas where the ranks allow: the first one's embedding gradient has the regularizer's dense
    # part, the other's is slices; without a regularizer, the replica with no share of the last
    # batch (1 row) sends no slices
    replicas = dict(num_microbatches=2, num_stages=SIZE // 2 if SIZE % 2 == 0 else None)
    compare(case, chain, adam("mean_with_sample_weight"), (1e-5, 1e-5), data, True, **replicas)
    compare(case, lambda: chain(regularize=False), adam("sum"), (1e-5, 1e-5), data, True, **replicas)


def recompute(case):
    """Recomputation keeps only each micro-batch's input, reruns the forward with the same dropout masks."""

    def chain():
        return [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def adam():  # (XLA draws other random numbers than TensorFlow's kernels: no XLA, as Sequential)
        return dict(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy", jit_compile=False)

    # one micro-batch: each dropout layer draws as in Sequential, so the two are equal
    compare(case, chain, adam, (1e-4, 1e-5), num_microbatches=1, recompute="always")
    # several: equal to the same pipeline without recomputation (to round-off: a forward run under a
    # tape is another TensorFlow graph than one without)
    results = {}
    for option in ("never", "except_last", "always"):
        keras.utils.set_random_seed(3)
        initial = keras.Sequential(chain()).get_weights()
        model = PipelineModel(chain(), num_microbatches=4, recompute=option)
        model.set_weights(initial)
        model.compile(**adam())
        results[option] = (model.fit(x, y, sample_weight=sw, **fit_args).history, model.get_weights())
    for option in ("except_last", "always"):
        assert_close(results[option][0]["loss"], results["never"][0]["loss"], f"recompute={option} loss")
        for i, (a, b) in enumerate(zip(results[option][1], results["never"][1])):
            assert_close(a, b, f"recompute={option} weight {i}", 1e-4, 1e-5)


def deferred_batchnorm(case):
    """After one step of 4 micro-batches, DeferredBatchNormalization's moving statistics are the whole batch's."""

    def chain(norm):
        return [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu"),
            norm(momentum=0.5),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def sgd():
        return dict(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")

    keras.utils.set_random_seed(3)
    reference = keras.Sequential(chain(keras.layers.BatchNormalization))
    initial = reference.get_weights()
    reference.compile(**sgd())
    reference.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    expected = reference.get_weights()
    moving = [i for i, w in enumerate(reference.weights) if "moving" in w.path]
    for norm, deferred in ((keras.layers.BatchNormalization, False), (DeferredBatchNormalization, True)):
        model = PipelineModel(chain(norm), num_microbatches=4)
        model.set_weights(initial)
        model.compile(**sgd())
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
        weights = model.get_weights()
        close = all(np.allclose(weights[i], expected[i], rtol=1e-5, atol=1e-6) for i in moving)
        assert close == deferred, f"rank {RANK}: {norm.__name__} moving statistics equal Sequential's: {close}"

    # num_microbatches="auto" would time P, 2P and 4P micro-batches: each normalizes with other statistics, so each
    # trains differently. Refused when the model is built, on every rank, naming the layers.
    model = PipelineModel(chain(keras.layers.BatchNormalization), num_microbatches="auto")
    model.compile(**sgd())
    try:
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    except PipelineConfigError as error:
        assert "num_microbatches='auto'" in str(error) and "batch_normalization" in str(error), error
    else:
        assert SIZE == 1, "num_microbatches='auto' with batch normalization trained"  # (one stage: m = 1 only)


@keras.saving.register_keras_serializable(package="tests")
class Fork(keras.layers.Layer):
    """Starts a skip connection: returns ``(x, x)``."""

    def call(self, x):
        return (x, x)


@keras.saving.register_keras_serializable(package="tests")
class Carry(keras.layers.Layer):
    """A Dense on the first tensor; the skip connection (and any other tensor) passes through."""

    def __init__(self, units, activation=None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation = units, activation
        self.dense = keras.layers.Dense(units, activation=activation)

    def call(self, inputs):
        h, *rest = inputs
        return (self.dense(h), *rest)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "activation": self.activation}


@keras.saving.register_keras_serializable(package="tests")
class Join(keras.layers.Layer):
    """Ends the skip connection: the sum of the two tensors."""

    def call(self, inputs):
        return inputs[0] + inputs[1]


def several_tensors(case):
    """A skip connection carried across stage boundaries as a tuple of two tensors (torchgpipe's way)."""

    def chain():
        return [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu"),
            Fork(),
            Carry(16, "relu"),
            Carry(16, "tanh"),
            Join(),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def adam():
        return dict(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")

    splits = {2: [[2, 4], [3, 3], [4, 2]], 3: [[2, 2, 2]], 4: [[2, 1, 1, 2]]}.get(SIZE, [None])
    for balance in splits:
        compare(case, chain, adam, num_microbatches=2, balance=balance)


class OverflowOnce(keras.layers.Layer):
    """Passes its input on; its weight's gradient overflows float16 while ``trigger`` is set (0 otherwise)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="zeros", name="w")
        self.trigger = self.add_weight(shape=(), initializer="zeros", trainable=False, name="trigger")

    def call(self, x):
        # (w * 1e4) * trigger: the gradient of w is sum(dy * trigger) * 1e4, zero while trigger is 0
        return x + (self.w * tf.constant(1e4, x.dtype)) * tf.cast(self.trigger, x.dtype)


class Trigger(keras.callbacks.Callback):
    """Makes the second batch's gradient overflow, on whichever rank holds the layer."""

    def on_train_batch_begin(self, batch, logs=None):
        # (a pipeline's own: the layers whose weights this rank holds)
        for layer in getattr(self.model, "stage_layers", self.model.layers):
            if isinstance(layer, OverflowOnce):
                layer.trigger.assign(1.0 if batch == 1 else 0.0)


def overflow(case):
    """With mixed_float16, a step whose gradients overflow on stage 0 only is skipped on every stage."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:

        def chain():
            return [mlp()[0], OverflowOnce(), *mlp()[1:]]

        def sgd():
            return dict(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")

        keras.utils.set_random_seed(3)
        reference = keras.Sequential(chain())
        initial = reference.get_weights()
        reference.compile(**sgd())
        args = dict(fit_args, epochs=1, callbacks=[Trigger()])
        reference.fit(x, y, **args)
        model = PipelineModel(chain(), num_microbatches=2)
        model.set_weights(initial)
        model.compile(**sgd())
        model.fit(x, y, **args)
        scale = float(model.optimizer.dynamic_scale.numpy())
        expected_scale = float(reference.optimizer.dynamic_scale.numpy())
        steps = (int(model.optimizer.iterations), int(reference.optimizer.iterations))
        assert scale == expected_scale == 2.0**14, (RANK, scale, expected_scale)  # halved once, from 2**15
        assert steps == (2, 2), f"one of 3 steps skipped: {steps}"
        for i, (a, b) in enumerate(zip(model.get_weights(), reference.get_weights())):
            assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), f"{case} weight {i}", 2e-3, 2e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")


class BatchVarianceLoss(keras.layers.Layer):
    """Adds the variance of its input over the batch: a statistic of the batch, not a mean over its rows."""

    def call(self, inputs, training=None):
        if training:
            self.add_loss(0.01 * keras.ops.mean(keras.ops.var(inputs, axis=0)))
        return inputs


def batch_statistic_loss(case):
    """No sum over micro-batches gives the batch's variance: a warning on every rank at the first batch, naming the
    layer (``keras_pipe.engine.probe.batch_loss_notes``; tests/mpi_scripts/hub.py's Mixtral, in the slow tier, is
    the same for a router's load-balancing loss)."""
    keras.utils.set_random_seed(3)
    chain = mlp()[:3] + [BatchVarianceLoss(name="batch_variance")] + mlp()[3:]
    model = PipelineModel(chain, num_microbatches=4)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    notes = [str(w.message) for w in caught if "not a mean over the batch's rows" in str(w.message)]
    assert [n.split()[0] for n in notes] == ["'batch_variance'"], notes


CASES = {
    "clipnorm": clipnorm,
    "clipnorm-replicas": clipnorm,
    "clipnorm-embedding": clipnorm_embedding,
    "dropout-stream": dropout_stream,
    "bfloat16": precision,
    "float16": precision,
    "float16-overflow": overflow,
    "masks": masks,
    "masked-outputs": masked_outputs,
    "recompute": recompute,
    "deferred-batchnorm": deferred_batchnorm,
    "several-tensors": several_tensors,
    "batch-statistic-loss": batch_statistic_loss,
}
for name in sys.argv[1:] or list(CASES):
    if name == "clipnorm-replicas" and SIZE % 2:
        continue
    CASES[name](name)
    print(f"FEATURE OK {name} rank {RANK}", flush=True)
