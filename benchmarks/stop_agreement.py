"""What agreeing on a stop after every batch costs a step: fits with the ranks' sum of their stop flags and without.

    mpirun -n 2 python benchmarks/stop_agreement.py
    mpirun -n 3 python benchmarks/stop_agreement.py --rounds 6 --steps 200

Keras ends ``fit()`` after a batch where ``model.stop_training`` is set. Where
code of the user's runs between batches (a callback with a batch hook, a
signal handler), a flag one rank alone sets must stop every rank, so the
ranks sum their flags after each batch (``keras_pipe.model.callbacks``,
``_StopAgreed``). This times one ``fit()`` epoch of a small chain (tiny
steps, where the sum weighs most) with the sum after every batch and with
it left out, in alternated rounds, and prints the medians on rank 0. The
figure is an upper bound for real models, whose steps are longer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="batches of 32 rows a timed epoch")
    args = parser.parse_args()

    import keras
    import numpy as np
    from mpi4py import MPI

    from keras_pipe import PipelineModel
    from keras_pipe.model import callbacks

    world = MPI.COMM_WORLD
    rows = 32 * args.steps
    x = np.random.default_rng(0).random((rows, 12)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, rows)
    layers = [keras.Input((12,))] + [keras.layers.Dense(16, activation="relu") for _ in range(4)]
    model = PipelineModel(layers + [keras.layers.Dense(3)], num_microbatches=2)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # (compiled before timing)

    made = callbacks._StopAgreed.made
    times = {"sum after every batch": [], "sum after the epoch only": []}
    try:
        for _ in range(args.rounds):
            for label, every_batch in (("sum after every batch", True), ("sum after the epoch only", False)):
                callbacks._StopAgreed.made = classmethod(lambda cls, comm, _, every=every_batch: cls(comm, every))
                world.Barrier()
                start = time.perf_counter()
                model.fit(x, y, batch_size=32, epochs=1, verbose=0)
                times[label].append(time.perf_counter() - start)
    finally:
        callbacks._StopAgreed.made = made
    if world.Get_rank() == 0:
        medians = {label: statistics.median(t) / args.steps * 1e3 for label, t in times.items()}
        for label, ms in medians.items():
            print(f"{world.Get_size()} ranks, {label}: {ms:.2f} ms a step (median of {args.rounds} epochs)")
        print(f"the sum costs {medians['sum after every batch'] - medians['sum after the epoch only']:+.2f} ms a step")


if __name__ == "__main__":
    main()
