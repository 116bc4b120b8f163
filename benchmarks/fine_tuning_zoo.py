"""The fine-tuning matrix: keras_hub families and a keras.applications CNN, fine-tuned as users do, against Keras.

    python benchmarks/fine_tuning_zoo.py --ranks 2 4 --markdown docs/fine_tuning_zoo.md
    python benchmarks/fine_tuning_zoo.py --ranks 2 --families Llama ViT --workflows lora guide
    python benchmarks/fine_tuning_zoo.py --ranks 2 --schedule auto --families Llama Gemma ViT

The models are :mod:`hub_zoo`'s tiny ones, built from constructor arguments: Llama, Gemma, a BERT classifier,
ViT, T5 and a keras.applications MobileNetV2 (``weights=None``; nothing is downloaded). Each is first saved as a
local preset (``save_to_preset``, keras_hub's families) or a ``.weights.h5`` file (the CNN), and every workflow
starts from it, as a fine-tuning user's script does:

``preset``: the model opened from the preset inside ``keras_pipe.unallocated()`` (each rank reading its own
stage's weights) and pipelined, its predictions against the preset model's; the rows below train that pipeline.
``lora``: ``backbone.enable_lora(2)``, keras_hub's recipe. ``head``: the backbone frozen, the task's own layers
trained (a new head). ``last``: everything frozen but the backbone's last third of its layers. ``guide``: Keras'
transfer-learning guide's two phases: the backbone frozen, fit; the whole unfrozen, ``compile()`` with a rate 100
times smaller, fit again.

Each workflow trains the unsplit model (rank 0, ``jit_compile=False``) and the pipeline (``num_microbatches=4``)
from the same weights: AdamW(1e-3), 2 epochs of 2 batches of 8 rows. MATCH where the losses agree within 1e-5
relative and the weights and predictions within 1e-4; WARNED where they differ and every rank warned why (batch
normalization's statistics per micro-batch); DIFF otherwise; REFUSED where every rank raised the same error.
``--schedule`` pipelines with that schedule (default 1F1B); with ``auto`` each row says which one the first
``fit()`` picked (ZB-V cuts the model again after its timing steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hub_zoo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {
    "Llama": ("Llama", "LlamaCausalLM"),
    "Gemma": ("Gemma", "GemmaCausalLM"),
    "Bert": ("Bert:TextClassifier", "BertTextClassifier"),
    "ViT": ("ViT", "ViTImageClassifier"),
    "T5": ("T5", "T5Seq2SeqLM"),
    "MobileNetV2": (None, None),
}
WORKFLOWS = ["preset", "lora", "head", "last", "guide"]
FULL_RUN = (
    "python benchmarks/fine_tuning_zoo.py --ranks 2 4 "
    "--json docs/fine_tuning_zoo.json --markdown docs/fine_tuning_zoo.md"
)
LIMITS = dict(loss=1e-5, weights=1e-4, predict=1e-4)


def build(family):
    """The unsplit model (uncompiled) and its backbone (the part a user freezes)."""
    import keras

    if family == "MobileNetV2":
        base = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None, pooling="avg"
        )
        inputs = keras.Input((32, 32, 3))
        outputs = keras.layers.Dense(3, name="head")(base(inputs, training=False))
        return keras.Model(inputs, outputs), base
    name = FAMILIES[family][0]
    builders = hub_zoo.families()
    model = builders[name]()
    return model, model.backbone


def open_saved(family, directory):
    """The model from its saved preset (or weights file), as a user opens it, inside ``unallocated()``."""
    import keras
    import keras_hub

    import keras_pipe

    with keras_pipe.unallocated():
        if family == "MobileNetV2":
            model, backbone = build(family)
            model.load_weights(os.path.join(directory, "whole.weights.h5"))
            return model, backbone
        task = getattr(keras_hub.models, FAMILIES[family][1])
        # (no num_classes: keras_hub would then make a new head instead of loading the saved task's)
        model = task.from_preset(directory, preprocessor=None)
        del keras
        return model, model.backbone


def apply(workflow, model, backbone, phase):
    """What the user changes before ``compile()`` of phase ``phase``; the learning rate of that phase."""
    if workflow == "lora":
        backbone.enable_lora(2)
    elif workflow == "head":
        backbone.trainable = False
    elif workflow == "last":
        model.trainable = True
        weighted = [layer for layer in backbone._flatten_layers(include_self=False, recursive=False) if layer.weights]
        for layer in model._flatten_layers(include_self=False):
            layer.trainable = False
        for layer in weighted[-max(2, len(weighted) // 3) :]:  # (the last block and the final norm, at least)
            layer.trainable = True
    elif workflow == "guide":
        backbone.trainable = phase == 1
        return 1e-5 if phase == 1 else 1e-3
    return 1e-3


def compile_args(rate, family=None):
    import keras

    # T5: a gradient entry that cancels to round-off steps by a whole rate in Adam whatever its sign (hub_zoo.md):
    # a larger epsilon keeps round-off round-off, as tests/mpi_scripts/hub.py trains it
    epsilon = 1e-4 if family == "T5" else 1e-7
    return dict(
        optimizer=keras.optimizers.AdamW(learning_rate=rate, epsilon=epsilon),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
        jit_compile=False,
    )


def run(family, workflow, directory, comm, schedule="1f1b") -> dict:
    """Every rank: the unsplit run on rank 0, the pipeline everywhere; rank 0's row."""
    import keras
    import numpy as np

    from keras_pipe import CollectiveError, PipelineModel

    row = dict(family=family, workflow=workflow, ranks=comm.Get_size())
    keras.backend.clear_session()
    keras.utils.set_random_seed(3)
    reference, ref_backbone = build(family)
    if family != "MobileNetV2" and workflow == "lora" and not hasattr(ref_backbone, "enable_lora"):
        return dict(row, verdict="N/A", reason="no enable_lora")
    if family == "MobileNetV2" and workflow == "lora":
        return dict(row, verdict="N/A", reason="keras.applications has no enable_lora")
    reference.load_weights(os.path.join(directory, "whole.weights.h5"))
    x = hub_zoo.make_data(reference)
    y = hub_zoo.labels_for(reference, x)
    fit = dict(x=x, y=y, batch_size=hub_zoo.BATCH, epochs=hub_zoo.EPOCHS, shuffle=False, verbose=0)
    phases = 2 if workflow == "guide" else 1
    keras.utils.set_random_seed(5)  # (LoRA's random kernels: the same on both)
    first_rate = apply(workflow, reference, ref_backbone, 0)

    def unsplit():
        results = []
        for k in range(phases):
            rate = first_rate if k == 0 else apply(workflow, reference, ref_backbone, k)
            reference.compile(**compile_args(rate, family))
            results.append(reference.fit(**fit).history)
        trained = int(sum(np.prod(v.shape) for v in reference.trainable_variables))
        return results, reference.get_weights(), reference.predict(x, batch_size=hub_zoo.BATCH, verbose=0), trained

    started = time.perf_counter()
    try:
        model, backbone = open_saved(family, directory)
        keras.utils.set_random_seed(5)
        rate = apply(workflow, model, backbone, 0)  # (LoRA before the pipeline is made: its weights are the model's)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipeline = PipelineModel.from_model(model, num_microbatches=hub_zoo.MICRO, schedule=schedule)
            if workflow == "lora":  # (LoRA's new kernels, random: the unsplit model's, as every other weight)
                pipeline.set_weights(reference.get_weights())
            opened = pipeline.predict(x, batch_size=hub_zoo.BATCH, verbose=0)
            histories = []
            for k in range(phases):
                rate = rate if k == 0 else apply(workflow, model, backbone, k)
                pipeline.compile(**compile_args(rate, family))
                histories.append(pipeline.fit(**fit).history)
            weights = pipeline.get_weights()
            if pipeline.engine.picker is not None:
                row["picked"] = pipeline.engine.picker.picked
            predict = pipeline.predict(x, batch_size=hub_zoo.BATCH, verbose=0)
        warned = [str(w.message)[:120] for w in caught if "differs from Sequential" in str(w.message)]
    except Exception as error:  # raised on every rank alike
        kind = "REFUSED" if isinstance(error, CollectiveError) else "ERROR"
        return dict(row, verdict=kind, reason=hub_zoo.first_line(error))
    want_histories, want_weights, want_predict, trained = hub_zoo.on_rank_0(comm, unsplit)
    row["seconds"] = round(time.perf_counter() - started, 1)
    row["trained"] = trained
    diff = dict(
        loss=max(hub_zoo.history_rel(h, r) for h, r in zip(histories, want_histories)),
        weights=hub_zoo.max_abs(weights, want_weights),
        predict=hub_zoo.max_abs(keras.tree.flatten(predict), keras.tree.flatten(want_predict)),
    )
    row["diff"] = diff
    gaps = [hub_zoo.max_abs([a], [b]) for a, b in zip(weights, want_weights)]
    if gaps and max(gaps) > 0:
        row["worst"] = reference.weights[int(np.argmax(gaps))].path
    if workflow == "preset":
        keras.utils.set_random_seed(3)
        plain, _ = build(family)
        plain.load_weights(os.path.join(directory, "whole.weights.h5"))
        want = plain.predict(x, batch_size=hub_zoo.BATCH, verbose=0)
        row["opened"] = hub_zoo.max_abs(keras.tree.flatten(opened), keras.tree.flatten(want))
        diff["opened"] = row["opened"]
    if not trained:
        why = {"lora": "enable_lora() targets no layer of this backbone"}.get(
            workflow, "the task has no layers outside its backbone"
        )
        return dict(row, verdict="N/A", reason=f"nothing trains in the unsplit model either: {why}")
    within = all(diff[k] <= LIMITS.get(k, 1e-4) for k in diff)
    row["verdict"] = "MATCH" if within else ("WARNED" if warned else "DIFF")
    if warned and not within:
        row["reason"] = warned[0]
    return row


