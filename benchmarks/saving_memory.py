"""Each rank's peak memory growth and seconds while a pipeline saves and loads, against its share of the model.

    python benchmarks/saving_memory.py                     # 2 and 4 ranks, 24 x Dense(2048) + Adam: 1.1 GiB of state
    python benchmarks/saving_memory.py --ranks 4 --depth 8 --width 1024

The model is issue 59's: ``Input(W)`` -> ``D`` x ``Dense(W)`` -> ``Dense(10)``,
Adam, ``PipelineModel(layers, num_microbatches=4)``, one batch of ``fit`` so
that the optimizer holds its slots. Its training state (weights and Adam's
two slots) is P times a rank's share. Then one route a user calls, one route
a job (so that what an earlier route's allocations left in the allocator does
not hide or inflate the next's): around it, every rank resets its peak
resident memory (Linux's ``/proc/self/clear_refs``), and reports the peak's
growth over its resident memory just before the call, and the call's
seconds. A first job writes the files the loading routes read. The routes:

- ``save_weights(.weights.h5)``, ``save(.keras)``: one file, written by rank 0;
- ``save_weights(.weights.json)``: the sharded checkpoint, a stage a rank;
- ``load_weights`` of each into the model;
- a new pipeline that reads each (what a resumed job does): ``keras_pipe.load_model(.keras)``,
  and ``PipelineModel`` + ``compile`` + ``load_weights(.weights.json)``; these allocate the new
  model's stage and optimizer, one share;
- ``plain Keras: keras.models.load_model(.keras)`` (not by default): Keras' own load of the whole
  model on every rank, the yardstick for the "new pipeline" rows on one rank, where a rank's share
  is the whole model (``--ranks 1 --routes ...``, the three loading routes).

Each row gives, per rank, the growth in MiB and as a multiple of the rank's
share (its stage's weights and optimizer variables), and the largest single
variable. The goals (issue 59): saving at most 0.25 x share + the largest
variable, loading at most 1.1 x share + the largest variable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

MIB = 1024**2
ROUTES = (
    "save_weights .weights.h5",
    "save_weights .weights.json",
    "save .keras",
    "load_weights .weights.h5",
    "load_weights .weights.json",
    "new pipeline: load_model .keras",
    "new pipeline: load_weights .weights.json",
    "plain Keras: keras.models.load_model .keras",
)
DEFAULT_ROUTES = ROUTES[:-1]  # (the plain Keras row: the whole model on every rank; run it with --ranks 1)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the peak resident memory, VmHWM, becomes the current one)


def layers(args):
    import keras

    return [
        keras.Input((args.width,)),
        *[keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)],
        keras.layers.Dense(10),
    ]


def rank_main(args) -> None:
    import keras
    import numpy as np

    import keras_pipe
    from keras_pipe import PipelineModel

    def compiled(model):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", jit_compile=False)
        return model

    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, args.width)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, size=64)
    model = compiled(PipelineModel(layers(args), num_microbatches=4))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    rank = model.engine.world.rank
    share = sum(v.numpy().nbytes for v in model.weights) + sum(v.numpy().nbytes for v in model.optimizer.variables)
    largest = max(v.numpy().nbytes for v in model.weights)
    tmp = args.directory
    kept = []

    def new_sharded():
        fresh = compiled(PipelineModel(layers(args), num_microbatches=4))
        fresh.build()
        fresh.load_weights(f"{tmp}/m.weights.json")
        kept.append(fresh)

    def write_all():
        model.save_weights(f"{tmp}/m.weights.h5")
        model.save_weights(f"{tmp}/m.weights.json")
        model.save(f"{tmp}/m.keras")

    actions = {
        "prepare": write_all,
        "save_weights .weights.h5": lambda: model.save_weights(f"{tmp}/m.weights.h5"),
        "save_weights .weights.json": lambda: model.save_weights(f"{tmp}/m.weights.json"),
        "save .keras": lambda: model.save(f"{tmp}/m.keras"),
        "load_weights .weights.h5": lambda: model.load_weights(f"{tmp}/m.weights.h5"),
        "load_weights .weights.json": lambda: model.load_weights(f"{tmp}/m.weights.json"),
        "new pipeline: load_model .keras": lambda: kept.append(keras_pipe.load_model(f"{tmp}/m.keras")),
        "new pipeline: load_weights .weights.json": new_sharded,
        "plain Keras: keras.models.load_model .keras": lambda: kept.append(keras.models.load_model(f"{tmp}/m.keras")),
    }
    world = model.engine.world
    world.barrier()
    _reset_peak()
    before = _status("VmRSS")
    began = time.perf_counter()
    actions[args.route]()
    world.barrier()
    seconds = time.perf_counter() - began
    growth = _status("VmHWM") - before
    rows = world.allgather_json([rank, growth, share, largest, seconds])
    if rank == 0:
        print("ROW " + json.dumps({"route": args.route, "ranks": world.size, "rows": rows}), flush=True)


def run(args) -> None:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    results = []
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as directory:
            for route in ["prepare", *args.routes]:
                command = [mpirun, "-n", str(ranks), sys.executable, __file__, "--rank-main", "--directory", directory]
                command += ["--width", str(args.width), "--depth", str(args.depth), "--route", route]
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                found = [json.loads(m) for m in re.findall(r"ROW (\{.*?\]\]\})", done.stdout)]
                if done.returncode != 0 or len(found) != 1:
                    output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                    sys.exit(f"{ranks} ranks, {route}: failed ({done.returncode}):\n{output}")
                if route != "prepare":
                    results += found
    print(f"model: {args.depth} x Dense({args.width}) + Dense(10), Adam; growth in MiB (x the rank's share)")
    for ranks in args.ranks:
        rows = [r for r in results if r["ranks"] == ranks]
        share, largest = rows[0]["rows"][0][2], rows[0]["rows"][0][3]
        print(f"\n{ranks} ranks: a rank's share {share / MIB:.0f} MiB, the largest variable {largest / MIB:.0f} MiB")
        print(f"| route | {' | '.join(f'rank {r}' for r in range(ranks))} | seconds |")
        print(f"|---|{'---|' * ranks}---|")
        for row in rows:
            cells = [f"{g / MIB:+.0f} ({g / s:.2f}x)" for _, g, s, _, _ in sorted(row["rows"])]
            print(f"| {row['route']} | {' | '.join(cells)} | {max(r[4] for r in row['rows']):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--routes", nargs="+", default=list(DEFAULT_ROUTES), choices=ROUTES)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--route", help=argparse.SUPPRESS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
