"""Training throughput of PipelineModel beside plain Keras, measured alternately in one run.

    python benchmarks/throughput.py              # every workload, 3 rounds (about half an hour on 2 cores)
    python benchmarks/throughput.py --rounds 1   # one round
    python benchmarks/throughput.py --workloads small

Each configuration is one launch (``mpirun`` for the pipeline) that trains
one warm-up epoch (tracing and XLA compilation) and then ``--epochs`` timed
epochs; its figure is the median of the timed epochs. Configurations run
round-robin, ``--rounds`` times, and the table shows each one's median over
the rounds, so slow phases of the machine hit every configuration alike.

Workloads (Adam, sparse categorical cross-entropy, random data):

- ``mlp-b64``: MLP 784 -> 2048x4 -> 10, batch 64 (micro-batches of 16 and 8);
- ``mlp-b512``: the same MLP at batch 512, m = 8 (micro-batches of 64);
- ``small``: 64 -> 4 x Dense(128) -> 10, batch 64, one metric: the fixed
  cost per step and per micro-batch, shown as milliseconds per step;
- ``balanced-b64``, ``balanced-b256``: 1024 -> 8 x Dense(1024) -> 10, which
  two ranks split into two equal stages (the chain torch's pipelining was
  measured on in the issues), with m = 2 (as many micro-batches as ranks:
  the thickest) beside m = 4 and 8; ``balanced-b32``, its ``Sequential``
  rows only: twice its one-core figure is the bubble-free ceiling of
  ``balanced-b64`` at m = 2 (two one-core stages of 32-row micro-batches);
- ``data-b64``: 64 -> 4 x Dense(256) -> 10, batch 64, m = 4, from a
  ``tf.data`` pipeline whose every sample costs 0.5 ms of Python to make (a
  ``numpy_function`` in its ``map``, as decoding an image or tokenizing a
  line does); on 2 and 4 ranks (one pipeline) and 2 stages x 2 replicas,
  with the samples each rank produced (``produced`` in the table: only the
  first stages read; ``--compare-tree`` of a checkout from before shows
  every rank reading), and 2 x 2 again with each replica making only its
  rows of each global batch (``distribute_datasets_from_function``);
- ``llama-b16``: keras_hub's ``LlamaCausalLM`` from constructor arguments
  (vocabulary 8000, 4 layers, hidden 512, 128 tokens a sequence), batch 16
  sequences, figures in sequences per second; its "Sequential" rows are the
  unsplit keras_hub model (XLA on and off, all cores and one), its pipeline
  is made inside ``keras_pipe.unallocated()``. Its untied token embedding is
  called on the first and the last virtual stage under ZB-V and interleaved
  1F1B.

``--torch-python PATH`` adds torch's pipelining of the balanced chain, the
same split on the same two ranks (``torch_pipelining.py``, run by that
interpreter: torch is not a dependency), its 1F1B, GPipe, interleaved 1F1B,
interleaved zero bubble and ZB-V at each m, to the same alternated rounds,
and prints each PipelineModel row against it (``pip install torch==2.13.0``
in a venv of its own gives the CPU build this machine has on disk).

``--recompute always`` trains every PipelineModel row with that option.
``--compare-tree PATH`` runs every PipelineModel configuration a second
time with the keras_pipe of another checkout (``PATH``, say the last
release), alternated with this one's: "no step slower" as a ratio of one run.

Configurations: ``keras.Sequential`` with the default ``compile()`` and with
``jit_compile=True``, on all cores and on one core; ``PipelineModel`` on one
rank and on two ranks with each schedule. The ``Sequential`` rows train with
tf.data's autotuning off, as ``PipelineModel`` does: the stronger baseline
here (``--sequential-autotune on`` gives Keras' default; on the balanced
chain, all cores, that was 1.18-1.32x slower, one core 1.01-1.04x). Efficiency = measured /
(P x m / (m + P - 1) x the one-core speed of the faster Sequential at the same
batch): the fraction of an ideal pipeline of single-core stages.
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

WORKLOADS = {
    "mlp-b64": dict(features=784, width=2048, depth=4, batch=64, steps=24, microbatches=(4, 8)),
    "mlp-b512": dict(features=784, width=2048, depth=4, batch=512, steps=6, microbatches=(8,)),
    "small": dict(features=64, width=128, depth=4, batch=64, steps=48, microbatches=(1, 4), metric=True),
    # the balanced chain of the issues (two equal stages on two ranks), beside torch's pipelining of it
    "balanced-b64": dict(features=1024, width=1024, depth=8, batch=64, steps=32, microbatches=(2, 4, 8)),
    # the bubble-free ceiling of balanced-b64 at m = 2 (issue 49): twice a one-core Sequential at batch 32
    "balanced-b32": dict(features=1024, width=1024, depth=8, batch=32, steps=64, microbatches=()),
    "balanced-b256": dict(features=1024, width=1024, depth=8, batch=256, steps=12, microbatches=(2, 4)),
    # a language model (keras_hub's LlamaCausalLM from constructor arguments): untied embeddings on the first and
    # the last virtual stage, which ZB-V and interleaved 1F1B sum across chunks (issue 49)
    "llama-b16": dict(lm=True, vocab=8000, length=128, layers=4, hidden=512, batch=16, steps=6, microbatches=(2, 4)),
    # samples that cost CPU to make (0.5 ms of Python each, in a tf.data map, as decoding an image does): who reads
    # them (issue 60); pipelines on 2 and 4 ranks, and 2 stages x 2 replicas
    "data-b64": dict(features=64, width=256, depth=4, batch=64, steps=8, microbatches=(4,), data_ms=0.5),
}
SCHEDULES = ("1f1b", "gpipe", "zb-h1", "auto", "interleaved-1f1b", "zb-v")  # (the last two: two chunks a rank)
# The models of benchmarks/scaling.py and step_spans.py (batch 64, 24 steps per epoch).
MODELS = {"mlp-2048x4": dict(width=2048, depth=4), "deep-512x16": dict(width=512, depth=16)}
BATCH = 64
STEPS_PER_EPOCH = 24
TORCH = "torch pipelining 2 ranks "  # (the label of torch's rows)
# torch's schedules of torch_pipelining.py: ours by name, and its interleaved zero bubble (two stages a rank)
TORCH_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb", "zb-v")


def build_layers(width, depth, features=784):
    import keras

    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(10, activation="softmax"))
    return layers


def jit_compile_of(text: str):
    """``compile(jit_compile=)`` from a command line's ``True``, ``False`` or ``auto``."""
    return {"True": True, "False": False}.get(text, "auto")


