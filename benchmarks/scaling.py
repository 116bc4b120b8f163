"""Replicas versus stages on the same cores, and the cost model checked against them.

    python benchmarks/scaling.py            # both models (several minutes)
    python benchmarks/scaling.py --quick    # one model, 2 timed epochs

For each model, at a global batch of 64 (steady state, median of the timed
epochs, the first epoch excluded), measures

  one process        keras.Sequential using every core, and PipelineModel on 1 rank;
  1 x 2              PipelineModel(num_stages=1) on 2 ranks: two replicas, each on half of every batch;
  2 x 1              PipelineModel(num_stages=2) on 2 ranks: one pipeline, m = 4 and 8 micro-batches;

(the 2-rank rows are the best of 2 launches: now and then a whole launch on
this machine runs at half speed, whatever the configuration),

then fits the cost model's constants (keras_pipe/schedules/cost.py) on this machine
from separate one-rank, one-thread runs and MPI micro-benchmarks, and prints
its prediction beside each measurement:

  c, o + g P   per micro-batch forward + input-gradient time at b = 64 and 16 samples (line through 2 points)
  o            the same for a model of the same depth and width 8 (launching the calls)
  u P          the batched weight gradients and the update (one program a step)
  h            the rest of a step (step time - forward+backward - update)
  a, bw_p2p    ping-pong of 8 bytes and of 16 MB between 2 ranks
  bw_ar        all-reduce of the model's gradient size over 2 ranks

The compute constants are measured twice: on one rank alone ("solo", used
for the one-rank prediction) and as two independent one-rank runs at the
same time ("loaded", used for the two-rank predictions), because on this
machine two busy cores share one memory bus and each runs slower than alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import BATCH, MODELS, STEPS_PER_EPOCH, build_layers, launch_script, make_data  # noqa: E402


def worker(args):
    """Runs inside mpirun (or alone); rank 0 prints one RESULT line."""
    import keras
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    keras.utils.set_random_seed(0)
    n = BATCH * STEPS_PER_EPOCH
    x, y = make_data(n)
    spec = dict(MODELS[args.model], **({"width": 8} if args.tiny else {}))
    if args.kind == "sequential":
        model = keras.Sequential(build_layers(**spec))
    else:
        from keras_pipe import PipelineModel

        model = PipelineModel(build_layers(**spec), num_stages=args.stages, num_microbatches=args.microbatches)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    times, spans = [], []

    class Recorder:
        def span(self, name, step, microbatch, start, end):
            spans.append((name, step, microbatch, start, end))

    recorder = Recorder()

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

        def on_train_batch_begin(self, batch, logs=None):
            if args.kind == "calibrate" and len(times) >= 1:
                self.model.tracer = recorder

    model.fit(x, y, batch_size=BATCH, epochs=1 + args.epochs, shuffle=False, verbose=0, callbacks=[Timer()])
    result = {"samples_per_s": statistics.median(n / t for t in times[1:])}
    if args.kind == "calibrate":
        for name in ("forward+backward", "optimizer"):
            # (with a split backward the update runs inside the last "weights" span)
            matching = [end - start for span, _, _, start, end in spans if span == name]
            if name == "optimizer" and not matching:
                matching = [end - start for span, _, _, start, end in spans if span == "weights"]
            result[name] = statistics.median(matching) if matching else 0.0
        result["params"] = model.count_params()
        step = BATCH / result["samples_per_s"]
        result["step_overhead"] = step - args.microbatches * result["forward+backward"] - result["optimizer"]
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def links_worker(args):
    """Ping-pong and all-reduce between 2 ranks, with keras_pipe's Communicator."""
    import numpy as np
    from mpi4py import MPI

    from keras_pipe.mpi.comm import Communicator

    comm = Communicator(MPI.COMM_WORLD)
    result = {}
    for nbytes in (8, 16 << 20):
        a = np.zeros(nbytes // 4, np.float32)
        comm.barrier()
        began = time.perf_counter()
        for _ in range(50 if nbytes < 1024 else 5):
            if comm.rank == 0:
                comm.send(a, 1, 11)
                comm.recv(1, 11, (), np.float32)
            else:
                comm.recv(0, 11, (), np.float32)
                comm.send(a, 0, 11)
            comm.flush()
        result[f"oneway_{nbytes}"] = (time.perf_counter() - began) / (100 if nbytes < 1024 else 10)
    result["p2p_latency_s"] = result["oneway_8"]
    result["p2p_bytes_per_s"] = (16 << 20) / max(result[f"oneway_{16 << 20}"] - result["oneway_8"], 1e-9)
    grads = np.zeros(args.params, np.float32)
    samples = []
    for _ in range(5):
        comm.barrier()
        began = time.perf_counter()
        comm.wait_all(comm.start_allreduce_sum([grads]), "allreduce")
        samples.append(time.perf_counter() - began)
    seconds = statistics.median(samples)
    result["allreduce_s"] = seconds
    result["allreduce_bytes_per_s"] = 2 * 0.5 * 4 * args.params / seconds  # ring: 2 (R-1)/R of the bytes
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(ranks, *worker_args, env=None):
    return launch_script(Path(__file__).resolve(), ranks, *worker_args, env=env)


def main():
    parser = argparse.ArgumentParser(description="Replicas versus stages, and the cost model.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="sequential", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp-2048x4", choices=sorted(MODELS))
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per run")
    parser.add_argument("--quick", action="store_true", help="one model, 2 timed epochs")
    parser.add_argument("--models", nargs="*", default=sorted(MODELS))
    args = parser.parse_args()
    if args.worker:
        return links_worker(args) if args.kind == "links" else worker(args)
    from keras_pipe.schedules.cost import Workload, estimate

    epochs = "2" if args.quick else str(args.epochs)
    models = ["mlp-2048x4"] if args.quick else args.models
    print(f"host: {os.cpu_count()} cores; global batch {BATCH}; {STEPS_PER_EPOCH} steps per epoch; median of {epochs}")
    header = f"{'model':<12} {'configuration':<44} {'measured':>9} {'model':>9} {'vs (a)':>7}"
    print(header + "\n" + "-" * len(header))
    for name in models:
        common = ["--model", name, "--epochs", epochs]
        solo = calibrate(common, concurrent=1)
        loaded = calibrate(common, concurrent=2)  # two independent one-rank runs at once: both cores busy
        params = solo["full"]["params"]
        links = launch(2, "--kind", "links", "--params", str(params))
        solo, loaded = fit_machine(solo, links), fit_machine(loaded, links)
        width = MODELS[name]["width"]
        work = Workload(params=params, activation_bytes=4 * width, batch=BATCH)
        a = launch(1, "--kind", "sequential", *common)["samples_per_s"]
        rows = [("(a) one process: Sequential, all cores", a, None)]
        rows.append(
            (
                "(b) one process: PipelineModel 1 rank, all cores",
                launch(1, "--kind", "pipeline", *common)["samples_per_s"],
                None,
            )
        )
        one_core = launch(1, "--kind", "pipeline", *common, env=ONE_THREAD)["samples_per_s"]
        rows.append(("(b1) PipelineModel 1 rank, 1 core", one_core, estimate(work, solo, 1, 1)))
        measured = best(2, "--kind", "pipeline", "--stages", "1", *common)
        rows.append(("(e) 1 x 2: two replicas, 1 stage each", measured, estimate(work, loaded, 1, 2)))
        for m in (4, 8):
            measured = best(2, "--kind", "pipeline", "--stages", "2", "--microbatches", str(m), *common)
            work_m = Workload(params=params, activation_bytes=4 * width, batch=BATCH, num_microbatches=m)
            rows.append(
                (
                    f"(d) 2 x 1: one pipeline of 2 stages, m={m}",
                    measured,
                    estimate(work_m, loaded, 2, 1),
                )
            )
        for label, speed, predicted in rows:
            model_speed = f"{predicted.samples_per_s:9.1f}" if predicted is not None else ""
            print(f"{name:<12} {label:<44} {speed:9.1f} {model_speed:>9} {speed / a:7.2f}", flush=True)
        for label, machine in (("solo", solo), ("loaded", loaded)):
            print(
                f"{name:<12} {label:>6}: c = {1e6 * machine.compute_s_per_sample:.0f} us/sample, o = "
                f"{1e3 * machine.microbatch_overhead_s:.1f} ms + gP = {1e3 * machine.grad_s_per_param * params:.1f} "
                "ms per micro-batch, uP = "
                f"{1e3 * machine.update_s_per_param * params:.1f} ms, h = {1e3 * machine.step_overhead_s:.1f} ms"
            )
        print(
            f"{name:<12}  links: p2p {1e6 * links['p2p_latency_s']:.0f} us + {links['p2p_bytes_per_s'] / 1e9:.2f} "
            f"GB/s, all-reduce of {4 * params / 1e6:.0f} MB over 2 ranks: {1e3 * links['allreduce_s']:.1f} ms",
            flush=True,
        )


ONE_THREAD = {"KERAS_PIPE_THREADS": "1"}


def _mean(results: list[dict]) -> dict:
    return {key: statistics.mean(r[key] for r in results) for key in results[0]}


def best(ranks, *worker_args, launches: int = 2) -> float:
    """The best samples/s of ``launches`` launches: this machine has slow launches now and then (noise)."""
    return max(launch(ranks, *worker_args)["samples_per_s"] for _ in range(launches))


def calibrate(common: list[str], concurrent: int) -> dict:
    """One-rank, one-thread runs (``concurrent`` at once): the whole model at m = 1 and 4, a tiny one at m = 1."""
    runs = {
        "full": ["--microbatches", "1"],
        "quarter": ["--microbatches", "4"],
        "tiny": ["--microbatches", "1", "--tiny"],
    }
    results = {}
    with ThreadPoolExecutor(concurrent) as pool:
        for key, extra in runs.items():
            arguments = ["--kind", "calibrate", *common, *extra]
            results[key] = _mean(
                list(pool.map(lambda _, a=arguments: launch(1, *a, env=ONE_THREAD), range(concurrent)))
            )
    return results


def fit_machine(calibration: dict, links: dict):
    """Cost-model constants from the one-rank calibration runs and the link micro-benchmarks.

    ``c`` and the fixed per-micro-batch cost from the line through m = 1 and
    m = 4 of the forward + input gradient spans; of the fixed cost, ``o`` is
    what a model of the same depth but width 8 pays (launching the calls),
    the rest ``g P`` (the weights each micro-batch's thin products read
    again, which a stage pays for its own weights only). ``u P`` is the
    batched weight gradients with the update, one program a step.
    """
    from keras_pipe.schedules.cost import Machine

    full, quarter, tiny = calibration["full"], calibration["quarter"], calibration["tiny"]
    c = (full["forward+backward"] - quarter["forward+backward"]) / (BATCH - BATCH // 4)
    fixed = full["forward+backward"] - BATCH * c
    dispatch = min(tiny["forward+backward"], fixed)
    return Machine(
        compute_s_per_sample=c,
        microbatch_overhead_s=dispatch,
        grad_s_per_param=(fixed - dispatch) / full["params"],
        update_s_per_param=full["optimizer"] / full["params"],
        step_overhead_s=full["step_overhead"],
        p2p_latency_s=links["p2p_latency_s"],
        p2p_bytes_per_s=links["p2p_bytes_per_s"],
        allreduce_bytes_per_s=links["allreduce_bytes_per_s"],
        allreduce_latency_s=0.0,
    )


if __name__ == "__main__":
    main()
