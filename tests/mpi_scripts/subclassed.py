"""Subclassed models and composite layers, traced and pipelined, against the unsplit model on the same weights and data.

Run as ``mpirun -n P python subclassed.py [CASE ...]``; prints
``SUBCLASSED OK <case>`` per rank and case. Cases (models in
subclassed_models.py): ``blocks`` (the question's model as three
subclassed blocks in a Functional model, each expanded), ``net`` (the
question's model as one subclassed model), ``resnet`` (residual adds in a
subclassed ``call``), ``hub`` (keras_hub's TransformerEncoder inside a
subclassed model), ``stack`` (a user's composite layer holding most of the
model, expanded so the cut falls inside it; one that cannot be traced stays
whole, and ``summary()`` says why), ``vit`` (keras_hub's ViT: its
``ViTEncoder``, all the transformer blocks, split between blocks; prints
the parameters per stage), ``refused`` (tensor-value ``if``, a ``tf.*``
op, state set in ``call`` (an attribute, a list), a variable assigned, Python on ``training``, a
Python random number: each a ``PipelineConfigError`` on every rank, naming
the line).
"""

import sys

import keras
import numpy as np
import subclassed_models as models
from common import RANK, SIZE, assert_close, trained_on_rank_0

from keras_pipe import PipelineConfigError, PipelineModel
from keras_pipe.model import summary as summaries

rng = np.random.default_rng(3)


def compare(case, make, x, y, tolerance=(1e-5, 1e-6), epsilon=1e-7, sgd=False, **pipeline_args):
    """Trains the unsplit model (on rank 0) and the pipeline from its weights; compares everything."""
    fit_args = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)

    def compile_args():
        return dict(
            optimizer=keras.optimizers.SGD(0.1) if sgd else keras.optimizers.Adam(1e-2, epsilon=epsilon),
            loss="sparse_categorical_crossentropy",
            metrics=["sparse_categorical_accuracy"],
            jit_compile=False,
        )

    keras.utils.set_random_seed(5)
    reference = make(x)
    handed_in = make(x)
    handed_in.set_weights(reference.get_weights())
    reference.compile(**compile_args())
    expected = trained_on_rank_0(
        reference,
        dict(x=x, y=y, **fit_args),
        evaluate=dict(x=x, y=y, batch_size=24),
        predict=dict(x=x, batch_size=24),
        key=f"{case} sgd={sgd} epsilon={epsilon}",  # (the same on 2 ranks and 4)
    )
    model = PipelineModel.from_model(handed_in, **pipeline_args)
    model.compile(**compile_args())
    history = model.fit(x, y, **fit_args).history
    rtol, atol = tolerance
    for key in expected["history"]:
        assert_close(history[key], expected["history"][key], f"{case} history {key}", rtol, atol)
    weights = model.get_weights()
    assert len(weights) == len(expected["weights"]), (len(weights), len(expected["weights"]))
    for i, (a, b) in enumerate(zip(weights, expected["weights"])):
        assert_close(a, b, f"{case} weight {i}", rtol, atol)
    assert_close(model.evaluate(x, y, batch_size=24, verbose=0), expected["evaluate"], f"{case} evaluate", rtol, atol)
    assert_close(model.predict(x, batch_size=24, verbose=0), expected["predict"], f"{case} predict", rtol, atol)
    return model


def built(cls, **kwargs):
    def make(x):
        model = cls(**kwargs)
        model(x[:2])
        return model

    return make


def features():
    return rng.normal(size=(64, 12)).astype("float32"), rng.integers(0, 3, size=64)


def per_stage(model) -> list[int]:
    line = [line for line in summaries.summary_lines(model.engine) if line.startswith("Params per stage:")][0]
    return [int(part.split(": ")[1].replace(",", "")) for part in line[len("Params per stage: ") :].split(", ")]