def microbatches_of(text: str):
    """``num_microbatches`` from a command line: a number, or ``auto``."""
    return text if text == "auto" else int(text)


def make_data(n, features=784):
    """``n`` random samples and labels of 10 classes, the same in every process."""
    import numpy as np

    x = np.random.default_rng(0).normal(size=(n, features)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, size=n)
    return x, y


def worker(args):
    """Runs inside mpirun (or alone); rank 0 prints one JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.kind == "pipeline" and args.threads:  # (--rank-threads: read when keras_pipe is imported)
        os.environ["KERAS_PIPE_THREADS"] = str(args.threads)
    if args.kind == "sequential" and args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import keras
    from mpi4py import MPI

    spec = WORKLOADS[args.workload]
    keras.utils.set_random_seed(0)
    n = spec["batch"] * spec["steps"]
    if spec.get("lm"):
        model, x, y, loss = language_model(spec, args, n)
    elif spec.get("data_ms"):
        x, y = make_data(n, spec["features"])
        model, loss = chain_model(spec, args), "sparse_categorical_crossentropy"
        if args.per_replica:  # (each replica's first stage makes its own rows of every global batch)
            made = model.distribute_strategy.distribute_datasets_from_function
            x, y = made(lambda context, x=x, y=y: costly_dataset(x, y, spec, context)), None
        else:
            x, y = costly_dataset(x, y, spec), None
    else:
        x, y = make_data(n, spec["features"])
        model, loss = chain_model(spec, args), "sparse_categorical_crossentropy"
    metrics = ["accuracy"] if spec.get("metric") else None
    model.compile(optimizer="adam", loss=loss, metrics=metrics, jit_compile=args.jit)

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    times = []
    # one warm-up epoch (tracing, XLA; "auto" times its candidates in its first step): the timed epochs train
    # with what it picked
    picker = getattr(getattr(model, "engine", None), "picker", None)
    warmup = 1
    epochs = warmup + args.epochs
    if y is None:  # (a dataset of batches)
        model.fit(x, epochs=epochs, verbose=0, callbacks=[Timer()])
    else:
        model.fit(x, y, batch_size=spec["batch"], epochs=epochs, shuffle=False, verbose=0, callbacks=[Timer()])
    speeds = [n / t for t in times[warmup:]]
    result = {"samples_per_s": statistics.median(speeds), "all": speeds}
    if spec.get("data_ms"):  # (the samples each rank made, over every epoch)
        result["produced"] = MPI.COMM_WORLD.allgather(PRODUCED[0])
    if picker is not None:
        result["picked"] = model.engine.picker.describe()  # what schedule="auto" trains with, and why
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


PRODUCED = [0]  # samples this process's costly_dataset made


def costly_dataset(x, y, spec: dict, context=None):
    """``(x, y)`` in batches, each sample costing ``spec["data_ms"]`` of Python in the map (counted in PRODUCED).

    ``context``: a ``tf.distribute.InputContext``: that replica's rows of each global batch alone (rows
    ``[r b, (r + 1) b)`` of each, ``b`` the per-replica batch size), made and batched by ``b``.
    """
    import tensorflow as tf

    cost = spec["data_ms"] / 1000

    def make(sample):
        end = time.perf_counter() + cost
        while time.perf_counter() < end:
            pass
        PRODUCED[0] += 1
        return sample

    def decode(sample, label):
        made = tf.numpy_function(make, [sample], tf.float32)
        made.set_shape(sample.shape)
        return made, label

    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if context is None:
        return dataset.map(decode).batch(spec["batch"])
    size, replicas, replica = (
        context.get_per_replica_batch_size(spec["batch"]),
        context.num_input_pipelines,
        context.input_pipeline_id,
    )
    mine = dataset.enumerate().filter(lambda i, _: (i // size) % replicas == replica).map(lambda _, sample: sample)
    return mine.map(decode).batch(size)


def chain_model(spec: dict, args):
    """A chain workload's model: ``Sequential`` (tf.data's autotuning off unless asked) or ``PipelineModel``."""
    import keras

    layers = build_layers(spec["width"], spec["depth"], spec["features"])
    if args.kind == "sequential" and args.autotune == "off":
        from keras_pipe.model.datasets import DatasetStrategy

        class Untuned(keras.Sequential):
            @property
            def distribute_strategy(self):
                return DatasetStrategy(super().distribute_strategy)

        return Untuned(layers)
    if args.kind == "sequential":
        return keras.Sequential(layers)
    from keras_pipe import PipelineModel

    return PipelineModel(
        layers,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        recompute=args.recompute,
        num_stages=args.stages or None,
    )


def language_model(spec: dict, args, n: int):
    """The ``lm`` workload: ``(model, x, y, loss)``, a ``LlamaCausalLM`` unsplit or pipelined, on random tokens."""
    import keras
    import keras_hub
    import numpy as np

    def make():
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=spec["vocab"],
            num_layers=spec["layers"],
            num_query_heads=8,
            num_key_value_heads=8,
            hidden_dim=spec["hidden"],
            intermediate_dim=2 * spec["hidden"],
        )
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    tokens = np.random.default_rng(0).integers(1, spec["vocab"], size=(n, spec["length"])).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = np.concatenate([tokens[:, 1:], np.zeros((n, 1), "int32")], axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if args.kind == "sequential":
        return make(), x, y, loss
    from keras_pipe import PipelineModel, unallocated

    with unallocated():
        lm = make()
    model = PipelineModel.from_model(
        lm, num_microbatches=args.microbatches, schedule=args.schedule, recompute=args.recompute
    )
    return model, x, y, loss


def launch_script(script: Path, ranks, *worker_args, env=None, python=None) -> dict:
    """Runs ``script --worker ...`` on ``ranks`` ranks; returns the JSON its rank 0 printed after ``RESULT``.

    ``python``: another interpreter to run the script with (torch's, for ``torch_pipelining.py``).
    """
    mpirun = Path(sys.executable).parent / "mpirun"
    command = [python or sys.executable, str(script), "--worker", *worker_args]
    if ranks > 1 or mpirun.exists():
        command = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(ranks), *command]
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=environment)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout}\n{out.stderr}")


def launch(ranks, *worker_args, env=None, torch_python=None, label=None) -> float:
    """Samples per second of one configuration (printing what ``schedule="auto"`` picked, where it ran).

    ``torch_python``: the configuration is torch's pipelining, run by that interpreter.
    """
    if torch_python is not None:
        import socket

        with socket.socket() as probe:  # (a free port for torch's rendezvous, each launch its own)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        script = Path(__file__).resolve().parent / "torch_pipelining.py"
        env = dict(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return launch_script(script, ranks, *worker_args, env=env, python=torch_python)["samples_per_s"]
    result = launch_script(Path(__file__).resolve(), ranks, *worker_args, env=env)
    if "picked" in result:
        print(f"  {' '.join(worker_args)}: {result['picked']}", flush=True)
    if "produced" in result:
        PRODUCED_BY[label] = result["produced"]
    return result["samples_per_s"]


PRODUCED_BY: dict = {}  # each configuration's samples made on each rank (data workloads), by its label


def configurations(workload: str, autotune: str = "off", torch: bool = False) -> list[tuple[str, int, list[str]]]:
    """``(label, ranks, worker arguments)`` of every configuration of a workload.

    ``autotune`` is tf.data's autotuning for the ``Sequential`` rows (``PipelineModel`` turns it off);
    ``torch`` adds torch's pipelining of the balanced chain (each of ``TORCH_SCHEDULES`` at each m).
    """
    spec = WORKLOADS[workload]
    rows = []
    for jit in ("False", "True"):
        for threads, cores in ((0, "all cores"), (1, "1 core")):
            label = f"Sequential{' jit' if jit == 'True' else ''}, {cores}"
            worker_args = ["--kind", "sequential", "--jit", jit, "--threads", str(threads), "--autotune", autotune]
            rows.append((label, 1, worker_args))
    if spec.get("data_ms"):  # (who reads: one pipeline on 2 and 4 ranks, two replicas of 2 stages)
        m = str(spec["microbatches"][0])
        for label, ranks, stages in (("2 ranks", 2, 2), ("4 ranks", 4, 4), ("2 stages x 2 replicas", 4, 2)):
            worker_args = ["--kind", "pipeline", "--microbatches", m, "--stages", str(stages)]
            rows.append((f"PipelineModel {label} 1f1b, m={m}", ranks, worker_args))
        # (each replica reads only its rows: model.distribute_strategy.distribute_datasets_from_function)
        worker_args = ["--kind", "pipeline", "--microbatches", m, "--stages", "2", "--per-replica"]
        rows.append((f"PipelineModel 2 stages x 2 replicas per replica 1f1b, m={m}", 4, worker_args))
        return rows
    if spec["microbatches"]:  # (none: a workload of Sequential rows only)
        rows.append(("PipelineModel 1 rank, m=1", 1, ["--kind", "pipeline", "--microbatches", "1"]))
    for m in spec["microbatches"]:
        for schedule in SCHEDULES if m > 1 else ("1f1b",):
            label = f"PipelineModel 2 ranks {schedule}, m={m}"
            rows.append((label, 2, ["--kind", "pipeline", "--microbatches", str(m), "--schedule", schedule]))
    if any(m > 1 for m in spec["microbatches"]):  # (m and the schedule both picked by timing)
        label = "PipelineModel 2 ranks auto, m=auto"
        rows.append((label, 2, ["--kind", "pipeline", "--microbatches", "auto", "--schedule", "auto"]))
    if torch and workload.startswith("balanced"):  # (benchmarks/torch_pipelining.py runs the balanced chain)
        for m in spec["microbatches"]:
            for schedule in TORCH_SCHEDULES:
                rows.append((f"{TORCH}{schedule}, m={m}", 2, ["--microbatches", str(m), "--schedule", schedule]))
    return rows


def main():
    parser = argparse.ArgumentParser(description="PipelineModel throughput beside plain Keras.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="sequential", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--autotune", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--jit", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="mlp-b64", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=microbatches_of, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--per-replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recompute", default="never", help="PipelineModel's recompute= (never, always, ...)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per launch")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (the median is shown)")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--only", nargs="*", default=None, help="run the configurations whose label contains one of these"
    )
    parser.add_argument("--smoke", action="store_true", help="the small workload, 1 round of 1 epoch, 3 configurations")
    parser.add_argument("--compare-tree", help="another checkout whose keras_pipe each pipeline row also runs")
    parser.add_argument(
        "--sequential-autotune",
        choices=("off", "on"),
        default="off",
        help="tf.data's autotuning for the Sequential rows (default off: the faster here; on: Keras' default)",
    )
    parser.add_argument(
        "--rank-threads",
        type=int,
        default=0,
        help="also run each two-rank row with this many TensorFlow threads a rank (KERAS_PIPE_THREADS; default: "
        "the host's cores shared out, one each here): a waiting rank's core lent to its neighbour",
    )
    parser.add_argument(
        "--torch-python",
        help="an interpreter with torch: adds torch's pipelining of the balanced chain (torch_pipelining.py) as rows",
    )
    args = parser.parse_args()
    if args.worker:
        args.jit = jit_compile_of(args.jit)
        return worker(args)
    if args.smoke:
        args.workloads, args.rounds, args.epochs = ["small"], 1, 1
    print(f"host: {os.cpu_count()} cores; median of {args.rounds} alternated rounds of {args.epochs} timed epochs")
    print(f"Sequential rows: tf.data's autotuning {args.sequential_autotune}")
    if args.recompute != "never":
        print(f"PipelineModel(recompute={args.recompute!r})")
    for workload in args.workloads:
        spec = WORKLOADS[workload]
        rows = configurations(workload, args.sequential_autotune, torch=bool(args.torch_python))
        if args.rank_threads:
            rows += [
                (f"{label}, {args.rank_threads} threads", ranks, [*worker_args, "--threads", str(args.rank_threads)])
                for label, ranks, worker_args in rows
                if label.startswith("PipelineModel 2 ranks")
            ]
        if args.smoke:
            rows = [row for row in rows if row[0].endswith(("all cores", " 1f1b, m=4"))]
        if args.only:
            rows = [row for row in rows if any(text in row[0] for text in args.only)]
        trees = [(label, ranks, worker_args, None) for label, ranks, worker_args in rows]
        if args.compare_tree:
            other = str(Path(args.compare_tree).resolve())
            trees += [
                (f"{label} [other]", ranks, worker_args, {"PYTHONPATH": other})
                for label, ranks, worker_args in rows
                if label.startswith("PipelineModel") and "m=auto" not in label  # (new here: the other lacks it)
            ]
        mine = str(Path(__file__).resolve().parent.parent)
        speeds: dict[str, list[float]] = {label: [] for label, _, _, _ in trees}
        for _ in range(args.rounds):
            for label, ranks, worker_args, env in trees:
                common = ["--workload", workload, "--epochs", str(args.epochs), "--recompute", args.recompute]
                torch_python = args.torch_python if label.startswith(TORCH) else None
                speeds[label].append(
                    launch(
                        ranks,
                        *worker_args,
                        *common,
                        env=env or {"PYTHONPATH": mine},
                        torch_python=torch_python,
                        label=label,
                    )
                )
        median = {label: statistics.median(values) for label, values in speeds.items()}
        print_table(workload, spec, {k: v for k, v in median.items() if not k.endswith(" [other]")})
        if spec.get("data_ms"):
            needed = spec["batch"] * spec["steps"] * (1 + args.epochs)
            print(f"samples made on each rank over the {1 + args.epochs} epochs of a launch ({needed} needed):")
            for label, _, _, _ in trees:
                produced = PRODUCED_BY.get(label)
                if produced:
                    print(f"  {label:<48} {produced}: {sum(produced) / needed:4.2f}x what one process makes")
        if args.compare_tree:
            print(f"this tree against {args.compare_tree} (the same configuration, alternated in this run):")
            for label, _, _ in rows:
                if f"{label} [other]" in median:
                    other = median[f"{label} [other]"]
                    print(f"  {label:<36} {median[label]:10.1f} vs {other:10.1f}: {median[label] / other:5.2f}x")


def print_table(workload: str, spec: dict, median: dict) -> None:
    batch = spec["batch"]
    sequential = [v for k, v in median.items() if k.startswith("Sequential")] or [float("nan")]
    one_core = max(median.get("Sequential, 1 core", 0), median.get("Sequential jit, 1 core", 0))
    one_core = one_core or max(sequential) / 2
    baseline = median.get("Sequential, all cores", sequential[0])
    # the strongest one-process baseline: the faster of the default compile() and XLA, on all cores
    best = max(median.get("Sequential, all cores", 0), median.get("Sequential jit, all cores", 0)) or baseline
    print(f"\n{workload}: batch {batch}; 'vs Seq' = against Sequential with the default compile() on all cores,")
    print("'vs best' against the faster of Sequential and Sequential jit on all cores")
    header = f"{'configuration':<36} {'samples/s':>10} {'ms/step':>8} {'vs Seq':>7} {'vs best':>7} {'efficiency':>10}"
    print(header)
    print("-" * len(header))
    for label, speed in median.items():
        efficiency = ""
        m = label.rsplit("m=", 1)[-1].split(",")[0]
        if label.startswith("PipelineModel") and m.isdigit():  # ("m=auto": the m it picked is printed above)
            ranks = 2 if "2 ranks" in label else 1
            ideal = ranks * int(m) / (int(m) + ranks - 1) * one_core
            efficiency = f"{100 * speed / ideal:9.1f}%"
        ratios = f"{speed / baseline:7.2f} {speed / best:7.2f}"
        print(f"{label:<36} {speed:10.1f} {1000 * batch / speed:8.2f} {ratios} {efficiency:>10}")
    lent = {label: speed for label, speed in median.items() if label.endswith(" threads")}
    if lent:  # (--rank-threads: each two-rank row again with more threads a rank, a waiting rank's core lent)
        print("more threads a rank (a waiting rank's core lent) against the default, in this run:")
        for label, speed in lent.items():
            default = median.get(label.rsplit(", ", 1)[0])
            if default:
                print(f"  {label:<44} {speed:8.1f} vs {default:8.1f} samples/s: {speed / default:5.2f}x")
    torch_rows = {label[len(TORCH) :]: speed for label, speed in median.items() if label.startswith(TORCH)}
    if torch_rows:
        print("two ranks against torch's pipelining of the same split, the same schedule and m, in this run:")
        for name, theirs in torch_rows.items():
            ours = median.get(f"PipelineModel 2 ranks {name}")
            if ours:
                print(f"  {name:<12} {ours:8.1f} vs {theirs:8.1f} samples/s: {ours / theirs:5.2f}x")
        best = max(v for k, v in median.items() if k.startswith("PipelineModel 2 ranks"))
        print(f"  fastest two-rank PipelineModel against the fastest torch row: {best / max(torch_rows.values()):.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
