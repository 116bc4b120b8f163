"""Every optimizer Keras ships, on a model whose embeddings get sparse gradients, against the unsplit model.

Run as ``mpirun -n P python sparse_optimizers.py [CASE ...]``; prints
``SPARSE OK <case>`` per rank and case. The model gives an optimizer every
form of gradient Keras' own step gives it (issue 39):

- ``tokens``: an ``Embedding`` looked up on two inputs, once on the first
  stage and once on a later one: its sparse gradients from both stages are
  joined slice by slice, as TensorFlow joins two lookups of one table;
- ``positions``: a layer whose ``call()`` looks up fixed ids (no batch axis,
  as ViT's position embedding): the whole batch has one slice per id, so the
  micro-batches' slices of an id are summed, not joined;
- ``head``: a ``ReversibleEmbedding(tie_weights=False)`` called on the first
  stage (a lookup: sparse) and as the last stage's head (its own dense
  ``reverse_embeddings``): each weight has the form its one use gives it;
- ``unused``: a weight no call reads gets no gradient (``None``), so Keras'
  optimizer leaves it (and its slots, and AdamW's decay) alone.

``--stages 2`` on four ranks: two replicas of a two-stage pipeline, whose
sparse gradients are summed over the replicas as over micro-batches.

``--sharded`` (or ``--sharded=CASE,CASE``: those cases only): each case then
saves a sharded checkpoint (``.weights.json``); plain Keras reads it on rank 0
(the weights, and the optimizer's state, which the next epoch shows) and trains one more epoch as the pipeline does; the
pipeline reads it back and trains that epoch alike.

Each optimizer trains the pipeline (4 micro-batches, 6 steps) and the unsplit
model from the same weights; losses and every weight must agree.
"""

import sys

import keras
import numpy as np
from common import RANK, SIZE, assert_close, trained_on_rank_0

from keras_pipe import PipelineModel

VOCAB, LENGTH, DIM = 24, 5, 8
rng = np.random.default_rng(3)
tokens = rng.integers(0, VOCAB, size=(48, LENGTH)).astype("int32")
tokens[:, 0] = 1  # a repeated id in every row: duplicate slices in every micro-batch
others = rng.integers(0, VOCAB, size=(48, LENGTH)).astype("int32")
targets = rng.integers(0, VOCAB, size=(48, LENGTH)).astype("int32")


class PositionAdd(keras.layers.Layer):
    """Adds an embedding of the positions ``0..length-1`` (fixed ids, no batch axis), as ViT does; holds a weight
    that nothing reads."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.positions = keras.layers.Embedding(length, dim, name="positions")
        self.unused = self.add_weight(shape=(dim,), initializer="ones", name="unused")

    def build(self, input_shape):
        self.positions.build((self.length,))

    def call(self, x):
        return x + self.positions(keras.ops.arange(self.length))[None]


def make():
    a = keras.Input((LENGTH,), dtype="int32", name="a")
    b = keras.Input((LENGTH,), dtype="int32", name="b")
    head = keras.layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=False, name="head")
    table = keras.layers.Embedding(VOCAB, DIM, name="tokens")
    h = keras.layers.Add()([head(a), table(a)])
    h = PositionAdd(LENGTH, DIM)(h)
    for _ in range(3):
        h = keras.layers.Dense(DIM, activation="tanh")(h)
    h = keras.layers.Add()([h, table(b)])  # the table again, on a later stage
    h = keras.layers.Dense(DIM, activation="tanh")(h)
    return keras.Model({"a": a, "b": b}, head(h, reverse=True))


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adam_amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3),
    "lamb": lambda: keras.optimizers.Lamb(1e-2),
    "muon": lambda: keras.optimizers.Muon(1e-2),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5),
    "adam_clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.1),
    "adam_clipvalue": lambda: keras.optimizers.Adam(1e-2, clipvalue=0.01),
    "adamw_ema": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05, use_ema=True, ema_overwrite_frequency=2),
    "adam_accumulation": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
    "loss_scale_adam": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
}


def check(case, num_stages=None):
    compile_args = lambda: dict(  # noqa: E731
        optimizer=OPTIMIZERS[case](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    x, y = {"a": tokens, "b": others}, targets
    fit = dict(x=x, y=y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras.utils.set_random_seed(5)
    reference = make()
    handed_in = make()
    handed_in.set_weights(reference.get_weights())
    reference.compile(**compile_args())
    expected = trained_on_rank_0(reference, fit, key=case)  # (the same on 2 ranks and 4, any num_stages)
    model = PipelineModel.from_model(handed_in, num_microbatches=4, num_stages=num_stages)
    model.compile(**compile_args())
    history = model.fit(**fit).history
    assert_close(history["loss"], expected["history"]["loss"], f"{case} loss", 1e-5, 1e-6)
    for a, b, variable in zip(model.get_weights(), expected["weights"], reference.weights):
        assert_close(a, b, f"{case} weight {variable.path}", 1e-4, 2e-6)
    if SHARDED and (SHARDED is True or case in SHARDED):
        check_sharded(case, model, compile_args, fit)
    print(f"SPARSE OK {case} ", flush=True)


def check_sharded(case, model, compile_args, fit):
    """The optimizer's state in a sharded checkpoint sits where the unsplit optimizer keeps it: plain Keras reads
    the checkpoint and trains on as the pipeline does, and the pipeline reads it back and trains on alike."""
    path = f"{DIRECTORY}/{case}.weights.json"
    model.save_weights(path)
    saved = model.get_weights()
    one_more = dict(fit, epochs=1)
    plain = None
    if RANK == 0:
        plain = make()
        plain.compile(**compile_args())
        plain.optimizer.build(plain.trainable_variables)
        plain.load_weights(path)
        for a, b in zip(plain.get_weights(), saved):
            np.testing.assert_array_equal(a, b, err_msg=f"{case}: plain Keras reading the sharded checkpoint")
        plain.fit(**one_more)
    model.fit(**one_more)
    on = model.get_weights()
    model.load_weights(path)
    for a, b in zip(model.get_weights(), saved):
        assert_close(a, b, f"{case}: the pipeline reading its sharded checkpoint", 0, 0)
    model.fit(**one_more)
    for a, b in zip(model.get_weights(), on):
        assert_close(a, b, f"{case}: the epoch after reading its sharded checkpoint", 1e-5, 1e-7)
    if plain is not None:
        for a, b, variable in zip(on, plain.get_weights(), plain.weights):
            assert_close(a, b, f"{case}: plain Keras' epoch after reading the checkpoint {variable.path}", 1e-4, 2e-6)


# (each case, or those listed, also saves a sharded checkpoint: plain Keras and the pipeline read it)
SHARDED = "--sharded" in sys.argv or next(
    (set(a.split("=", 1)[1].split(",")) for a in sys.argv if a.startswith("--sharded=")), False
)
DIRECTORY = None
if SHARDED:
    import tempfile

    from mpi4py import MPI

    DIRECTORY = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="keras_pipe_sharded_") if RANK == 0 else None)


if __name__ == "__main__":
    # ``--stages S``: S stages, SIZE / S replicas of each (the sparse gradients summed over replicas too)
    stages = int(sys.argv[sys.argv.index("--stages") + 1]) if "--stages" in sys.argv else None
    cases = [a for a in sys.argv[1:] if a in OPTIMIZERS]
    for case in cases or list(OPTIMIZERS):
        check(case, stages)
    print(f"SPARSE DONE on {SIZE} ranks", flush=True)
