"""Peak memory per rank of PipelineModel beside keras.Sequential, with and without recomputation.

    python benchmarks/memory.py                          # weights dominate
    python benchmarks/memory.py --workload activations   # activations dominate
    python benchmarks/memory.py --make from_model,unallocated --ranks 4 --recompute never
    python benchmarks/memory.py --deepest 3.0            # the deepest chain that trains in 3 GiB a process
    python benchmarks/memory.py --workload activations --ranks 4 --microbatches 4,8   # 1F1B's bound at m > P

``weights``: a model whose weights plus Adam state take several GiB (12 Dense
layers of 4096 x 4096: 201M parameters, 0.75 GiB of weights, 3 GiB with
gradients and Adam's two slots) at batch 16. ``activations``: 16 Dense layers
of 1024 at batch 8192, where a batch's activations (0.5 GiB a layer's input
and output, kept for the backward) outweigh the weights.

Each is trained for a few steps on 1, 2 and 4 ranks, with ``recompute="never"``
and ``"always"``, and each rank's peak resident memory is printed beside
Sequential's. ``--make`` says how the pipeline is made: ``list`` (from the
list of layers, the default), ``from_model`` (a ``keras.Sequential`` built
whole on every rank, then ``PipelineModel.from_model``: each rank frees the
other stages' weights) or ``unallocated`` (the Sequential created inside
``keras_pipe.unallocated()``: each rank allocates only its own stage's); for
these the resident memory just after the pipeline is made is printed too.
The TensorFlow runtime's fixed cost (a process that imports
everything and trains a tiny model, once with Sequential and once with
PipelineModel) is measured too, and subtracted for the comparison with 1/P of
Sequential's. The last columns also take from each rank the data set its
script creates (every rank runs the same script, as with any MPI program),
and from the first stage, which reads it, Keras' input pipeline too (measured
as a model of no layers, as for Sequential).

``--microbatches`` (default 4) sets the micro-batches of every pipeline row;
several values, with commas, give a row each. 1F1B holds at most ``P - s``
micro-batches on stage ``s``: with ``m = P`` the first stage holds every
micro-batch of the batch (its whole share of the activations), with
``m = 2P`` half of them.

``--deepest LIMIT`` answers what a pipeline user asks: how deep a chain of
``Dense(4096)`` layers (batch 16, Adam) trains when no process may use more
than ``LIMIT`` GiB. Each depth is tried by training it (two steps), a try
fitting when every rank's peak resident memory stayed within the limit;
the deepest fitting depth of ``Sequential`` and of ``PipelineModel`` on each
``--ranks`` is found by bisection, and shown against ``P`` times
``Sequential``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

WORKLOADS = {"weights": (4096, 12, 16), "activations": (1024, 16, 8192)}  # width, depth, batch
STEPS = 3


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def worker(
    kind: str, width: int, depth: int, batch: int, recompute: str, make: str = "list", microbatches: int = 4
) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    from keras_pipe.mpi.comm import Communicator

    comm = Communicator()
    layers = [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(10))
    made = None
    if kind == "sequential":
        model = keras.Sequential(layers)
    elif make == "list":
        from keras_pipe import PipelineModel

        model = PipelineModel(layers, num_microbatches=microbatches, recompute=recompute)
    else:
        import keras_pipe

        if make == "unallocated":
            with keras_pipe.unallocated():
                whole = keras.Sequential(layers)
        else:
            whole = keras.Sequential(layers)
        model = keras_pipe.PipelineModel.from_model(whole, num_microbatches=microbatches, recompute=recompute)
        made = current_rss_gib()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # (drawn as float32: a float64 draw converted after would hold three times the data set for a moment,
    # the peak of every rank that trains little)
    x = np.random.default_rng(0).standard_normal(size=(batch * STEPS, width), dtype="float32")
    y = np.random.default_rng(1).integers(0, 10, size=batch * STEPS)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    peaks = comm.allgather_json(peak_rss_gib())
    made = comm.allgather_json(made)
    if comm.rank == 0:
        print("RESULT " + json.dumps(peaks), flush=True)
        if made[0] is not None:
            print("MADE " + json.dumps(made), flush=True)


def launch(
    ranks: int,
    kind: str,
    width: int,
    depth: int,
    batch: int,
    recompute: str = "never",
    make: str = "list",
    microbatches: int = 4,
) -> tuple[list[float], list[float] | None]:
    """Each rank's peak resident memory, and (``from_model``, ``unallocated``) its memory once the model is made."""
    mpirun = Path(sys.executable).parent / "mpirun"
    command = [str(mpirun) if mpirun.exists() else "mpirun", "-n", str(ranks), sys.executable, __file__]
    command += ["--worker", kind, "--width", str(width), "--depth", str(depth), "--batch", str(batch)]
    command += ["--recompute", recompute, "--make", make, "--microbatches", str(microbatches)]
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=1800, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    )
    lines = out.stdout.splitlines()
    for line in lines:
        if line.startswith("RESULT "):
            made = [json.loads(m[len("MADE ") :]) for m in lines if m.startswith("MADE ")]
            return json.loads(line[len("RESULT ") :]), (made[0] if made else None)
    raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout}\n{out.stderr}")


def fits(ranks: int, depth: int, limit: float) -> bool:
    """Whether a chain of ``depth`` Dense(4096) layers trains with every rank within ``limit`` GiB (by training)."""
    kind = "sequential" if ranks == 0 else "pipeline"
    try:
        peaks, _ = launch(max(ranks, 1), kind, 4096, depth, 16)
    except RuntimeError:
        return False  # (killed, out of memory)
    print(f"  {kind} on {max(ranks, 1)} process(es), {depth} layers: peak {max(peaks):.2f} GiB", flush=True)
    return max(peaks) <= limit


