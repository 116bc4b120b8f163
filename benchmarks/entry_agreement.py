"""What the entry agreement of a collective method costs: one small all-gather per call, on every rank.

    mpirun -n 2 python benchmarks/entry_agreement.py                 # 200 calls a round, 5 rounds
    mpirun -n 2 python benchmarks/entry_agreement.py --calls 500 --rounds 9

Each call of a ``PipelineModel``'s collective methods (``fit``, ``predict``,
calling it, ...) starts with every rank saying which method it entered and
its count of such calls (``keras_pipe.mpi.agreement.agree_on_entry``): one
all-gather of a few bytes (two, as the payload's size travels first). Inside
``fit`` or ``predict`` no step adds a message: the agreement is per call, and
the steps of a call are in lockstep. The most it costs a step is therefore
where a call is one step: calling the model eagerly on a small batch. This
script times that, rounds alternating the agreement on and off (the median
is shown), and the agreement alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import keras
    import numpy as np
    from mpi4py import MPI

    from keras_pipe import PipelineModel
    from keras_pipe.mpi import agreement as runtime

    model = PipelineModel([keras.Input((16,)), keras.layers.Dense(16), keras.layers.Dense(16), keras.layers.Dense(4)])
    x = np.ones((8, 16), "float32")
    model(x)  # (built, traced)
    agreement = runtime._entries
    comm = MPI.COMM_WORLD

    def per_call(on: bool) -> float:
        runtime._entries = agreement if on else None
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            model(x)
        return (time.perf_counter() - start) / args.calls

    timings = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (True, False):
            timings[on].append(per_call(on))
    runtime._entries = agreement
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(args.calls):
        runtime.agree_on_entry("call()")
    alone = (time.perf_counter() - start) / args.calls
    with_it, without = statistics.median(timings[True]), statistics.median(timings[False])
    if comm.Get_rank() == 0:
        print(
            f"{comm.Get_size()} ranks, eager call of 8 rows, median of {args.rounds} rounds of {args.calls} calls: "
            f"{1e3 * with_it:.3f} ms a call with the entry agreement, {1e3 * without:.3f} ms without "
            f"({1e6 * (with_it - without):+.0f} us); the agreement alone {1e6 * alone:.0f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
