"""Each rank's GPU is plain data: chosen from its place among its host's ranks, tested without a GPU."""

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.mpi.devices import choose_gpu, local_rank_from_environment


def test_each_rank_of_a_host_gets_a_gpu_of_its_own():
    assert [choose_gpu(r, 4, num_gpus=4) for r in range(4)] == [0, 1, 2, 3]
    assert [choose_gpu(r, 2, num_gpus=8) for r in range(2)] == [0, 1]


def test_a_host_without_gpus_or_none_runs_on_the_cpu():
    assert choose_gpu(0, 4, num_gpus=0) is None
    assert choose_gpu(1, 2, num_gpus=2, setting="none") is None


def test_more_ranks_than_gpus_is_an_error_saying_how_to_share():
    with pytest.raises(PipelineConfigError, match="4 ranks run on this host but it has 2 GPUs.*KERAS_PIPE_GPUS=shared"):
        choose_gpu(3, 4, num_gpus=2)
    assert [choose_gpu(r, 4, num_gpus=2, setting="shared") for r in range(4)] == [0, 1, 0, 1]


def test_an_explicit_list_gives_each_rank_its_gpu():
    assert [choose_gpu(r, 2, num_gpus=4, setting="2,3") for r in range(2)] == [2, 3]
    with pytest.raises(PipelineConfigError, match="KERAS_PIPE_GPUS='0,7'"):
        choose_gpu(0, 2, num_gpus=4, setting="0,7")
    with pytest.raises(PipelineConfigError, match="lists 1 GPUs but this host runs 2 ranks"):
        choose_gpu(1, 2, num_gpus=4, setting="1")


def test_the_local_rank_comes_from_the_launcher():
    assert local_rank_from_environment({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    assert local_rank_from_environment({"SLURM_LOCALID": "1"}) == 1
    assert local_rank_from_environment({}) is None


def test_examples():
    import doctest

    from keras_pipe.mpi import devices, files

    for module in (devices, files):
        assert doctest.testmod(module).failed == 0, module.__name__
