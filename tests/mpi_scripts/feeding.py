"""Only the first stage of each pipeline reads a dataset, a PyDataset or a generator; training equals the unsplit model.

Run on 2 ranks (one pipeline) or 4 (``--stages 4``: one pipeline; ``--stages 2``: two replicas). Each data source
counts the samples it produces on this rank; every rank prints ``FEED <case> counts <per rank>`` (the test checks
that only first stages produced any) and ``FEED <case> OK`` once its losses, metrics, weights and predictions match
the unsplit model trained on rank 0 with the same data. Errors in the user's data print
``FEED <case> error <type>: <message>`` on every rank.
"""

import argparse
import json

import keras
import tensorflow as tf
from common import RANK, SIZE, assert_close, compile_args, data, layers, trained_on_rank_0
from mpi4py import MPI

from keras_pipe import PipelineModel

parser = argparse.ArgumentParser()
parser.add_argument("--stages", type=int, default=SIZE)
STAGES = parser.parse_args().stages

x, y, sw = data(n=160)
vx, vy, vsw = data(n=48, seed=1)
BATCH = 32
produced = {"n": 0}  # samples this rank's data sources produced


def counted(array):
    produced["n"] += len(array)
    return array


def tf_data(xs, ys, weights=None, repeat=False, count=True):
    parts = (xs, ys) if weights is None else (xs, ys, weights)
    dataset = tf.data.Dataset.from_tensor_slices(parts).batch(BATCH)
    if count:  # (Python code in the map, as decoding an image is)

        def count_then_pass(*batch):
            first = tf.numpy_function(counted, [batch[0]], tf.float32)
            first.set_shape(batch[0].shape)
            return (first, *batch[1:])

        dataset = dataset.map(count_then_pass)
    return dataset.repeat() if repeat else dataset