def save_model(family, directory) -> None:
    """Rank 0: the model every workflow starts from, as a preset (keras_hub) and a weights file."""
    import keras

    keras.utils.set_random_seed(3)
    model, backbone = build(family)
    model.save_weights(os.path.join(directory, "whole.weights.h5"))
    if family != "MobileNetV2":
        backbone.save_to_preset(directory)
        if hasattr(model, "save_to_preset"):
            model.save_to_preset(directory)


def worker(args) -> None:
    from mpi4py import MPI

    import keras_pipe  # noqa: F401 - MPI started as keras_pipe starts it

    comm = MPI.COMM_WORLD
    for family in args.families:
        directory = comm.bcast(tempfile.mkdtemp(prefix=f"ft_{family}_") if comm.Get_rank() == 0 else None, root=0)
        hub_zoo.on_rank_0(comm, lambda family=family, directory=directory: save_model(family, directory))
        for workflow in args.workflows:
            row = run(family, workflow, directory, comm, args.schedule)
            if comm.Get_rank() == 0:
                print("ROW " + json.dumps(row), flush=True)


def fmt(value) -> str:
    return "—" if value is None else f"{value:.1e}"


def write_markdown(path, rows, commands) -> None:
    lines = [
        "# The fine-tuning matrix",
        "",
        "Written by `benchmarks/fine_tuning_zoo.py` (its docstring says what each workflow does):",
        "",
        *[f"    {c}" for c in commands],
        "",
        "Each cell: the verdict, then the largest relative loss difference and the largest absolute weight and",
        "prediction differences against the unsplit model (the preset row: against the preset model's predictions).",
        "",
    ]
    ranks = sorted({r["ranks"] for r in rows})
    lines.append("| family | workflow | " + " | ".join(f"{p} ranks" for p in ranks) + " |")
    lines.append("|---|---|" + "---|" * len(ranks))
    reasons = []
    for family in FAMILIES:
        for workflow in WORKFLOWS:
            cells = []
            for p in ranks:
                row = next((r for r in rows if (r["family"], r["workflow"], r["ranks"]) == (family, workflow, p)), None)
                if row is None:
                    cells.append("")
                    continue
                diff = row.get("diff")
                text = row["verdict"]
                if diff:
                    text += f" {fmt(diff['loss'])} / {fmt(diff['weights'])} / {fmt(diff['predict'])}"
                    if "opened" in diff:
                        text += f" (opened {fmt(diff['opened'])})"
                if row.get("reason"):
                    reason = row["reason"]
                    if len(reason) > 110:  # (a warning's first words: the layers it names)
                        reason = reason[: reason.rfind(" ", 0, 110)] + " ..."
                    reasons.append(f"- {family} {workflow}, {p} ranks: {reason}")
                cells.append(text)
            if any(cells):
                lines.append(f"| {family} | {workflow} | " + " | ".join(cells) + " |")
    if reasons:
        lines += ["", "Why:", "", *sorted(set(reasons))]
    lines += [
        "",
        "Notes:",
        "",
        "- T5 trains with AdamW's epsilon at 1e-4, as the suite trains it: a gradient entry that cancels to",
        "  round-off steps by a whole learning rate in Adam whatever its sign (docs/hub_zoo.md).",
        "- MobileNetV2's batch normalization computes its statistics per micro-batch wherever it trains (every",
        "  rank warns, naming the layers); with its base frozen (`head`) it normalises with its moving statistics",
        "  and matches. `tests/test_fine_tuning.py` runs the guide's two phases exactly at `num_microbatches=1`.",
        "- Llama's and Gemma's task has no layers of its own (the head is the backbone's token embedding):",
        "  freezing the backbone leaves nothing to train.",
    ]
    Path(path).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--workflows", nargs="+", default=WORKFLOWS)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--update", default=None, help="a JSON of an earlier run: its other rows are kept")
    parser.add_argument("--schedule", default="1f1b", help="the pipeline's schedule (auto: the row says its pick)")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    python = sys.executable
    mpirun = os.path.join(os.path.dirname(python), "mpirun")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    rows = []
    if args.update:
        ran = {(f, w, p) for f in args.families for w in args.workflows for p in args.ranks}
        kept = json.loads(Path(args.update).read_text())
        rows = [r for r in kept if (r["family"], r["workflow"], r["ranks"]) not in ran]
        args.json = args.json or args.update
    for p in args.ranks:
        for family in args.families:
            command = [mpirun, "-n", str(p), python, __file__, "--worker", "--schedule", args.schedule]
            command += ["--families", family, "--workflows"]
            command += args.workflows
            try:
                out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
                output = out.stdout + out.stderr
            except subprocess.TimeoutExpired as expired:
                output = f"timed out after {args.timeout} s\n{expired.stdout or ''}"
            found = [json.loads(line[4:]) for line in output.splitlines() if line.startswith("ROW ")]
            for workflow in args.workflows:
                if not any(r["workflow"] == workflow for r in found):
                    tail = " ".join(output.strip().splitlines()[-3:])[-300:]
                    found.append(dict(family=family, workflow=workflow, ranks=p, verdict="ERROR", reason=tail))
            for row in found:
                print(json.dumps(row), flush=True)
            rows += found
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        commands = [FULL_RUN]
        if args.update:
            commands.append("python benchmarks/fine_tuning_zoo.py " + " ".join(sys.argv[1:]))
        write_markdown(args.markdown, rows, commands)


if __name__ == "__main__":
    main()
