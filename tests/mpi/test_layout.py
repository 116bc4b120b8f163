"""Rank placement, as plain data (no MPI)."""

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.mpi.layout import Layout
from keras_pipe.stage.microbatch import replica_bounds


def test_block_placement_is_replica_times_stages_plus_stage():
    layout = Layout.from_hosts(["a", "a", "b", "b"], num_stages=2)
    assert layout.pipelines == [[0, 1], [2, 3]]
    assert [(layout.replica_of(r), layout.stage_of(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.replicas_of_stage(1) == [1, 3]
    assert layout.cross_host_links() == 0


def test_round_robin_placement_still_keeps_each_pipeline_on_one_host():
    layout = Layout.from_hosts(["a", "b", "a", "b", "a", "b", "a", "b"], num_stages=4)
    assert layout.pipelines == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.cross_host_links() == 0
    assert layout.rank_of(1, 2) == 5


def test_a_pipeline_spans_hosts_only_where_a_host_cannot_hold_whole_pipelines():
    layout = Layout.from_hosts(["a", "a", "a", "b", "b", "b"], num_stages=2)
    assert layout.pipelines == [[0, 1], [2, 3], [4, 5]]
    assert layout.cross_host_links() == 1


def test_default_is_one_pipeline_over_every_rank():
    layout = Layout.from_hosts(["a", "a", "b"], num_stages=None)
    assert layout.pipelines == [[0, 1, 2]]
    assert layout.num_replicas == 1


def test_describe_names_ranks_and_hosts():
    lines = Layout.from_hosts(["n1", "n1", "n2", "n2"], 2).describe()
    assert lines == [
        "replica 0: stage 0: rank 0 (n1), stage 1: rank 1 (n1)",
        "replica 1: stage 0: rank 2 (n2), stage 1: rank 3 (n2)",
    ]


@pytest.mark.parametrize("num_stages", [3, 0, -1, 2.0, True])
def test_bad_num_stages_say_what_works(num_stages):
    with pytest.raises(PipelineConfigError) as error:
        Layout.from_hosts(["h"] * 4, num_stages)
    if num_stages == 3:
        assert "use a num_stages in [1, 2, 4]" in str(error.value)


def test_replica_shares_cover_the_batch_in_order():
    for batch in range(0, 40):
        for replicas in range(1, 6):
            bounds = replica_bounds(batch, replicas)
            sizes = [b - a for a, b in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == batch
            assert all(a == b_prev for (a, _), (_, b_prev) in zip(bounds[1:], bounds))
            assert max(sizes) - min(sizes) <= 1
