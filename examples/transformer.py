"""A small transformer text classifier, pipelined, beside keras.Sequential on the same weights and data.

    mpirun -n 2 python examples/transformer.py
    mpirun -n 4 python examples/transformer.py --policy mixed_bfloat16 --plot curves.png

Everything a transformer stack needs crosses the stage boundaries: token and
position embeddings with a padding mask (``mask_zero=True``), encoder blocks
written as Keras layers around ``MultiHeadAttention`` that read the mask, a
masked average pooling and a classifier; trained in ``mixed_bfloat16`` with
``global_clipnorm`` (the norm of the whole model's gradient, all stages) and
activation recomputation (each stage keeps only its micro-batches' inputs).

The data are made here (nothing is downloaded): variable-length "sentences" of
token ids padded with 0, labelled by which of three keywords occurs most often,
which attention over the whole sentence learns. Rank 0 prints both models'
losses per epoch; both are trained on every rank, as every rank runs the
script, so the comparison is one process's ``Sequential`` against the pipeline.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from keras_pipe import PipelineModel  # noqa: E402

VOCABULARY, LENGTH, KEYWORDS = 64, 24, (3, 4, 5)


def sentences(n: int, seed: int):
    """Token ids (0 pads the end) and labels: the keyword (of three) that occurs most often."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(6, VOCABULARY, size=(n, LENGTH))
    lengths = rng.integers(6, LENGTH + 1, size=n)
    labels = rng.integers(0, len(KEYWORDS), size=n)
    for row in range(n):
        positions = rng.permutation(lengths[row])
        counts = rng.multinomial(5, [0.2, 0.2, 0.2]) + np.eye(3, dtype=int)[labels[row]]
        filled = 0
        for keyword, count in zip(KEYWORDS, counts):
            tokens[row, positions[filled : filled + count]] = keyword
            filled += count
        labels[row] = int(np.argmax(counts))
    tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return tokens.astype("int32"), labels


@keras.saving.register_keras_serializable(package="examples")
class TokenAndPosition(keras.layers.Layer):
    """Token plus position embeddings; the padding mask (token 0) rides on the output."""

    def __init__(self, vocabulary, length, width, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary, self.length, self.width = vocabulary, length, width
        self.tokens = keras.layers.Embedding(vocabulary, width, mask_zero=True)
        self.positions = keras.layers.Embedding(length, width)

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(self.length))

    def compute_mask(self, ids, mask=None):
        return keras.ops.not_equal(ids, 0)

    def get_config(self):
        return {**super().get_config(), "vocabulary": self.vocabulary, "length": self.length, "width": self.width}


@keras.saving.register_keras_serializable(package="examples")
class EncoderBlock(keras.layers.Layer):
    """Self-attention and a feed-forward network, each with a residual and layer normalisation."""

    def __init__(self, width, heads, hidden, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads, self.hidden, self.dropout = width, heads, hidden, dropout
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads, dropout=dropout)
        self.feed_forward = keras.Sequential(
            [keras.layers.Dense(hidden, activation="gelu"), keras.layers.Dense(width), keras.layers.Dropout(dropout)]
        )
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()
        self.supports_masking = True  # the mask passes on to the next block

    def call(self, x, mask=None, training=None):
        attention_mask = None if mask is None else keras.ops.expand_dims(mask, 1)  # (batch, 1, keys)
        x = self.norm1(x + self.attention(x, x, attention_mask=attention_mask, training=training))
        return self.norm2(x + self.feed_forward(x, training=training))

    def get_config(self):
        return {
            **super().get_config(),
            "width": self.width,
            "heads": self.heads,
            "hidden": self.hidden,
            "dropout": self.dropout,
        }


def layers(width=32, blocks=4):
    return [
        keras.Input((LENGTH,), dtype="int32"),
        TokenAndPosition(VOCABULARY, LENGTH, width),
        *[EncoderBlock(width, heads=4, hidden=2 * width) for _ in range(blocks)],
        keras.layers.GlobalAveragePooling1D(),  # over the unpadded tokens: it reads the mask
        keras.layers.Dense(len(KEYWORDS), activation="softmax", dtype="float32"),
    ]


def compile_args():
    return dict(
        optimizer=keras.optimizers.Adam(2e-3, global_clipnorm=1.0),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--policy", default="mixed_bfloat16", help="a keras.mixed_precision policy")
    parser.add_argument("--recompute", default="always", choices=["never", "except_last", "always"])
    parser.add_argument("--plot", help="rank 0 draws both models' curves to this PNG")
    args = parser.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    keras.mixed_precision.set_global_policy(args.policy)
    x, y = sentences(args.samples, seed=0)
    x_test, y_test = sentences(512, seed=1)
    fit_args = dict(batch_size=args.batch_size, epochs=args.epochs, validation_data=(x_test, y_test), shuffle=False)

    keras.utils.set_random_seed(0)
    sequential = keras.Sequential(layers())
    initial = sequential.get_weights()
    model = PipelineModel(layers(), num_microbatches=args.microbatches, recompute=args.recompute)
    model.set_weights(initial)
    model.compile(**compile_args())
    model.summary()
    pipelined = model.fit(x, y, verbose=2 if rank == 0 else 0, **fit_args).history

    sequential.compile(**compile_args())
    reference = sequential.fit(x, y, verbose=0, **fit_args).history
    if rank != 0:
        return
    print(f"\n{'epoch':>5} {'pipeline loss':>14} {'Sequential loss':>16} {'pipeline val acc':>17} {'Sequential':>11}")
    for epoch in range(args.epochs):
        print(
            f"{epoch + 1:5d} {pipelined['loss'][epoch]:14.4f} {reference['loss'][epoch]:16.4f} "
            f"{pipelined['val_accuracy'][epoch]:17.3f} {reference['val_accuracy'][epoch]:11.3f}"
        )
    if args.plot:
        plot(pipelined, reference, args, MPI.COMM_WORLD.Get_size())


def plot(pipelined, reference, args, ranks):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    epochs = np.arange(1, args.epochs + 1)
    for key, axis in (("loss", axes[0]), ("val_accuracy", axes[1])):
        axis.plot(epochs, pipelined[key], "o-", label=f"PipelineModel, {ranks} ranks")
        axis.plot(epochs, reference[key], "x--", label="keras.Sequential, 1 process")
        axis.set_xlabel("epoch")
        axis.set_title(key)
    axes[0].legend()
    figure.suptitle(f"transformer classifier, {args.policy}, global_clipnorm=1.0, recompute={args.recompute!r}")
    figure.tight_layout()
    figure.savefig(args.plot, dpi=100)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