class Batches(keras.utils.PyDataset):
    def __init__(self, xs, ys, weights=None):
        super().__init__()
        self.xs, self.ys, self.weights = xs, ys, weights

    def __len__(self):
        return -(-len(self.xs) // BATCH)

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        batch = (counted(self.xs[part]), self.ys[part])
        return batch if self.weights is None else (*batch, self.weights[part])


def generator(xs, ys, epochs):
    for _ in range(epochs):
        for start in range(0, len(xs), BATCH):
            yield counted(xs[start : start + BATCH]), ys[start : start + BATCH]


def make_pipeline():
    keras.utils.set_random_seed(3)
    model = PipelineModel(layers(), num_stages=STAGES, num_microbatches=2)
    model.compile(**compile_args())
    return model


def reference_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(layers())
    model.compile(**compile_args())
    return model


def counts_everywhere(case):
    counts = MPI.COMM_WORLD.allgather(produced["n"])
    produced["n"] = 0
    print(f"FEED {case} counts {json.dumps(counts)}", flush=True)
    return counts


def check(case, history, weights, evaluated, predicted, expected):
    for key, values in expected["history"].items():
        assert_close(history[key], values, f"{case}: {key}")
    for got, want in zip(weights, expected["weights"]):
        assert_close(got, want, f"{case}: weights")
    assert_close(evaluated, expected["evaluate"], f"{case}: evaluate")
    assert_close(predicted, expected["predict"], f"{case}: predict")
    print(f"FEED {case} OK", flush=True)


def whole_run(case, make_train, make_validation, make_predict, reference_fit, key=True, **fit_args):
    """fit (two epochs, with validation), evaluate and predict on the data ``make_*`` give, then compare."""
    model = make_pipeline()
    history = model.fit(make_train(), validation_data=make_validation(), epochs=2, verbose=0, **fit_args).history
    evaluated = model.evaluate(make_validation(), verbose=0)
    predicted = model.predict(make_predict(), verbose=0)
    weights = model.get_weights()
    counts = counts_everywhere(case)
    expected = trained_on_rank_0(
        reference_model(),
        fit=dict(x=x, y=y, batch_size=BATCH, validation_data=(vx, vy), epochs=2, shuffle=False, verbose=0)
        | reference_fit,
        evaluate=dict(x=vx, y=vy, batch_size=BATCH),
        predict=dict(x=vx, batch_size=BATCH),
        key=f"feeding {case}" if key else None,
    )
    check(case, history, weights, evaluated, predicted, expected)
    return counts


whole_run("tf.data", lambda: tf_data(x, y), lambda: tf_data(vx, vy), lambda: tf_data(vx, vy), {})
whole_run(  # (sample weights in its batches)
    "PyDataset",
    lambda: Batches(x, y, sw),
    lambda: Batches(vx, vy),
    lambda: Batches(vx, vy),
    {"sample_weight": sw},
    shuffle=False,  # (Keras shuffles a PyDataset's batches; the pipeline would too, alike on every replica)
)
whole_run(  # (of unknown length: two epochs' batches, steps_per_epoch given)
    "generator",
    lambda: generator(x, y, epochs=2),
    lambda: tf_data(vx, vy),
    lambda: generator(vx, vy, epochs=1),
    {},
    steps_per_epoch=len(x) // BATCH,
)
WEIGHTS = {0: 0.5, 1: 2.0, 2: 1.0}
whole_run(  # (steps_per_epoch shorter than the data; class weights become sample weights on the first stage)
    "infinite with class weights",
    lambda: tf_data(x, y, repeat=True),
    lambda: tf_data(vx, vy),
    lambda: tf_data(vx, vy),
    {"x": tf_data(x, y, repeat=True, count=False), "y": None, "batch_size": None, "steps_per_epoch": 3}
    | {"class_weight": WEIGHTS},
    key=False,
    steps_per_epoch=3,
    class_weight=WEIGHTS,
)

whole_run(  # (fit from a later epoch: Keras' loop counts the epochs from initial_epoch, on every rank)
    "initial epoch",
    lambda: tf_data(x, y),
    lambda: tf_data(vx, vy),
    lambda: tf_data(vx, vy),
    {"initial_epoch": 1},
    initial_epoch=1,
)


# Dicts of inputs and of outputs, a loss and a metric by output name, through a tf.data pipeline.
def dict_graph():
    keras.utils.set_random_seed(5)
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    hidden = keras.layers.Concatenate()([a, b])
    for width, activation in ((16, "relu"), (16, "tanh"), (16, "relu")):
        hidden = keras.layers.Dense(width, activation=activation)(hidden)
    outputs = {
        "labels": keras.layers.Dense(3, activation="softmax", name="labels")(hidden),
        "score": keras.layers.Dense(1, name="score")(hidden),
    }
    return {"a": a, "b": b}, outputs


def dict_compile():
    return dict(
        jit_compile=False,
        optimizer=keras.optimizers.Adam(1e-2),
        loss={"labels": "sparse_categorical_crossentropy", "score": "mse"},
        metrics={"labels": ["accuracy"]},
    )


def as_dicts(xs, ys, weights):
    return {"a": xs[:, :8], "b": xs[:, 8:]}, {"labels": ys, "score": weights.reshape(-1, 1)}


def dict_data(xs, ys, weights, targets=True):
    inputs, outputs = as_dicts(xs, ys, weights)

    def count_then_pass(batch_inputs, *rest):
        first = tf.numpy_function(counted, [batch_inputs["a"]], tf.float32)
        first.set_shape(batch_inputs["a"].shape)
        return ({**batch_inputs, "a": first}, *rest)

    parts = (inputs, outputs) if targets else (inputs,)
    return tf.data.Dataset.from_tensor_slices(parts).batch(BATCH).map(count_then_pass)


pipeline = PipelineModel(*dict_graph(), num_stages=STAGES, num_microbatches=2)
pipeline.compile(**dict_compile())
history = pipeline.fit(dict_data(x, y, sw), validation_data=dict_data(vx, vy, vsw), epochs=2, verbose=0).history
evaluated = pipeline.evaluate(dict_data(vx, vy, vsw), verbose=0)
predicted = pipeline.predict(dict_data(vx, vy, vsw, targets=False), verbose=0)
dict_weights = pipeline.get_weights()
counts_everywhere("dicts")
reference = keras.Model(*dict_graph())
reference.compile(**dict_compile())
expected = trained_on_rank_0(
    reference,
    fit=dict(zip(("x", "y"), as_dicts(x, y, sw)))
    | dict(batch_size=BATCH, validation_data=as_dicts(vx, vy, vsw), epochs=2, shuffle=False, verbose=0),
    evaluate=dict(zip(("x", "y"), as_dicts(vx, vy, vsw))) | dict(batch_size=BATCH),
    predict=dict(x=as_dicts(vx, vy, vsw)[0], batch_size=BATCH),
)
assert sorted(history) == sorted(expected["history"]), (sorted(history), sorted(expected["history"]))
assert sorted(predicted) == ["labels", "score"], sorted(predicted)
assert_close(predicted["score"], expected["predict"]["score"], "dicts: predict score")
check(
    "dicts",
    history,
    dict_weights,
    evaluated,
    predicted["labels"],
    dict(expected, predict=expected["predict"]["labels"]),
)


# Each replica reads its own share: tf.distribute's distribute_datasets_from_function on the model's strategy.
# Batched by the per-replica size, then sharded: replica r reads batches r, r + R, ..., so step k's global batch is
# rows [k B, (k + 1) B) in order, as one process's batch of B. 150 samples end in a short batch (on the last
# replica of two), 48 validation samples in a step the second replica has no share of.
SHORT = 150


def shards(xs, ys, weights=None, targets=True):
    def dataset_fn(context):
        per_replica = context.get_per_replica_batch_size(BATCH)
        parts = (xs, ys) if weights is None else (xs, ys, weights)
        dataset = tf.data.Dataset.from_tensor_slices(parts if targets else (xs,)).batch(per_replica)
        dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)

        def count_then_pass(*batch):
            first = tf.numpy_function(counted, [batch[0]], tf.float32)
            first.set_shape(batch[0].shape)
            return (first, *batch[1:])

        return dataset.map(count_then_pass)

    return dataset_fn


