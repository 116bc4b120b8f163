"""Train the model from the question in shared/seed on real handwritten digits, pipelined.

    mpirun -n 4 python examples/train_digits.py

The digits are scikit-learn's ``load_digits`` (8x8 images that ship inside
the package; nothing is downloaded). The model is the one the question wired
by hand across ranks: Flatten, Dense(128) on the first rank, blocks of
Dense(128) in the middle, Dropout and Dense(10, softmax) at the end -- here one
list of layers, split over however many ranks ``mpirun`` starts.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from keras_pipe import PipelineModel  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--history", help="write the History and test figures to this JSON file (rank 0)")
    args = parser.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")
    labels = digits.target
    # Every rank makes the same split, as every rank runs the same script.
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[:360], order[360:]
    x_train, y_train, x_test, y_test = images[train], labels[train], images[test], labels[test]

    keras.utils.set_random_seed(0)
    model = PipelineModel(
        [
            keras.Input((8, 8)),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ],
        num_microbatches=args.microbatches,
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.summary()
    history = model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.1, verbose=2
    ).history
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    predictions = model.predict(x_test, verbose=0)
    if rank == 0:
        print(f"test loss {loss:.4f} - test accuracy {accuracy:.4f} on {len(x_test)} held-out digits")
        print(f"predict() agrees with evaluate(): {np.mean(predictions.argmax(axis=1) == y_test):.4f}")
        if args.history:
            with open(args.history, "w") as f:
                json.dump({"history": history, "test_loss": loss, "test_accuracy": accuracy}, f)


if __name__ == "__main__":
    main()
