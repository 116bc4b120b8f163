"""Subclassed models and composite layers: traced with Keras itself (graph/trace.py), refused where they cannot be.

The tracer alone in this process; pipelined under a real mpirun on 2 and 4
ranks against the unsplit model (tests/mpi_scripts/subclassed.py), the
models in tests/mpi_scripts/subclassed_models.py.
"""

import re
import sys

import keras
import numpy as np
import pytest
from mpi import SCRIPTS, require_keras_hub, run_mpi

from keras_pipe import PipelineConfigError, PipelineModel
from keras_pipe.graph import cut, graph

sys.path.insert(0, str(SCRIPTS))
import subclassed_models as models  # noqa: E402

CASES = ["refused", "blocks", "net", "resnet", "hub", "stack", "vit"]


def built(model, shape=(2, 12), dtype="float32"):
    model(np.ones(shape, dtype))
    return model


def test_the_questions_model_is_traced_over_its_own_layers():
    net = built(models.Net())
    g = graph.from_model(net)
    kinds = [node.kind for node in g.plain.nodes]
    assert kinds == ["Dense"] + ["Dense", "Dense", "Add"] * 4 + ["Dense"], kinds
    # the same layer objects, the weights in the subclassed model's own order
    dense = [layer for layer in net._flatten_layers() if isinstance(layer, keras.layers.Dense)]
    assert {id(layer) for layer in g.units.values()} == {id(layer) for layer in dense}
    assert all(g.units[unit].weights[index] is w for (unit, index), w in zip(g.weight_order, net.weights))
    x = np.random.default_rng(0).normal(size=(8, 12)).astype("float32")
    pipeline = PipelineModel.from_model(net)  # (one process: one stage)
    np.testing.assert_allclose(pipeline.predict(x, verbose=0), net.predict(x, verbose=0), rtol=1e-6, atol=1e-7)


def test_a_model_never_called_can_be_given_its_inputs():
    net = models.Net()
    net.build((None, 12))  # (a subclassed model records its build shape: from_model reads it)
    assert len(graph.from_model(net).plain.nodes) == 14
    with pytest.raises(PipelineConfigError, match=r"no known input shape .*model\.build\(shape\).*inputs="):
        PipelineModel.from_model(models.Net())
    pipeline = PipelineModel.from_model(models.Net(), inputs=keras.Input((12,)))
    assert len(pipeline.engine.cut.graph.nodes) == 14


REFUSALS = {
    models.TensorIf: r"TypeError: A symbolic KerasTensor cannot be used as a boolean",
    models.RawTf: r"ValueError: A KerasTensor cannot be used as input to a TensorFlow function",
    models.Mutates: r"changes the state of Mutates 'mutates' \(sets its attribute 'last_output'\)",
    models.Counts: r"changes the variable 'counts/calls' \(assign_add\)",
    models.Appends: r"changes the state of Appends 'appends' \(its 'seen' went from 0 to 1 items\)",
    models.TrainingBranch: r"with training=True than with training=False \(Python code on `training`\)",
    models.PythonRandom: r"differs from call\(\) on a real batch \(output 0: the traced graph computes other values",
}


@pytest.mark.parametrize("cls", list(REFUSALS), ids=lambda cls: cls.__name__)
def test_a_call_that_cannot_be_traced_is_refused_naming_the_line(cls):
    model = cls()
    with pytest.raises(PipelineConfigError) as raised:
        PipelineModel.from_model(model, inputs=keras.Input((4,)))
    message = str(raised.value)
    assert message.startswith(f"the subclassed model {model.name!r} ({cls.__name__}) cannot be pipelined: "), message
    assert len(re.findall(REFUSALS[cls], message)) == 1, message
    if cls not in (models.TrainingBranch, models.PythonRandom):  # (no one line: a path, a value)
        assert 'subclassed_models.py", line ' in message and "# REFUSED" in message, message


