"""A tensor that skips stages: sent straight to its reader, or relayed through the stages between?

Run as ``mpirun -n 3 python benchmarks/crossings.py``. Rank 0 sends a tensor
that rank 2 reads (a skip edge over stage 1, or a model input such as a
padding mask that a later block reads), once per micro-batch, through
keras_pipe's :class:`~keras_pipe.mpi.comm.Communicator` (non-blocking sends,
polling receives), both ways, alternated over several rounds:

- ``direct``: rank 0 sends to rank 2 (what :mod:`keras_pipe.engine.links` does);
- ``relay``: rank 0 sends to rank 1, which receives it whole and sends it on
  to rank 2 (what a chain-only pipeline must do).

Printed per size: the median time from the send to its arrival, and the CPU
time rank 1 spends on it (in a pipeline, time taken from its own compute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from keras_pipe.mpi.comm import Communicator

TAG = 77


def one_way(comm: Communicator, size: int, mode: str, repeats: int) -> tuple[float, float]:
    """Median seconds from rank 0's send to rank 2's arrival, and rank 1's CPU seconds per message."""
    array = np.ones(size // 4, np.float32)
    times, cpu = [], 0.0
    for _ in range(repeats):
        comm.barrier()
        began = time.perf_counter()
        if comm.rank == 0:
            comm.send(array, 2 if mode == "direct" else 1, TAG)
            began = comm.bcast_array(np.array([began]), root=0)[0]  # (before the flush: rank 1 waits in it)
            comm.flush()
        elif comm.rank == 1:
            comm.bcast_array(np.zeros(1), root=0)
            if mode == "relay":
                start = time.process_time()
                comm.send(comm.recv(0, TAG, (), np.float32), 2, TAG)
                comm.flush()
                cpu += time.process_time() - start
        else:
            arrived = comm.recv(0 if mode == "direct" else 1, TAG, (), np.float32)
            end = time.perf_counter()
            began = comm.bcast_array(np.zeros(1), root=0)[0]
            times.append(end - began)
            assert arrived.size == array.size
    median = comm.bcast_json(statistics.median(times) if comm.rank == 2 else None, root=2)
    return median, comm.bcast_json(cpu / repeats if comm.rank == 1 else None, root=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    if comm.size != 3:
        raise SystemExit("run on 3 ranks: mpirun -n 3 python benchmarks/crossings.py")
    sizes = [4 * 1024, 128 * 1024, 1024 * 1024, 8 * 1024 * 1024]
    results = {(size, mode): [] for size in sizes for mode in ("direct", "relay")}
    for _ in range(args.rounds):
        for size in sizes:
            for mode in ("direct", "relay"):
                results[(size, mode)].append(one_way(comm, size, mode, args.repeats))
    if comm.rank == 0:
        header = f"{'bytes':>10}  {'direct (us)':>12}  {'relay (us)':>11}  {'relay / direct':>14}"
        print(f"{header}  {'rank 1 CPU per relay (us)':>26}")
        for size in sizes:
            direct = statistics.median(t for t, _ in results[(size, "direct")])
            relay = statistics.median(t for t, _ in results[(size, "relay")])
            cpu = statistics.median(c for _, c in results[(size, "relay")])
            row = f"{size:>10}  {direct * 1e6:>12.1f}  {relay * 1e6:>11.1f}  {relay / direct:>14.2f}"
            print(f"{row}  {cpu * 1e6:>26.1f}")


if __name__ == "__main__":
    main()
