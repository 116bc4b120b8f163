"""Several model chunks a rank: placement, tags and the step with fakes (no MPI), then real ranks under mpirun.

The launch (``mpi_scripts/chunks.py``, 2 ranks: ZB-V's turn is a tensor
rank 1 hands from one chunk to the other, interleaving's a message from
rank 1 back to rank 0) trains
interleaved 1F1B with 2 and 3 chunks and ZB-V as keras.Sequential does,
with ``global_clipnorm``, Keras masks and a whole-batch loss, saves, loads
and refuses what chunks do not run yet. ``test_equivalence.py`` trains
both schedules on 4 ranks too; four ranks here train two replicas of a
two-rank pipeline with two chunks a rank.
"""

import keras
import numpy as np
import pytest
from mpi import run_mpi
from test_executor import FakeCompute, FakeLinks, Status, training_batch

from keras_pipe.engine.chunks import Chunk, ChunkComm, ranks_of_virtual_stages
from keras_pipe.engine.executor import Executor
from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules.lowering import lower
from keras_pipe.schedules.schedule import check_chunks, default_chunks, make_schedule, placement


class RecordingComm:
    """What a pipeline communicator is sent and asked for."""

    def __init__(self, bound=32767):
        self.sent, self.asked = [], []
        self.bound = bound
        self.world_rank = 0

    def tag_upper_bound(self):
        return self.bound

    def send(self, array, dest, tag):
        self.sent.append((dest, tag))

    def recv(self, source, tag, trailing, dtype):
        self.asked.append((source, tag))
        return np.zeros((1, *trailing), dtype)


def test_each_pair_of_virtual_stages_has_tags_of_its_own():
    ranks = ranks_of_virtual_stages(placement("interleaved-1f1b", 2, 2))
    assert ranks == [0, 1, 0, 1]
    comm = RecordingComm()
    first, third = ChunkComm(comm, ranks, 0), ChunkComm(comm, ranks, 2)
    first.send(np.zeros(1), 1, 11)
    third.send(np.zeros(1), 3, 11)
    (rank_a, tag_a), (rank_b, tag_b) = comm.sent
    assert rank_a == rank_b == 1 and tag_a != tag_b  # the same two ranks, two streams
    # the receiver names the same tag as the sender
    ChunkComm(comm, ranks, 1).recv(0, 11, (), "float32")
    assert comm.asked == [(0, tag_a)]
    # every tag of every pair and kind is distinct
    tags = {ChunkComm(comm, ranks, 0)._tag(kind, a, b) for kind in range(16) for a in range(4) for b in range(4)}
    assert len(tags) == 16 * 16


def test_too_many_virtual_stages_for_the_mpi_tags_is_a_clear_error():
    with pytest.raises(PipelineConfigError, match="virtual stages need message tags up to"):
        ChunkComm(RecordingComm(bound=1000), list(range(16)), 0)


def test_which_schedules_take_chunks():
    assert default_chunks("zb-v") == default_chunks("interleaved-1f1b") == 2 and default_chunks("1f1b") == 1
    assert placement("zb-v", 3, 2) == [[0, 5], [1, 4], [2, 3]]
    for name, chunks, message in [
        ("zb-v", 3, "two chunks a rank"),
        ("interleaved-1f1b", 1, "num_chunks of 2 or more"),
        ("gpipe", 2, "runs one chunk a rank"),
        ("1f1b", 0, "positive integer"),
    ]:
        with pytest.raises(PipelineConfigError, match=message):
            check_chunks(name, chunks)
    with pytest.raises(PipelineConfigError, match="placement"):
        ranks_of_virtual_stages([[0, 2], [2, 3]])


def _run_two_chunks(optimizer, fusable: bool):
    """Rank 0 of ZB-V on one rank (the first and the last virtual stage): each chunk's log, and the end's updates."""
    logs = [[], []]
    computes = [FakeCompute(logs[0], True), FakeCompute(logs[1], True)]
    for compute in computes:
        compute.gradients.empty = fusable
        compute.squared_norm = lambda grads: 1.0
    chunks = [Chunk(computes[c], FakeLinks(logs[c]), c == 0, c == 1) for c in range(2)]
    executor = Executor(None, None, None, is_first=True, is_last=True, status=Status(), where="stage 0", chunks=chunks)
    m = 2
    batch = training_batch(m, optimizer)
    updates = []
    import keras_pipe.engine.step_end as step_end_module

    original = step_end_module.apply_together
    step_end_module.apply_together = lambda computes, optimizer, grads, scale, variables=None: updates.append(
        len(computes)
    )
    try:
        executor.run(lower(make_schedule("zb-v", 1, m, num_chunks=2), placement("zb-v", 1, 2))[0], batch)
    finally:
        step_end_module.apply_together = original
    return logs, updates


def test_two_chunks_run_in_the_schedules_order_and_update_once():
    # each action goes to its chunk's compute and links; the step ends with one update over both chunks
    # (an optimizer that reads every gradient at once: Nadam), not one a chunk
    logs, updates = _run_two_chunks(keras.optimizers.Nadam(), fusable=True)
    assert logs[0] == ["F0", "send activation", "receive gradient", "I0", "F1", "send activation", "W0",
                       "receive gradient", "I1", "W1"]  # fmt: skip
    assert logs[1] == ["receive activation", "FI0", "send gradient", "W0", "receive activation", "FI1",
                       "send gradient", "W1"]  # fmt: skip
    assert updates == [2]


def test_each_chunks_last_weight_pass_updates_its_weights_and_one_counts_the_step():
    logs, updates = _run_two_chunks(keras.optimizers.Adam(), fusable=True)
    assert logs[1][-1] == "W1+update uncounted" and logs[0][-1] == "W1+update"  # (chunk 0's W1 comes last)
    assert updates == []
    # gradients already summed (a recorded backward's): the end of the step updates both chunks at once
    logs, updates = _run_two_chunks(keras.optimizers.Adam(), fusable=False)
    assert logs[0][-1] == logs[1][-1] == "W1" and updates == [2]


# (four ranks, two replicas of a two-rank pipeline with two chunks a rank: the slow tier; the default suite sums
# replicas' gradients in test_network.py and test_features.py, and several chunks' on two ranks here)
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_chunked_schedules_equal_sequential_under_mpirun(nprocs):
    cases = ["equivalence", "features", "saving", "errors"] if nprocs == 2 else ["replicas"]
    launch = run_mpi(nprocs, "chunks.py", *cases, timeout=900)
    launch.assert_cases("CHUNKS OK {} ", cases, nprocs)