def test_a_composite_layer_is_expanded_where_it_holds_more_than_a_stages_share():
    model = models.stack_model(models.Stack(16, depth=4))  # the Stack: 1,088 of 1,411 parameters
    assert "stack" in [n.name for n in graph.from_model(model, stages=1).plain.nodes]
    expanded = graph.from_model(model, stages=2)
    names = [n.name for n in expanded.plain.nodes]
    assert "stack" not in names and [n.kind for n in expanded.plain.nodes].count("Dense") == 6, names
    assert not expanded.notes
    x = np.random.default_rng(1).normal(size=(4, 12)).astype("float32")
    values = dict(zip(expanded.plain.inputs, [keras.ops.convert_to_tensor(x)]))
    for call in expanded.calls:
        values.update(zip(call.outputs, call(values, training=False)))
    np.testing.assert_allclose(values[expanded.plain.outputs[0]], model(x), rtol=1e-6, atol=1e-7)


def test_a_composite_layer_that_cannot_be_traced_stays_whole_and_says_why():
    model = models.stack_model(models.OpaqueStack(16))
    g = graph.from_model(model, stages=2)
    assert "opaque_stack" in [n.name for n in g.plain.nodes]
    (note,) = g.notes
    assert note.startswith("opaque_stack (OpaqueStack) holds 816 parameters (76% of the model) and was not split: ")
    assert "A KerasTensor cannot be used as input to a TensorFlow function" in note and "tf.identity(x)" in note
    # (on one stage nothing needs splitting; summary() prints the note on several: subclassed.py's stack case)
    assert not graph.from_model(model, stages=1).notes


def test_keras_hub_layers_that_read_masks_in_call_stay_whole():
    require_keras_hub()
    model = built(models.HubClassifier(), shape=(2, 6), dtype="int32")
    g = graph.from_model(model, stages=4)
    assert [n.kind for n in g.plain.nodes].count("TransformerEncoder") == 2
    assert len(g.notes) == 2 and all("with a Keras mask on its input" in note for note in g.notes), g.notes


def params_per_stage(g, stages: int) -> list[int]:
    """The parameters of each stage of the cut balanced by parameters (as ``balance=None`` cuts)."""
    sizes, out, start = cut.balance_by_cost([n.cost for n in g.plain.nodes], stages), [], 0
    for size in sizes:
        units = {n.unit for n in g.plain.nodes[start : start + size] if n.unit}
        out.append(sum(int(sum(np.prod(w.shape) for w in g.units[u].weights)) for u in units))
        start += size
    return out


def test_vits_encoder_is_expanded_into_its_blocks():
    require_keras_hub()
    vit = models.vit_classifier()
    whole = graph.from_model(vit, stages=1)  # (one stage: nothing to balance, the encoder one node)
    assert "ViTEncoder" in [n.kind for n in whole.plain.nodes]
    assert params_per_stage(whole, 4) == [880, 4480, 0, 51]  # the encoder on one stage, one stage empty
    g = graph.from_model(vit, stages=4)
    kinds = [n.kind for n in g.plain.nodes]
    assert "ViTEncoder" not in kinds and kinds.count("MultiHeadAttention") == 2 and not g.notes, kinds
    assert params_per_stage(g, 4) == [2000, 1104, 1120, 1187]  # (the first holds the patch embedding, 880)


@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])  # (the same cases: 4 in the slow tier)
def test_subclassed_models_pipelined_equal_the_unsplit_model(nprocs):
    require_keras_hub()
    launch = run_mpi(nprocs, "subclassed.py", *CASES, timeout=900)
    launch.assert_cases("SUBCLASSED OK {} ", CASES, nprocs)
    if nprocs == 4:  # ViT's encoder (34,240 parameters of 41,091) was one node: 6,752 / 34,240 / 0 / 99
        (line,) = launch.lines_with("VIT PARAMS PER STAGE 4")
        print(line)


def test_under_mixed_precision_a_composite_layer_is_expanded_with_its_own_casts():
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = models.stack_model(models.Stack(16, depth=4))
        g = graph.from_model(model, stages=2)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert "stack" not in [n.name for n in g.plain.nodes] and not g.notes, g.notes
    x = np.random.default_rng(2).normal(size=(4, 12)).astype("float32")
    values = dict(zip(g.plain.inputs, [keras.ops.convert_to_tensor(x)]))
    for call in g.calls:
        values.update(zip(call.outputs, call(values, training=False)))
    got, expected = values[g.plain.outputs[0]], model(x)
    assert got.dtype == expected.dtype
    got, expected = (keras.ops.convert_to_numpy(t).astype("float32") for t in (got, expected))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