class ShardBatches(keras.utils.PyDataset):
    """One replica's batches of a PyDataset: every num_replicas-th batch of the per-replica size."""

    def __init__(self, context, xs, ys):
        super().__init__()
        self.xs, self.ys = xs, ys
        self.size = context.get_per_replica_batch_size(BATCH)
        self.replica, self.replicas = context.input_pipeline_id, context.num_input_pipelines
        self.batches = -(-len(xs) // self.size)

    def __len__(self):
        return len(range(self.replica, self.batches, self.replicas))

    def __getitem__(self, index):
        start = (self.replica + index * self.replicas) * self.size
        return counted(self.xs[start : start + self.size]), self.ys[start : start + self.size]


def shard_generator(xs, ys, epochs):
    def dataset_fn(context):
        size = context.get_per_replica_batch_size(BATCH)

        def batches():
            for _ in range(epochs):
                for start in range(context.input_pipeline_id * size, len(xs), size * context.num_input_pipelines):
                    yield counted(xs[start : start + size]), ys[start : start + size]

        return batches()

    return dataset_fn


def per_replica_run(case, make_train, reference_fit, **fit_args):
    """whole_run's calls on each replica's own data (validation, evaluate and predict through tf.data shards)."""
    strategy = make_pipeline().distribute_strategy
    made = strategy.distribute_datasets_from_function
    model = make_pipeline()
    history = model.fit(
        made(make_train()), validation_data=made(shards(vx, vy)), epochs=2, verbose=0, **fit_args
    ).history
    evaluated = model.evaluate(made(shards(vx, vy)), verbose=0)
    predicted = model.predict(made(shards(vx, vy, targets=False)), verbose=0)
    weights = model.get_weights()
    counts_everywhere(case)
    expected = trained_on_rank_0(
        reference_model(),
        fit=dict(x=x[:SHORT], y=y[:SHORT], batch_size=BATCH, validation_data=(vx, vy), epochs=2, shuffle=False)
        | dict(verbose=0)
        | reference_fit,
        evaluate=dict(x=vx, y=vy, batch_size=BATCH),
        predict=dict(x=vx, batch_size=BATCH),
        key=f"feeding {case}",
    )
    check(case, history, weights, evaluated, predicted, expected)


per_replica_run("per-replica tf.data", lambda: shards(x[:SHORT], y[:SHORT], sw[:SHORT]), {"sample_weight": sw[:SHORT]})
per_replica_run(  # (class weights become sample weights in Keras' adapter of each replica's PyDataset)
    "per-replica PyDataset",
    lambda: lambda context: ShardBatches(context, x[:SHORT], y[:SHORT]),
    {"class_weight": WEIGHTS},
    class_weight=WEIGHTS,
    shuffle=False,
)
per_replica_run(  # (of unknown length: two epochs' batches, steps_per_epoch given)
    "per-replica generator",
    lambda: shard_generator(x[:SHORT], y[:SHORT], epochs=2),
    {},
    steps_per_epoch=-(-SHORT // BATCH),
)


# A replica's dataset function raises: the same error on every rank.
def failing(context):
    if context.input_pipeline_id == context.num_input_pipelines - 1:
        raise ValueError("no shard files for this replica")
    return shards(x, y)(context)


model = make_pipeline()
try:
    model.fit(model.distribute_strategy.distribute_datasets_from_function(failing), epochs=1, verbose=0)
    print("FEED per-replica function error none", flush=True)
except (ValueError, RuntimeError) as error:
    print(f"FEED per-replica function error {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
produced["n"] = 0


# The user's map raises on the reading rank: the same error on every rank, and the job goes on.
def broken(batch_x, batch_y):
    def fail(a):
        if produced["n"] >= 2 * BATCH:
            raise ValueError("cannot decode sample 64")
        return counted(a)

    out = tf.numpy_function(fail, [batch_x], tf.float32)
    out.set_shape(batch_x.shape)
    return out, batch_y


model = make_pipeline()
try:
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).map(broken), epochs=1, verbose=0)
    print("FEED broken map error none", flush=True)
except (ValueError, RuntimeError) as error:
    print(f"FEED broken map error {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
produced["n"] = 0

# A batch of the wrong shape: the same error on every rank.
try:
    model.fit(tf.data.Dataset.from_tensor_slices((x[:, :5], y)).batch(BATCH), epochs=1, verbose=0)
    print("FEED wrong shape error none", flush=True)
except (ValueError, RuntimeError) as error:
    print(f"FEED wrong shape error {type(error).__name__}: {str(error).splitlines()[0][:60]}", flush=True)
counts_everywhere("errors")
print(f"FEED DONE rank {RANK}", flush=True)