def blocks(case):
    x, y = features()
    model = compare(case, lambda x: models.blocks_model(), x, y, num_microbatches=2)
    names = [node.name for node in model.engine.cut.graph.nodes]
    assert not any("block" in name for name in names), names  # each block expanded into its Dense layers


def net(case):
    x, y = features()
    model = compare(case, built(models.Net), x, y, num_microbatches=4)
    assert len(model.engine.cut.graph.nodes) == 1 + 4 * 3 + 1, [n.name for n in model.engine.cut.graph.nodes]
    if SIZE > 1:
        assert min(per_stage(model)) > 0, per_stage(model)


def resnet(case):
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, size=32)
    compare(case, built(models.ResNet), x, y, tolerance=(5e-5, 1e-5), num_microbatches=2)


def hub(case):
    x = rng.integers(1, 40, size=(48, 10)).astype("int32")
    y = (x[:, 0] % 3).astype("int32")
    # (epsilon: the attention's key bias gets a gradient of round-off only, which Adam would scale to whole steps)
    compare(case, built(models.HubClassifier), x, y, tolerance=(5e-5, 1e-5), epsilon=1e-3, num_microbatches=2)


def stack(case):
    x, y = features()
    model = compare(case, lambda x: models.stack_model(models.Stack(16, depth=4)), x, y, num_microbatches=2)
    if SIZE > 1:  # the Stack holds 1,088 of 1,411 parameters: split, its Dense layers on several stages
        assert "stack" not in [node.name for node in model.engine.cut.graph.nodes]
        assert not model.engine.graph.notes, model.engine.graph.notes
        # one that cannot be traced stays whole, and the summary says which, how much and why
        opaque = PipelineModel.from_model(models.stack_model(models.OpaqueStack(16)))
        lines = []
        opaque.summary(print_fn=lines.append)
        if RANK == 0:
            at = lines.index("Not split (each runs whole on one stage):")
            assert lines[at + 1].startswith("  opaque_stack (OpaqueStack) holds 816 parameters (76% of the model)")
            assert "tf.identity(x)" in lines[at + 1], lines


def vit(case):
    images = np.random.default_rng(5).normal(size=(48, 8, 8, 3)).astype("float32")
    labels = np.random.default_rng(6).integers(0, 3, size=48)
    model = compare(
        case,
        lambda x: models.vit_classifier(),
        images,
        labels,
        tolerance=(5e-5, 1e-5),
        sgd=True,
        num_microbatches=4,
    )  # (SGD: with Adam the ViT's predictions differ by 3e-4 from round-off, split or whole)
    names = [node.name for node in model.engine.cut.graph.nodes]
    sizes = per_stage(model)
    if RANK == 0:
        print(f"VIT PARAMS PER STAGE {SIZE}: {sizes}", flush=True)
    if SIZE > 1:
        assert "vit_encoder" not in names, names  # split between its blocks (on 4 ranks, inside them too)
        assert min(sizes) > 0 and max(sizes) < (0.6 if SIZE == 2 else 0.4) * sum(sizes), sizes


def refused(case):
    for cls in (
        models.TensorIf,
        models.RawTf,
        models.Mutates,
        models.Appends,
        models.Counts,
        models.TrainingBranch,
        models.PythonRandom,
    ):
        model = cls()
        try:
            PipelineModel.from_model(model, inputs=keras.Input((4,)))
        except PipelineConfigError as error:
            message = str(error)
            assert f"subclassed model {model.name!r}" in message, message
            if cls not in (models.TrainingBranch, models.PythonRandom):
                assert "subclassed_models.py" in message and "# REFUSED" in message, message
        else:
            raise AssertionError(f"{cls.__name__} was not refused")


CASES = {
    "blocks": blocks,
    "net": net,
    "resnet": resnet,
    "hub": hub,
    "stack": stack,
    "vit": vit,
    "refused": refused,
}
for name in sys.argv[1:] or list(CASES):
    CASES[name](name)
    print(f"SUBCLASSED OK {name} rank {RANK}", flush=True)
