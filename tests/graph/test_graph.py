"""A Keras model as a graph of nodes, built without allocating other stages' weights (one process)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from keras_pipe import compat, unallocated  # noqa: E402
from keras_pipe.errors import PipelineConfigError  # noqa: E402
from keras_pipe.graph import graph  # noqa: E402
from keras_pipe.graph.cut import cut  # noqa: E402


def seed_layers():
    return [
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(10, activation="softmax"),
    ]


def test_a_chain_is_a_graph_of_one_node_per_layer_with_no_weight_allocated():
    layers = seed_layers()
    g = graph.from_model(graph.chain_model(layers, keras.Input((28, 28))))
    assert [t.shape for t in g.plain.tensors] == [(None, 28, 28), (None, 784)] + [(None, 128)] * 4 + [(None, 10)]
    assert [node.inputs for node in g.plain.nodes] == [(i,) for i in range(6)]
    assert [node.cost for node in g.plain.nodes] == [1, 100481, 16513, 16513, 1, 1291]
    assert g.weight_shapes(g.plain.nodes[1].unit) == [((784, 128), "float32"), ((128,), "float32")]
    assert all(compat.unallocated(v) for layer in layers for v in layer.weights)


def _resident_gib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 2**20


def test_building_the_graph_allocates_none_of_the_weights():
    # 4 x Dense(8192): 1 GiB of weights, which Keras' plain StatelessScope
    # allocates when it exits; every rank builds every layer's shapes.
    layers = [keras.layers.Dense(8192) for _ in range(4)]
    before = _resident_gib()
    g = graph.from_model(graph.chain_model(layers, keras.Input((8192,))))
    with keras.StatelessScope():  # a later scope must not allocate them either
        pass
    assert sum(node.cost - 1 for node in g.plain.nodes) == 4 * (8192 * 8192 + 8192)
    assert _resident_gib() - before < 0.25
    graph.allocate(layers[:1])  # the owner of the first layer, say
    assert not compat.unallocated(layers[0].kernel) and compat.unallocated(layers[1].kernel)


def test_a_layer_that_cannot_take_the_input_is_named():
    layers = [keras.layers.Dense(4), keras.layers.Conv2D(2, 3)]
    with pytest.raises(PipelineConfigError, match=r"layer 1 \(conv2d.*, Conv2D\) cannot be called"):
        graph.chain_model(layers, keras.Input((8,)))


def test_nested_models_shared_layers_and_op_nodes_become_nodes():
    with unallocated():
        tokens = keras.Input((6,), dtype="int32", name="tokens")
        embed = keras.layers.Embedding(20, 4, name="embed")
        inner_in = keras.Input((6, 4))
        block = keras.Model(inner_in, keras.layers.Dense(4, name="inner_dense")(inner_in), name="block")
        x = embed(tokens)
        y = block(x) + x  # an op node and a skip edge
        first = y[:, 0, :]  # an op node
        head = keras.layers.Dense(20, name="head")
        model = keras.Model(tokens, [head(first), head(y[:, 1, :])])
    g = graph.from_model(model)
    names = [node.name for node in g.plain.nodes]
    assert "inner_dense" in names and "block" not in names  # expanded
    assert names.count("head") == 1 and "head:1" in names  # the second call of a shared layer
    assert sorted(g.units) == ["embed", "head", "inner_dense"]
    assert len(g.weight_order) == len(model.weights)
    the_cut = cut(g.plain, [3, len(names) - 3])
    assert "head" not in the_cut.shared  # both calls on the last stage
    values = {g.plain.inputs[0]: np.array([[1, 2, 3, 4, 5, 6]])}
    graph.allocate(g.units.values())
    for call in g.calls:
        values.update(zip(call.outputs, call(values, training=False)))
    np.testing.assert_allclose(values[g.plain.outputs[0]], model(np.array([[1, 2, 3, 4, 5, 6]]))[0], rtol=1e-6)


def test_an_unbuilt_subclassed_model_is_refused_saying_what_to_do():
    class Mine(keras.Model):
        def call(self, x):
            return x

    # (a built one is traced: tests/test_subclassed.py)
    with pytest.raises(PipelineConfigError, match=r"no known input shape \(it is not built\).*inputs=keras.Input"):
        graph.from_model(Mine())


def test_released_weights_cannot_be_read_and_say_why():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    graph.release([layer])
    assert compat.unallocated(layer.kernel)
    with pytest.raises(RuntimeError, match="belongs to another stage"):
        layer.kernel.numpy()


class _Parent(keras.layers.Layer):
    """A layer holding a child layer and a weight of its own (keras_hub's TokenAndPositionEmbedding)."""

    def __init__(self, child=None, **kwargs):
        super().__init__(**kwargs)
        self.child = child or keras.layers.Dense(4, name="child")

    def build(self, shape):
        if not self.child.built:
            self.child.build(shape)
        self.own = self.add_weight(shape=(4,), name="own")

    def call(self, x):
        return self.child(x) + self.own


def test_a_child_layer_called_apart_from_its_parent_is_the_parents_unit():
    inputs = keras.Input((4,))
    parent = _Parent(name="parent")
    h = keras.layers.Dense(4, name="middle")(parent(inputs))
    outputs = parent.child(h)  # OPTCausalLM's head: the child of the first layer, called last
    model_graph = graph.from_model(keras.Model(inputs, outputs))
    assert sorted(model_graph.units) == ["middle", "parent"]
    assert [n.unit for n in model_graph.plain.nodes] == ["parent", "middle", "parent"]
    assert cut(model_graph.plain, [2, 1]).shared == {"parent": (0, 1)}


def test_layers_sharing_part_of_their_variables_are_held_together():
    # (DistilBERT: its embeddings and its masked-LM head both hold the token table, each beside weights of its own)
    inputs = keras.Input((4,))
    child = keras.layers.Dense(4, name="child")
    first, second = _Parent(child, name="first"), _Parent(child, name="second")
    outputs = keras.layers.Dense(4, name="last")(second(keras.layers.Dense(4, name="middle")(first(inputs))))
    model_graph = graph.from_model(keras.Model(inputs, outputs))
    assert model_graph.plain.together == (("first", "second"),)
    two = cut(model_graph.plain, [2, 2])
    assert [stage.units for stage in two.stages] == [("first", "middle", "second"), ("second", "last", "first")]
    assert two.shared == {"first": (0, 1), "second": (0, 1)}


def test_a_nested_model_built_on_a_list_and_called_with_a_dict_reads_its_inputs_by_name():
    # (keras_hub's Gemma3nCausalLM calls its backbone, built on [token_ids, padding_mask], with a dict: in the
    # dict's sorted order the two would swap)
    from keras_pipe import PipelineModel

    second, first = keras.Input((2,), name="second"), keras.Input((2,), name="first")
    inner = keras.Model([second, first], keras.layers.Dense(2, name="d")(second) - 3.0 * first)
    given = {"second": keras.Input((2,), name="second"), "first": keras.Input((2,), name="first")}
    outer = keras.Model(given, inner({"second": given["second"], "first": given["first"]}))
    data = {"second": np.ones((4, 2), "float32"), "first": np.full((4, 2), 2.0, "float32")}
    expected = outer.predict(data, verbose=0)
    pipeline = PipelineModel.from_model(outer)
    np.testing.assert_allclose(pipeline.predict(data, verbose=0), expected, rtol=1e-6)


def test_a_nested_model_called_with_inputs_as_a_keyword_is_expanded():
    # (keras_hub's Gemma 3, Gemma 4 and PaliGemma tasks call their backbone as backbone(inputs=...))
    from keras_pipe import PipelineModel

    inner_input = keras.Input((3,), name="x")
    inner = keras.Model(inner_input, keras.layers.Dense(2, name="inner_dense")(inner_input))
    given = keras.Input((3,), name="x")
    outer = keras.Model(given, keras.layers.Dense(1, name="head")(inner(inputs=given)))
    assert [n.name for n in graph.from_model(outer).plain.nodes] == ["inner_dense", "head"]
    data = np.arange(12, dtype="float32").reshape(4, 3)
    expected = outer.predict(data, verbose=0)
    np.testing.assert_allclose(PipelineModel.from_model(outer).predict(data, verbose=0), expected, rtol=1e-6)
