"""Tokens/s and each rank's peak memory of a pipelined ``generate()`` against the unsplit model's, in one process.

    python benchmarks/generation.py                              # Llama, 2 and 4 ranks, 1 and P groups
    python benchmarks/generation.py --ranks 2 --layers 2 --hidden 16 --batch 4 --length 8 --repeats 1   # tiny
    python benchmarks/generation.py --ranks 2 4 --replicas 1 2   # also two replicas of half as many stages

The model is a keras_hub ``LlamaCausalLM`` built from constructor arguments
(``--layers`` decoder layers of width ``--hidden``, ``--vocabulary`` tokens;
nothing downloaded), greedy, ``preprocessor=None``. The prompts are
``--batch`` rows of 4 to 8 tokens padded to ``--length``; with
``stop_token_ids=None`` every row decodes to ``--length``, so the tokens
generated are ``batch x (length - shortest prompt)``. Each job makes its
model, calls ``generate()`` once to trace its functions, then times
``--repeats`` calls (prefill included) and reads each rank's peak resident
memory (``VmHWM`` of ``/proc/self/status``) and its growth over the resident
memory before the first call. Rows: the unsplit model in one process; the
pipeline on each rank count with one group and with P groups (``num_groups``),
for each number of ``--replicas`` (each replica generating its share of the batch).
The goal (issue 61): with P groups, tokens/s at least 0.8 x P x that of one group.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

MIB = 1024**2


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _model(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocabulary,
        num_layers=args.layers,
        num_query_heads=4 if args.hidden % 4 == 0 else 2,
        num_key_value_heads=2,
        hidden_dim=args.hidden,
        intermediate_dim=2 * args.hidden,
    )
    task = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    task.compile(sampler="greedy")
    return task


def _prompts(args):
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 9, size=args.batch)
    ids = rng.integers(1, args.vocabulary, size=(args.batch, args.length)).astype("int32")
    mask = np.arange(args.length)[None, :] < lengths[:, None]
    ids[~mask] = 0
    return {"token_ids": ids, "padding_mask": mask}, int(args.batch * (args.length - lengths.min()))


def _timed(generate, args):
    """``generate()`` once (tracing), then ``--repeats`` times: (seconds a call, peak bytes, growth bytes)."""
    before = _status("VmRSS")
    generate()
    began = time.perf_counter()
    for _ in range(args.repeats):
        generate()
    seconds = (time.perf_counter() - began) / args.repeats
    peak = _status("VmHWM")
    return seconds, peak, peak - before


def worker(args) -> None:
    """One job: the unsplit model (``--groups`` empty) or the pipeline with each number of groups; prints JSON."""
    x, tokens = _prompts(args)
    if args.worker == "unsplit":
        task = _model(args)
        seconds, peak, growth = _timed(lambda: task.generate(dict(x), stop_token_ids=None), args)
        print("RESULT " + json.dumps([dict(groups=0, seconds=seconds, tokens=tokens, peaks=[peak], growths=[growth])]))
        return
    from mpi4py import MPI

    from keras_pipe import PipelineModel

    model = PipelineModel.from_model(_model(args), num_stages=MPI.COMM_WORLD.Get_size() // args.replicas_now)
    rows = []
    for groups in sorted({1, model.num_stages}):
        seconds, peak, growth = _timed(
            lambda g=groups: model.generate(dict(x), stop_token_ids=None, num_groups=g), args
        )
        peaks = MPI.COMM_WORLD.allgather(peak)
        growths = MPI.COMM_WORLD.allgather(growth)
        rows.append(dict(groups=groups, seconds=seconds, tokens=tokens, peaks=peaks, growths=growths))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps(rows))


def _run(command, timeout) -> list:
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not found:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(found[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocabulary", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1], help="replicas of the pipeline (each rank count)"
    )
    parser.add_argument("--replicas-now", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["unsplit", "pipeline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    shape = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "vocabulary", "batch", "length", "repeats")]
    here = os.path.abspath(__file__)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    table = [("unsplit", 1, row) for row in _run([sys.executable, here, "--worker=unsplit", *shape], args.timeout)]
    for ranks in args.ranks:
        for replicas in args.replicas:
            if ranks % replicas:
                continue
            command = [mpirun, "-n", str(ranks), sys.executable, here, "--worker=pipeline", *shape]
            command.append(f"--replicas-now={replicas}")
            kind = "pipeline" if replicas == 1 else f"{ranks // replicas}x{replicas}"
            table += [(kind, ranks, row) for row in _run(command, args.timeout)]
    print(
        f"Llama {args.layers} layers x {args.hidden}, vocabulary {args.vocabulary}, batch {args.batch}, length "
        f"{args.length}; {args.repeats} timed calls"
    )
    print(f"{'model':9} {'ranks':>5} {'groups':>6} {'tokens/s':>9}  peak MiB per rank (growth)")
    print("(a model 'SxR': R replicas of S stages, each generating its share of the batch)")
    for kind, ranks, row in table:
        memory = "  ".join(f"{p / MIB:.0f} ({g / MIB:+.0f})" for p, g in zip(row["peaks"], row["growths"]))
        groups = "-" if kind == "unsplit" else row["groups"]
        print(f"{kind:9} {ranks:>5} {groups:>6} {row['tokens'] / row['seconds']:>9.1f}  {memory}")


if __name__ == "__main__":
    main()
