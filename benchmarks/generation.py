"""Tokens/s and each rank's peak memory of a pipelined ``generate()`` against the unsplit model's, in one process.

    python benchmarks/generation.py                              # Llama, 2 and 4 ranks, 1 and P groups
    python benchmarks/generation.py --ranks 2 --layers 2 --hidden 16 --batch 4 --length 8 --repeats 1   # tiny
    python benchmarks/generation.py --ranks 2 4 --replicas 1 2   # also two replicas of half as many stages
    python benchmarks/generation.py --ranks 2 --threads 0 1      # each process on all cores, then on one
    python benchmarks/generation.py --model t5 --ranks 2 4       # T5 (encoder once, decoder by token)

The model is a keras_hub ``LlamaCausalLM`` (or, ``--model t5``, a
``T5Seq2SeqLM`` with ``--layers`` layers in each stack, its encoder given
prompts of 8 to ``--length`` tokens) built from constructor arguments
(``--layers`` decoder layers of width ``--hidden``, ``--vocabulary`` tokens;
nothing downloaded), greedy, ``preprocessor=None``. The prompts are
``--batch`` rows of 4 to 8 tokens padded to ``--length``; with
``stop_token_ids=None`` every row decodes to ``--length``, so the tokens
generated are ``batch x (length - shortest prompt)``. The pipeline's model
is made inside ``keras_pipe.unallocated()``: no rank ever holds more than
its own stage's weights. ``--threads N``: each
process's TensorFlow on N threads (0: its default, every core), for every
row; several values make a table each. Each job makes its
model, calls ``generate()`` once to trace its functions, then times
``--repeats`` calls (prefill included) and reads each rank's peak resident
memory (``VmHWM`` of ``/proc/self/status``, reset before each row) and that
peak over the process's resident size before its model was made (TensorFlow,
Keras and keras_hub imported): the model's weights, programs and generation.
Rows: the unsplit model in one process; the
pipeline on each rank count with one group and with P groups (``num_groups``),
for each number of ``--replicas`` (each replica generating its share of the batch),
and P groups of the one group's size (``P x batch`` prompts, the pipeline's fill
alone: the same work a group, P times the groups).
The goal (issue 61): with P groups, tokens/s at least 0.8 x P x that of one group.
Each rank's is also printed against its share of the unsplit model's
(``share``: the rank's over the unsplit process's / P), and the whole
key/value cache's size (every layer, every row) for scale.
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


def _threads(args):
    import tensorflow as tf

    if args.threads_now:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads_now)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads_now)


def _model(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(1)
    if args.model == "t5":
        backbone = keras_hub.models.T5Backbone(
            vocabulary_size=args.vocabulary,
            num_layers=args.layers,
            num_heads=8,
            hidden_dim=args.hidden,
            intermediate_dim=2 * args.hidden,
            dropout=0.0,
        )
        task = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
        task.compile(sampler="greedy")
        return task
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


def _prompts(args, batch):
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 9, size=batch)
    ids = rng.integers(1, args.vocabulary, size=(batch, args.length)).astype("int32")
    mask = np.arange(args.length)[None, :] < lengths[:, None]
    ids[~mask] = 0
    tokens = int(batch * (args.length - lengths.min()))
    if args.model != "t5":
        return {"token_ids": ids, "padding_mask": mask}, tokens
    encoder_mask = np.arange(args.length)[None, :] < rng.integers(8, args.length + 1, size=batch)[:, None]
    encoder_ids = np.where(encoder_mask, rng.integers(1, args.vocabulary, size=encoder_mask.shape), 0).astype("int32")
    prompts = {"decoder_token_ids": ids, "decoder_padding_mask": mask}
    return dict(prompts, encoder_token_ids=encoder_ids, encoder_padding_mask=encoder_mask), tokens


def _timed(generate, args, base):
    """``generate()`` once (tracing, compiling), then ``--repeats`` times: (seconds a call, peak bytes, model bytes).

    The peak is this row's (reset before it: ``/proc/self/clear_refs``);
    "model bytes" are the peak over ``base``, the resident size of the process
    with TensorFlow, Keras and keras_hub imported and no model made: the
    model's weights, the programs and what generating needs.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (the peak resident size back to the present one)
    generate()
    began = time.perf_counter()
    for _ in range(args.repeats):
        generate()
    seconds = (time.perf_counter() - began) / args.repeats
    peak = _status("VmHWM")
    return seconds, peak, peak - base


