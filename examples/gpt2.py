"""A keras_hub GPT-2 language model, pipelined, beside the unsplit model on the same weights and data.

    mpirun -n 4 python -m keras_pipe examples/gpt2.py
    mpirun -n 2 python -m keras_pipe examples/gpt2.py --layers 6 --epochs 4

``GPT2CausalLM`` is a Functional model of keras_hub's: its ``padding_mask``
input is read by every transformer block, and its token embedding is called
twice, as the input embedding and (``reverse=True``) as the output head, so
that one weight lives on the first and on the last stage; their gradients are
summed before every step. ``PipelineModel.from_model`` cuts its graph as it
is (nested backbone expanded, nothing rewritten); inside
``keras_pipe.unallocated()`` the model is created without any weight, and
each rank allocates only its own stage's.

The text is made here (nothing is downloaded, no preset is loaded):
sentences of a tiny grammar ("the red fox sees a small cat ."), each padded
to its own length, word-level tokens. Rank 0 prints both models' losses per
epoch and one sampled sentence; the unsplit model is trained in the same
process, from the same initial weights, for the comparison.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import keras_pipe  # noqa: E402

WORDS = ["<pad>", "the", "a", "red", "small", "quick", "old", "fox", "cat", "dog", "bird"]
WORDS += ["sees", "chases", "likes", "."]
LENGTH = 12


def sentences(n: int, seed: int):
    """Token ids of ``n`` sentences (0 pads the end), their next-token targets and the targets' weights."""
    rng = np.random.default_rng(seed)
    ids = {w: i for i, w in enumerate(WORDS)}
    tokens = np.zeros((n, LENGTH), "int32")
    for row in range(n):
        words = []
        for _ in range(2):
            words += [rng.choice(["the", "a"])]
            if rng.random() < 0.6:
                words += [rng.choice(["red", "small", "quick", "old"])]
            words += [rng.choice(["fox", "cat", "dog", "bird"])]
            if not len(words) > 4:
                words += [rng.choice(["sees", "chases", "likes"])]
        words += ["."]
        tokens[row, : len(words)] = [ids[w] for w in words[:LENGTH]]
    padding = (tokens != 0).astype("int32")
    targets = np.concatenate([tokens[:, 1:], np.zeros((n, 1), "int32")], axis=1)
    weights = np.concatenate([padding[:, 1:], np.zeros((n, 1), "int32")], axis=1).astype("float32")
    return {"token_ids": tokens, "padding_mask": padding}, targets, weights


def gpt2(layers: int):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(WORDS),
        num_layers=layers,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=LENGTH,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def compile_args():
    return dict(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    x, y, w = sentences(args.samples, seed=0)

    keras.utils.set_random_seed(1)  # the same initializer seeds on every rank: the same initial weights
    with keras_pipe.unallocated():
        lm = gpt2(args.layers)
    model = keras_pipe.PipelineModel.from_model(lm, num_microbatches=args.microbatches)
    model.compile(**compile_args())
    model.summary()

    keras.utils.set_random_seed(1)
    unsplit = gpt2(args.layers)  # the same seeds: the weights the pipeline's stages allocated
    unsplit.compile(**compile_args())

    fit = dict(batch_size=32, epochs=1, shuffle=False, verbose=0)
    for epoch in range(args.epochs):
        piped = model.fit(x, y, sample_weight=w, **fit).history
        alone = unsplit.fit(x, y, sample_weight=w, **fit).history
        if rank == 0:
            print(
                f"epoch {epoch + 1}: pipeline loss {piped['loss'][0]:.5f} accuracy "
                f"{piped['sparse_categorical_accuracy'][0]:.4f} | unsplit loss {alone['loss'][0]:.5f} "
                f"accuracy {alone['sparse_categorical_accuracy'][0]:.4f}",
                flush=True,
            )
    logits = model.predict({k: v[:1] for k, v in x.items()}, verbose=0)
    if rank == 0:
        length = int(x["padding_mask"][0].sum())
        guess = " ".join(WORDS[i] for i in np.argmax(logits[0, :length], axis=-1))
        print(f"next words the pipeline predicts for the first sentence: {guess}")


if __name__ == "__main__":
    main()
