"""Each rank's peak memory while a keras_hub preset is loaded into a pipeline, against the whole model's size.

    python benchmarks/preset_memory.py                 # 1, 2 and 4 ranks, a Llama of about 0.8 GiB of weights
    python benchmarks/preset_memory.py --ranks 2 --layers 8 --hidden 1024

A ``LlamaCausalLM`` built from constructor arguments is saved once with
``save_to_preset`` (a local directory: nothing is downloaded). Then, on each
rank count, every rank runs what a user writes:

    with keras_pipe.unallocated():
        lm = keras_hub.models.LlamaCausalLM.from_preset(directory, preprocessor=None)
    model = keras_pipe.PipelineModel.from_model(lm)

and reports its peak resident memory before the load (TensorFlow, keras_hub
and the built graph: what any rank pays) and after it. The growth is set
beside the whole model's weights and the rank's own stage's: a rank that
read the whole file would grow by the whole model, one that reads only its
own stage (issue 46) by its share. One process opening the preset with plain
keras_hub is the first row.

Then each rank writes the model back with ``model.save_to_preset(...)`` (the
route a fine-tuning script ends with), its peak reset just before
(``/proc/self/clear_refs``): the second table is each rank's growth over the
call, beside its share and the largest variable (issue 59: rank 0 writes
what each stage sends, one layer at a time, so no rank should grow by more
than about one layer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile

GIB = 1024**3


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured_save(write) -> tuple[float, float]:
    """``write()``'s peak resident growth (GiB, the peak reset first: Linux's ``clear_refs``) and its seconds."""
    import time

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_gib("VmRSS")
    start = time.perf_counter()
    write()
    return _status_gib("VmHWM") - before, time.perf_counter() - start


def make_llama(args):
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocab,
        num_layers=args.layers,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=args.hidden,
        intermediate_dim=args.hidden * 2,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def save(args) -> None:
    model = make_llama(args)
    model.backbone.save_to_preset(args.directory)
    print(json.dumps({"bytes": int(sum(v.numpy().nbytes for v in model.weights))}))


def load(args) -> None:
    """One rank's load: the peak before and after, its stage's bytes."""
    import keras_hub
    import numpy as np

    import keras_pipe

    if args.plain:
        before = peak_gib()
        lm = keras_hub.models.LlamaCausalLM.from_preset(args.directory, preprocessor=None)
        held = int(sum(np.prod(v.shape) * 4 for v in lm.weights))
        print("ROW " + json.dumps({"rank": 0, "before": before, "after": peak_gib(), "held": held}), flush=True)
        growth, seconds = measured_save(lambda: lm.save_to_preset(os.path.join(args.directory, "out-plain")))
        print("SAVE " + json.dumps({"rank": 0, "growth": growth, "seconds": seconds, "held": held}), flush=True)
        return
    from mpi4py import MPI

    # what every rank pays whatever it holds: the graph of the whole model, shapes only
    with keras_pipe.unallocated():
        keras_hub.models.LlamaCausalLM.from_preset(args.directory, preprocessor=None, load_weights=False)
    before = peak_gib()
    with keras_pipe.unallocated():
        lm = keras_hub.models.LlamaCausalLM.from_preset(args.directory, preprocessor=None)
    model = keras_pipe.PipelineModel.from_model(lm, num_microbatches=2)
    held = int(sum(np.prod(v.shape) * 4 for v in lm.weights if not keras_pipe.compat.unallocated(v)))
    rank = MPI.COMM_WORLD.Get_rank()
    print("ROW " + json.dumps({"rank": rank, "before": before, "after": peak_gib(), "held": held}), flush=True)
    out = os.path.join(args.directory, f"out-{MPI.COMM_WORLD.Get_size()}")
    growth, seconds = measured_save(lambda: model.save_to_preset(out))
    print("SAVE " + json.dumps({"rank": rank, "growth": growth, "seconds": seconds, "held": held}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--directory", default=None)
    parser.add_argument("--role", choices=["save", "load"], default=None)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    if args.role == "save":
        return save(args)
    if args.role == "load":
        return load(args)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    python = sys.executable
    mpirun = os.path.join(os.path.dirname(python), "mpirun")
    shape = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    with tempfile.TemporaryDirectory() as directory:
        common = [__file__, *shape, "--directory", directory]
        out = subprocess.run([python, *common, "--role", "save"], env=env, capture_output=True, text=True, timeout=900)
        whole = json.loads(out.stdout.strip().splitlines()[-1])["bytes"] / GIB
        print(f"Llama: {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}: {whole:.2f} GiB of weights")
        header = ("launch", "rank", "before GiB", "after GiB", "growth", "held GiB", "growth/held")
        print("".join(f"{h:<24}" if k == 0 else f"{h:>{len(h) + 3}}" for k, h in enumerate(header)))
        launches = [("plain keras_hub", [python, *common, "--role", "load", "--plain"])]
        launches += [
            (f"pipeline, {p} ranks", [mpirun, "-n", str(p), python, *common, "--role", "load"]) for p in args.ranks
        ]
        saves = []
        for name, command in launches:
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
            # (ranks' lines may run together on the launcher's output: each row is found on its own)
            rows = [json.loads(found) for found in re.findall(r"ROW (\{[^{}]*\})", out.stdout)]
            if not rows:
                print(f"{name}: failed\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
                continue
            saves += [(name, json.loads(found)) for found in re.findall(r"SAVE (\{[^{}]*\})", out.stdout)]
            for row in sorted(rows, key=lambda r: r["rank"]):
                growth = row["after"] - row["before"]
                held = row["held"] / GIB
                ratio = growth / held if held else float("nan")
                print(
                    f"{name:<24}{row['rank']:>7}{row['before']:>13.2f}{row['after']:>12.2f}{growth:>9.2f}"
                    f"{held:>11.2f}{ratio:>14.2f}"
                )
        largest = args.vocab * args.hidden * 4 / GIB
        print(f"\nsave_to_preset after the load (the largest variable, the embedding: {largest:.2f} GiB)")
        header = ("launch", "rank", "growth GiB", "held GiB", "growth/held", "seconds")
        print("".join(f"{h:<24}" if k == 0 else f"{h:>{len(h) + 3}}" for k, h in enumerate(header)))
        for name, row in sorted(
            saves, key=lambda item: (launches.index(next(x for x in launches if x[0] == item[0])), item[1]["rank"])
        ):
            held = row["held"] / GIB
            ratio = row["growth"] / held if held else float("nan")
            print(f"{name:<24}{row['rank']:>7}{row['growth']:>13.2f}{held:>11.2f}{ratio:>14.2f}{row['seconds']:>10.1f}")


if __name__ == "__main__":
    main()