def _cache_bytes(task, rows, length) -> int:
    """The whole key/value cache of ``rows`` rows, as the generator lays it out (every decoder layer; a
    ``*Seq2SeqLM``'s also keeps a cross-attention cache a layer, as long as the encoder's prompts, here ``length``)."""
    from keras_pipe.model.causal_lms import Seq2SeqFamily, family_of
    from keras_pipe.model.generation import decoder_layers
    from keras_pipe.model.transfer import numpy_dtype

    family = family_of(task)
    heads, size = family.cache_heads(task.backbone)
    caches = 2 if isinstance(family, Seq2SeqFamily) else 1
    layers = len(decoder_layers(task.backbone, family))
    return caches * layers * rows * 2 * length * heads * size * numpy_dtype(task.compute_dtype).itemsize


def worker(args) -> None:
    """One job: the unsplit model or the pipeline with each number of groups; prints JSON rows."""
    _threads(args)
    import keras_hub  # noqa: F401  (imported before the resident size without a model is read)

    from keras_pipe import PipelineModel

    base = _status("VmRSS")
    x, tokens = _prompts(args, args.batch)
    if args.worker == "unsplit":
        task = _model(args)
        seconds, peak, held = _timed(lambda: task.generate(dict(x), stop_token_ids=None), args, base)
        cache = _cache_bytes(task, args.batch, args.length)
        row = dict(groups=0, seconds=seconds, tokens=tokens, peaks=[peak], models=[held], rows=args.batch, cache=cache)
        print("RESULT " + json.dumps([row]))
        return
    from mpi4py import MPI

    import keras_pipe

    with keras_pipe.unallocated():  # (each rank allocates its own stage's weights only, as a large model must)
        task = _model(args)
    model = PipelineModel.from_model(task, num_stages=MPI.COMM_WORLD.Get_size() // args.replicas_now)
    rows = []
    runs = [(groups, x, tokens) for groups in sorted({1, model.num_stages})]
    if model.num_stages > 1:  # (P groups each of the one group's size)
        runs.append((model.num_stages, *_prompts(args, args.batch * model.num_stages)))
    for groups, prompts, count in runs:
        seconds, peak, held = _timed(
            lambda g=groups, p=prompts: model.generate(dict(p), stop_token_ids=None, num_groups=g), args, base
        )
        peaks = MPI.COMM_WORLD.allgather(peak)
        models = MPI.COMM_WORLD.allgather(held)
        size = len(next(iter(prompts.values())))
        rows.append(dict(groups=groups, seconds=seconds, tokens=count, peaks=peaks, models=models, rows=size))
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
    parser.add_argument("--model", choices=["llama", "t5"], default="llama")
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="each process's threads (0: default)")
    parser.add_argument("--threads-now", type=int, default=0, help=argparse.SUPPRESS)
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
    names = ("layers", "hidden", "vocabulary", "batch", "length", "repeats", "model")
    shape = [f"--{k}={getattr(args, k)}" for k in names]
    for threads in args.threads:
        _table(args, [*shape, f"--threads-now={threads}"], threads)


def _share(held, unsplit, ranks) -> str:
    return f"{held / (unsplit / ranks):.2f}" if unsplit > MIB else "-"


def _table(args, shape, threads) -> None:
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
    name = "T5 (each stack)" if args.model == "t5" else "Llama"
    unsplit = table[0][2]
    print(
        f"\n{name} {args.layers} layers x {args.hidden}, vocabulary {args.vocabulary}, batch {args.batch}, length "
        f"{args.length}; {args.repeats} timed calls; threads a process: {threads or 'default (every core)'}; "
        f"the whole key/value cache of {args.batch} rows: {unsplit['cache'] / MIB:.1f} MiB"
    )
    print(f"{'model':9} {'ranks':>5} {'groups':>6} {'rows':>5} {'tokens/s':>9}  peak MiB per rank (model, share)")
    print("(a model 'SxR': R replicas of S stages, each generating its share of the batch; model: the peak over the")
    print(" process before its model was made; share: that over the unsplit process's / ranks)")
    for kind, ranks, row in table:
        memory = "  ".join(
            f"{p / MIB:.0f} ({m / MIB:+.0f}, {_share(m, unsplit['models'][0], ranks)})"
            for p, m in zip(row["peaks"], row["models"])
        )
        groups = "-" if kind == "unsplit" else row["groups"]
        print(f"{kind:9} {ranks:>5} {groups:>6} {row['rows']:>5} {row['tokens'] / row['seconds']:>9.1f}  {memory}")


if __name__ == "__main__":
    main()
