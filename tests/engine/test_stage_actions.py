"""What each rank's executor runs (StageActions' lowered lists), put together for a pipeline, on the simulator.

The schedules' own tests (tests/schedules/test_lowering.py) lower what the
schedules give; here every rank resolves its list as a pipeline's ranks do
(its stage's split, its holding, the phase, a whole-batch loss, a short
batch), and the lists the executors would run are simulated together: each
receive matched to its peer's send, no deadlock, every part once. With
replicas each pipeline runs its own share of the batch (its own number of
micro-batches, none for an empty share) on its own communicator: each
pipeline's lists are simulated as they resolve them.
"""

from types import SimpleNamespace

import pytest

from keras_pipe.engine.chunks import Chunk
from keras_pipe.engine.stage_actions import StageActions
from keras_pipe.schedules import CHUNKED_SCHEDULES, SCHEDULES, computing, placement, simulate
from keras_pipe.schedules.actions import Kind
from keras_pipe.stage.microbatch import microbatch_bounds, replica_bounds


def _chunks(stages: list, num_virtual: int, split: bool, held_bytes) -> list:
    computes = [
        SimpleNamespace(split=split, held_bytes=held_bytes, weight_bytes=64 << 20, kept_bytes=held_bytes)
        for _ in stages
    ]
    return [Chunk(compute, None, k == 0, k == num_virtual - 1) for compute, k in zip(computes, stages)]


def executed(name: str, ranks: int, chunks: int, phase: str, m: int, whole: bool, splits: list, held_bytes) -> list:
    """Each rank's list, as its engine resolves it (``splits[r]``: whether rank ``r``'s stage splits its backward)."""
    where = placement(name, ranks, chunks)
    num_virtual = ranks * chunks
    rows = []
    for r in range(ranks):
        actions = StageActions(name, None, ranks, r, chunks, where)
        rows.append(actions.for_batch(_chunks(where[r], num_virtual, splits[r], held_bytes), phase, m, whole))
    return rows


CASES = [
    (name, ranks, chunks)
    for name in SCHEDULES + CHUNKED_SCHEDULES
    for ranks in (1, 2, 3, 4)
    for chunks in ((1,) if name in SCHEDULES else (2, 3) if name == "interleaved-1f1b" else (2,))
]


@pytest.mark.parametrize("name, ranks, chunks", CASES)
def test_the_lists_the_executors_run_match_their_messages(name, ranks, chunks):
    where = placement(name, ranks, chunks)
    for m in range(1, 7):
        for phase, whole in (("train", False), ("train", True), ("test", False), ("test", True), ("predict", False)):
            for splits in ([True] * ranks, [False] * ranks, [r % 2 == 1 for r in range(ranks)]):
                for held_bytes in (None, 1 << 20):
                    rows = executed(name, ranks, chunks, phase, m, whole, splits, held_bytes)
                    case = (phase, m, whole, splits, held_bytes)
                    timeline = simulate(rows, None, where)
                    assert [[a for _, a in row] for row in timeline] == rows, case
                    kinds = {a.kind for row in rows for a in computing(row)}
                    last = {Kind.FORWARD_HEAD} if whole else {Kind.FORWARD_LOSS} if phase == "test" else set()
                    assert last <= kinds, case


@pytest.mark.parametrize(
    "name, ranks, chunks", [("1f1b", 2, 1), ("zb-h1", 3, 1), ("interleaved-1f1b", 2, 2), ("zb-v", 2, 2)]
)
@pytest.mark.parametrize("replicas", [2, 3])
def test_each_replicas_pipeline_runs_the_lists_of_its_share(name, ranks, chunks, replicas):
    # a replica's share of a short batch has fewer micro-batches (interleaved 1F1B then runs GPipe's
    # order over the chunks), or none: the replicas' pipelines run different lists, each matched
    where = placement(name, ranks, chunks)
    for batch_size in range(1, 10):
        for m in (1, 2, 4):
            for phase, whole in (("train", False), ("train", True), ("test", True)):
                for first, last in replica_bounds(batch_size, replicas):
                    count = len(microbatch_bounds(last - first, m)) if last > first else 0
                    if not count:
                        continue  # (an empty share runs no action: the engine's run)
                    rows = executed(name, ranks, chunks, phase, count, whole, [True] * ranks, None)
                    simulate(rows, None, where)
