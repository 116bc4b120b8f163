"""Where one training step's time goes, per rank: the timeline's spans summed per step.

    mpirun -n 2 python benchmarks/step_spans.py --num-stages 1              # 1 x 2 replicas
    mpirun -n 2 python benchmarks/step_spans.py --num-stages 1 --model deep-512x16 --collective-spin 0
    mpirun -n 2 python benchmarks/step_spans.py --num-stages 2 --microbatches 4
    mpirun -n 2 python benchmarks/step_spans.py --num-stages 2 --microbatches 4 --workload balanced-b64 --jit False
    mpirun -n 2 python benchmarks/step_spans.py --num-stages 2 --microbatches 2 --schedule zb-h1 --workload balanced-b64

Trains the benchmark models of ``throughput.py`` (batch 64, 24 steps per
epoch, 3 epochs), records every step's spans (forward, backward, all-reduce,
optimizer, ...) after the first epoch and prints, per rank, the milliseconds
per step of each kind and the throughput. ``--collective-spin S`` sets how
long the gradient all-reduce polls before it starts sleeping
(``keras_pipe.mpi.comm.COLLECTIVE_SPIN_S``; 0 sleeps at once); ``--no-gc`` turns
Python's garbage collector off. ``--workload balanced-b64`` trains
``throughput.py``'s balanced chain (1024 -> 8 x Dense(1024), batch 64)
instead of ``--model``; ``--jit False`` compiles with
``jit_compile=False`` (plain graphs, no XLA); ``--schedule`` is
``PipelineModel``'s (default ``1f1b``).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import keras  # noqa: E402
from mpi4py import MPI  # noqa: E402
from throughput import (  # noqa: E402
    BATCH,
    MODELS,
    STEPS_PER_EPOCH,
    WORKLOADS,
    build_layers,
    jit_compile_of,
    make_data,
)

import keras_pipe.mpi.comm  # noqa: E402
from keras_pipe import PipelineModel  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp-2048x4", choices=sorted(MODELS))
    parser.add_argument("--num-stages", type=int, default=None)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--collective-spin", type=float, default=None, help="seconds (default: the library's)")
    parser.add_argument("--no-gc", action="store_true")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help="a throughput.py workload instead of --model")
    parser.add_argument("--schedule", default="1f1b", help="PipelineModel's schedule=")
    parser.add_argument("--jit", default="auto", choices=("auto", "True", "False"), help="compile(jit_compile=)")
    args = parser.parse_args()
    if args.collective_spin is not None:
        keras_pipe.mpi.comm.COLLECTIVE_SPIN_S = args.collective_spin
    if args.no_gc:
        gc.disable()
    batch, steps, chain = BATCH, STEPS_PER_EPOCH, dict(MODELS[args.model], features=784)
    if args.workload:
        spec = WORKLOADS[args.workload]
        batch, steps = spec["batch"], spec["steps"]
        chain = {key: spec[key] for key in ("features", "width", "depth")}
    n = batch * steps
    x, y = make_data(n, chain["features"])
    model = PipelineModel(
        build_layers(**chain), num_stages=args.num_stages, num_microbatches=args.microbatches, schedule=args.schedule
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=jit_compile_of(args.jit))
    spans, epochs = [], []

    class Recorder:
        def span(self, name, step, microbatch, start, end):
            spans.append((name, step, microbatch, start, end))

    recorder = Recorder()

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epochs.append(time.perf_counter() - self.began)

        def on_train_batch_begin(self, batch, logs=None):
            if epochs:  # the first epoch traces the graphs
                self.model.tracer = recorder
            self.step_began = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if epochs:
                spans.append(("whole step", 0, 0, self.step_began, time.perf_counter()))

    model.fit(x, y, batch_size=batch, epochs=3, shuffle=False, verbose=0, callbacks=[Record()])
    per_kind: dict = {}
    for name, _, _, began, ended in spans:
        per_kind[name] = per_kind.get(name, 0.0) + ended - began
    steps = sum(1 for span in spans if span[0] == "whole step")
    rank = MPI.COMM_WORLD.Get_rank()
    report = {name: round(1e3 * total / steps, 1) for name, total in per_kind.items()}
    speed = n / statistics.median(epochs[1:])
    print(f"rank {rank}: ms per step {json.dumps(report)}; {speed:.1f} samples/s", flush=True)


if __name__ == "__main__":
    main()
