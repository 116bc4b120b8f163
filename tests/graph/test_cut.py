"""Cutting a graph into stages is plain data: checked in one process, without MPI or Keras."""

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.graph.cut import (
    Graph,
    Node,
    Tensor,
    balance_by_cost,
    chain_graph,
    check_sizes,
    cut,
    describe,
    sizes_before,
)


def skip_graph():
    """embed -> block_0 -> block_1 -> block_2 -> head, embed's output added again at block_2, and a
    model input (a padding mask) read by every block: the shape of a transformer with a skip edge."""
    f = "float32"
    tensors = (
        Tensor("tokens", (None, 8), "int32"),
        Tensor("padding_mask", (None, 8), "int32"),
        Tensor("embed", (None, 8, 4), f),
        Tensor("block_0", (None, 8, 4), f),
        Tensor("block_1", (None, 8, 4), f),
        Tensor("block_2", (None, 8, 4), f),
        Tensor("head", (None, 8, 10), f),
    )
    nodes = (
        Node("embed", (0,), (2,), "embed", 5.0),
        Node("block_0", (2, 1), (3,), "block_0", 10.0),
        Node("block_1", (3, 1), (4,), "block_1", 10.0),
        Node("block_2", (4, 1, 2), (5,), "block_2", 10.0),
        Node("head", (5,), (6,), "embed", 5.0),  # the embedding again: tied weights
    )
    return Graph(tensors, nodes, (0, 1), (6,))


def test_a_chain_crosses_each_boundary_once():
    c = cut(chain_graph(4), [1, 2, 1])
    assert [(x.tensor, x.source, x.destinations, x.gradient) for x in c.crossings] == [
        (1, 0, (1,), True),
        (3, 1, (2,), True),
    ]
    assert [s.inputs for s in c.stages] == [(0,), (1,), (3,)]
    assert [s.outputs for s in c.stages] == [(1,), (3,), (4,)]
    assert c.stages[0].model_inputs == (0,)
    assert c.stages[1].model_inputs == ()


def test_a_skip_edge_and_a_model_input_go_straight_to_every_stage_that_reads_them():
    c = cut(skip_graph(), [2, 2, 1])
    crossings = {x.tensor: (x.source, x.destinations, x.gradient) for x in c.crossings}
    assert crossings == {
        1: (0, (1,), False),  # the padding mask: from the first stage's data, no gradient
        2: (0, (1,), True),  # the skip edge, from stage 0 to stage 1's block_2
        3: (0, (1,), True),
        5: (1, (2,), True),
    }
    stage1 = c.stages[1]
    assert stage1.inputs == (1, 2, 3)  # by source, then tensor
    assert stage1.outputs == (5,)
    assert c.stages[2].outputs == (6,)  # the model output, on the last stage


def test_a_model_output_computed_early_crosses_to_the_last_stage():
    tensors = tuple(Tensor(f"t{i}", (None, 2), "float32") for i in range(4))
    nodes = (Node("a", (0,), (1,)), Node("b", (1,), (2,)), Node("c", (2,), (3,)))
    c = cut(Graph(tensors, nodes, (0,), (1, 3)), [1, 1, 1])
    assert {x.tensor: x.destinations for x in c.crossings} == {1: (1, 2), 2: (2,)}
    assert c.stages[2].outputs == (1, 3)


def test_weights_called_on_two_stages_are_shared():
    c = cut(skip_graph(), [2, 2, 1])
    assert c.shared == {"embed": (0, 2)}
    assert c.stages[2].units == ("embed",)
    assert any("weights of embed on stages 0, 2" in line for line in describe(c))


def test_a_graph_out_of_order_is_refused():
    tensors = tuple(Tensor(f"t{i}", (None, 2), "float32") for i in range(3))
    with pytest.raises(PipelineConfigError, match="before any node writes them"):
        Graph(tensors, (Node("b", (1,), (2,)), Node("a", (0,), (1,))), (0,), (2,))


def test_a_model_with_fewer_nodes_than_stages_leaves_the_last_stages_empty():
    c = cut(chain_graph(2), balance_by_cost([1, 1], 4))
    assert [s.nodes for s in c.stages] == [(0,), (1,), (), ()]
    assert {x.tensor: (x.source, x.destinations) for x in c.crossings} == {1: (0, (1,)), 2: (1, (3,))}
    assert c.stages[3].inputs == (2,) and c.stages[3].outputs == (2,)  # the loss, on the last stage
    assert c.stages[2].inputs == () and c.stages[2].outputs == ()


def test_dynamic_dimensions_are_known():
    assert Tensor("x", (None, None), "int32").dynamic
    assert not Tensor("x", (None, 8), "int32").dynamic
    assert Tensor("x", (None, 8, 4), "float32", mask=(None, None)).dynamic


def test_balance_by_cost_spreads_the_cost():
    assert balance_by_cost([1] * 4, 2) == [2, 2]
    assert balance_by_cost([100481, 16513, 16513, 1, 1291, 1], 2) == [1, 5]
    assert all(b >= 1 for b in balance_by_cost([5, 1, 1, 1, 1, 1], 6))


def test_sizes_must_cover_every_node():
    with pytest.raises(PipelineConfigError, match=r"balance \[3, 3\] covers 6 layers but the model has 7"):
        check_sizes([3, 3], 7, 2)
    with pytest.raises(PipelineConfigError, match="has 3 stages but the job has 2 ranks"):
        check_sizes([1, 1, 5], 7, 2)
    with pytest.raises(PipelineConfigError, match="positive integers"):
        check_sizes([0, 7], 7, 2)


def test_split_before_names_the_first_node_of_each_later_stage():
    assert sizes_before(skip_graph(), ["block_1", "head"], 3) == [2, 2, 1]
    with pytest.raises(PipelineConfigError, match="'block_9', which is no node"):
        sizes_before(skip_graph(), ["block_9", "head"], 3)
    with pytest.raises(PipelineConfigError, match="in the order they run"):
        sizes_before(skip_graph(), ["head", "block_1"], 3)
    with pytest.raises(PipelineConfigError, match="starts 2 stages but the job has 3"):
        sizes_before(skip_graph(), ["head"], 3)