def deepest(ranks: int, limit: float, low: int, high: int) -> int:
    """The deepest fitting depth, by bisection between a depth that fits (``low``) and one that does not (``high``)."""
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(ranks, middle, limit) else (low, middle)
    return low


def deepest_table(ranks_list: list[int], limit: float) -> None:
    print(f"the deepest chain of Dense(4096) (batch 16, Adam) that trains with every process within {limit} GiB:")
    high = 2
    while fits(0, high, limit):
        high *= 2
    sequential = deepest(0, limit, high // 2 if high > 2 else 0, high)
    rows = [f"{'Sequential, 1 process':<32} {sequential:>6}"]
    for ranks in ranks_list:
        low = max(sequential, 1)
        high = ranks * sequential + ranks + 1
        while fits(ranks, high, limit):
            low, high = high, high * 2
        depth = deepest(ranks, limit, low, high)
        ratio = depth / (ranks * sequential) if sequential else float("nan")
        rows.append(f"{f'PipelineModel, {ranks} rank(s)':<32} {depth:>6}   {ratio:.2f} x P x Sequential's")
    print("\n".join(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Peak memory per rank, PipelineModel beside Sequential.")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="weights")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", default="never,always", help="never, always or both (the default)")
    parser.add_argument("--make", default="list", help="list, from_model, unallocated, or several with commas")
    parser.add_argument("--microbatches", default="4", help="micro-batches of each pipeline row, several with commas")
    parser.add_argument("--deepest", type=float, metavar="LIMIT", help="GiB per process: the deepest chain that fits")
    args = parser.parse_args()
    if args.worker:
        return worker(
            args.worker, args.width, args.depth, args.batch, args.recompute, args.make, int(args.microbatches)
        )
    if args.deepest:
        return deepest_table(list(map(int, args.ranks.split(","))), args.deepest)
    width, depth, batch = WORKLOADS[args.workload]
    params = depth * (width * width + width) + width * 10 + 10
    print(
        f"model: {depth} x Dense({width}) + Dense(10) at batch {batch}, {args.microbatches} micro-batches: "
        f"{params / 1e6:.0f}M parameters, {params * 4 / 2**30:.2f} GiB of weights, "
        f"{4 * params * 4 / 2**30:.2f} GiB with gradients and Adam; one layer's activations for the batch "
        f"{batch * width * 4 / 2**30:.2f} GiB"
    )
    runtime_sequential = launch(1, "sequential", 8, 1, 16)[0][0]
    runtime = launch(1, "pipeline", 8, 1, 16)[0][0]
    # the same, with the workload's data set (no layer between the input and the output)
    data_sequential = launch(1, "sequential", width, 0, batch)[0][0]
    data_runtime = launch(1, "pipeline", width, 0, batch)[0][0]
    data_set = (batch * STEPS * (width * 4 + 8)) / 2**30  # x (float32) and y (int64): every rank's script holds them
    sequential = launch(1, "sequential", width, depth, batch)[0][0]
    print(
        f"fixed cost per process (a tiny model trained): Sequential {runtime_sequential:.2f} GiB, "
        f"PipelineModel {runtime:.2f} GiB (TensorFlow, MPI, XLA); with this workload's data set and Keras' input "
        f"pipeline: {data_sequential:.2f} and {data_runtime:.2f} GiB"
    )
    print(
        "ratio: the largest peak minus the runtime, against 1/P of Sequential's; model's ratio: each rank's peak "
        "minus what it holds whatever the model (the runtime and the data set, which every rank's script creates, "
        f"{data_set:.2f} GiB; on the first stage, which reads it as Sequential does, the runtime with the data set "
        "and Keras' input pipeline), against 1/P of Sequential's peak minus its runtime, data set and input pipeline"
    )
    print(
        f"{'configuration':<40} {'peak RSS per rank (GiB)':<26} {'max - runtime':>13} "
        f"{'(Seq - runtime)/P':>18} {'ratio':>6} {'model per rank':>22} {'share':>6} {'ratio':>6}"
    )
    print(
        f"{'Sequential, 1 process':<40} {sequential:<26.2f} {sequential - runtime_sequential:13.2f}"
        f"{'':>26} {sequential - data_sequential:22.2f}"
    )
    rows = [
        (make, ranks, recompute, micro)
        for make in args.make.split(",")
        for ranks in map(int, args.ranks.split(","))
        for micro in map(int, args.microbatches.split(","))
        for recompute in args.recompute.split(",")
    ]
    for make, ranks, recompute, micro in rows:
        peaks, made = launch(ranks, "pipeline", width, depth, batch, recompute, make, micro)
        mine = max(peaks) - runtime
        ideal = (sequential - runtime_sequential) / ranks
        model = [p - (data_runtime if rank == 0 else runtime + data_set) for rank, p in enumerate(peaks)]
        share = (sequential - data_sequential) / ranks
        shown = " ".join(f"{p:.2f}" for p in peaks)
        name = f"PipelineModel, {ranks} rank(s), {recompute}" + ("" if make == "list" else f", {make}")
        name += "" if args.microbatches == "4" else f", m={micro}"
        print(
            f"{name:<40} {shown:<26} {mine:13.2f} {ideal:18.2f} {mine / ideal:6.2f} "
            f"{' '.join(f'{m:.2f}' for m in model):>22} {share:6.2f} {max(model) / share:6.2f}",
            flush=True,
        )
        if made is not None:
            after = " ".join(f"{m:.2f}" for m in made)
            share = max(made) - runtime
            print(f"{'  resident once made (GiB)':<40} {after:<26} {share:13.2f}", flush=True)


if __name__ == "__main__":
    main()
