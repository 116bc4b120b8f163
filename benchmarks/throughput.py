"""Training throughput of PipelineModel beside plain Keras, on this machine.

    python benchmarks/throughput.py            # the whole table (several minutes)
    python benchmarks/throughput.py --quick    # fewer repetitions

Measures steady-state samples per second (the first epoch, which traces the
graphs, is excluded; the median of the timed epochs is reported) of:

  (a) keras.Sequential in one process using all cores,
  (b) keras.Sequential restricted to one core,
  (c) PipelineModel on 1 rank (all cores), m = 1 (its default) and 4,
  (d) PipelineModel on 2 ranks with each schedule,

for an MLP 784 -> 2048x4 -> 10 and a deeper, narrower one (784 -> 512x16 ->
10), with m = 4 and 8 micro-batches for (d), batch 64. Pipeline efficiency = measured / (P * m / (m + P - 1)
* speed of (b)): the fraction of the ideal pipeline of single-core stages.

Replicas (``num_stages``) against stages on the same cores, with the cost
model's predictions: ``python benchmarks/scaling.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {
    "mlp-2048x4": dict(width=2048, depth=4),
    "deep-512x16": dict(width=512, depth=16),
}
BATCH = 64
STEPS_PER_EPOCH = 24


def build_layers(width, depth):
    import keras

    layers = [keras.Input((784,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(10, activation="softmax"))
    return layers


def make_data(n):
    """``n`` random 784-feature samples and labels of 10 classes, the same in every process."""
    import numpy as np

    x = np.random.default_rng(0).normal(size=(n, 784)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, size=n)
    return x, y


def worker(args):
    """Runs inside mpirun (or alone); rank 0 prints one JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.kind == "sequential":
        import tensorflow as tf

        if args.threads:
            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
            tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import keras
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    keras.utils.set_random_seed(0)
    n = BATCH * STEPS_PER_EPOCH
    x, y = make_data(n)
    spec = MODELS[args.model]
    if args.kind == "sequential":
        model = keras.Sequential(build_layers(**spec))
    else:
        from keras_pipe import PipelineModel

        model = PipelineModel(build_layers(**spec), num_microbatches=args.microbatches, schedule=args.schedule)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    times = []
    model.fit(x, y, batch_size=BATCH, epochs=1 + args.epochs, shuffle=False, verbose=0, callbacks=[Timer()])
    speeds = [n / t for t in times[1:]]
    if rank == 0:
        print("RESULT " + json.dumps({"samples_per_s": statistics.median(speeds), "all": speeds}), flush=True)


def launch(ranks, *worker_args, env=None):
    """Samples per second of one configuration (see :func:`launch_script`)."""
    return launch_script(Path(__file__).resolve(), ranks, *worker_args, env=env)["samples_per_s"]


def launch_script(script: Path, ranks, *worker_args, env=None) -> dict:
    """Runs ``script --worker ...`` on ``ranks`` ranks; returns the JSON its rank 0 printed after ``RESULT``."""
    mpirun = Path(sys.executable).parent / "mpirun"
    command = [sys.executable, str(script), "--worker", *worker_args]
    if ranks > 1 or mpirun.exists():
        command = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(ranks), *command]
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=environment)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout}\n{out.stderr}")


def main():
    parser = argparse.ArgumentParser(description="PipelineModel throughput beside plain Keras.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="sequential", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp-2048x4", choices=sorted(MODELS))
    parser.add_argument("--microbatches", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per run")
    parser.add_argument("--quick", action="store_true", help="2 timed epochs per run")
    parser.add_argument("--models", nargs="*", default=sorted(MODELS), help="models to run")
    parser.add_argument("--smoke", action="store_true", help="one model, (a), (b) and (d) 1f1b m=8, 1 timed epoch")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    epochs = "2" if args.quick else str(args.epochs)
    if args.smoke:
        epochs, args.models = "1", ["deep-512x16"]
    print(f"host: {os.cpu_count()} cores; batch {BATCH}; {STEPS_PER_EPOCH} steps per epoch; median of {epochs} epochs")
    header = f"{'model':<13} {'configuration':<34} {'samples/s':>10} {'vs (a)':>7} {'efficiency':>10}"
    print(header)
    print("-" * len(header))
    for model in args.models:
        common = ["--model", model, "--epochs", epochs]
        a = launch(1, "--kind", "sequential", *common)
        b = launch(1, "--kind", "sequential", "--threads", "1", *common)
        rows = [("(a) Sequential, all cores", a, None), ("(b) Sequential, 1 core", b, None)]
        for m in () if args.smoke else (1, 4):
            c = launch(1, "--kind", "pipeline", "--microbatches", str(m), *common)
            rows.append((f"(c) PipelineModel 1 rank, m={m}", c, None))
        for m in (8,) if args.smoke else (4, 8):
            for schedule in ("1f1b",) if args.smoke else ("1f1b", "gpipe"):
                d = launch(2, "--kind", "pipeline", "--microbatches", str(m), "--schedule", schedule, *common)
                ideal = 2 * m / (m + 1) * b
                rows.append((f"(d) PipelineModel 2 ranks {schedule}, m={m}", d, d / ideal))
        for name, speed, efficiency in rows:
            eff = f"{100 * efficiency:9.1f}%" if efficiency is not None else ""
            print(f"{model:<13} {name:<34} {speed:10.1f} {speed / a:7.2f} {eff:>10}", flush=True)


if __name__ == "__main__":
    main()
