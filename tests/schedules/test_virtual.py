"""Schedules with several chunks per rank (interleaved 1F1B, ZB-V) are plain data: checked without MPI."""

import random

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_HEAD,
    FORWARD_INPUT,
    FORWARD_LOSS,
    Holding,
    format_actions,
    max_held,
    max_in_flight,
    one_f_one_b,
    zero_bubble_h1,
)
from keras_pipe.schedules.simulator import DURATIONS, durations_of, makespan, simulate
from keras_pipe.schedules.virtual import (
    chunked_forward_only,
    chunked_gpipe,
    interleaved_one_f_one_b,
    loop_placement,
    v_placement,
)
from keras_pipe.schedules.zero_bubble import zero_bubble_v


def _scaled(durations, chunks):
    """A chunk holds 1/v of a stage's layers: each of its actions takes 1/v of the time."""
    return {kind: ticks / chunks for kind, ticks in durations.items()}


def _random_durations(seed):
    rng = random.Random(seed)
    return durations_of(*(rng.uniform(0.2, 3.0) for _ in range(3)))


def _check_order(schedule, chunks, microbatches):
    """Each chunk runs every part once, its forwards, input and weight gradients in micro-batch order."""
    for actions in schedule:
        for c in range(chunks):
            mine = [a for a in actions if a.chunk == c]
            for part in ("forwards", "input_gradient"):
                assert [a.microbatch for a in mine if getattr(a.kind, part)] == list(range(microbatches)), mine
            weights = [i for a in mine if a.kind.weight_gradient for i in a.microbatches]
            assert weights == list(range(microbatches)), format_actions(mine)


def test_interleaved_matches_the_diagram():
    assert [format_actions(a) for a in interleaved_one_f_one_b(2, 4, 2)] == [
        "F0 F1 F0@1 F1@1 F2 B0@1 F3 B1@1 F2@1 B0 F3@1 B1 B2@1 B3@1 B2 B3",
        "F0 F1 FB0@1 FB1@1 F2 B0 F3 B1 FB2@1 FB3@1 B2 B3",
    ]
    # one chunk a rank is 1F1B
    assert interleaved_one_f_one_b(3, 6, 1) == one_f_one_b(3, 6)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("split", [False, True])
def test_interleaved_completes_within_megatrons_bounds(ranks, rounds, chunks, split):
    m = ranks * rounds
    schedule = interleaved_one_f_one_b(ranks, m, chunks, split)
    placement = loop_placement(ranks, chunks)
    for seed in range(3):  # (an order that ran is valid whatever the durations)
        simulate(schedule, _random_durations(seed), placement)
    _check_order(schedule, chunks, m)
    plain = interleaved_one_f_one_b(ranks, m, chunks)
    for r, actions in enumerate(plain):
        # Megatron's warm-up: 2 (P - r - 1) + (v - 1) P forwards, then one more before the first backward
        # (a single round: every forward first)
        bound = min(m * chunks, 2 * (ranks - r - 1) + (chunks - 1) * ranks + 1) if rounds > 1 else m * chunks
        assert max_in_flight(actions) == bound or (rounds == 1 and r == ranks - 1), (r, format_actions(actions))
        assert max_in_flight(actions) <= bound
        assert max_held(schedule[r]) <= max_in_flight(actions) + 1e-9
    # The bubble shrinks v times: (P - 1) stage-sized (F + B) instead of ... over m (F + B) of work.
    ideal = m * (DURATIONS[FORWARD] + DURATIONS[BACKWARD])
    bubble = (ranks - 1) * (DURATIONS[FORWARD] + DURATIONS[BACKWARD]) / chunks
    assert makespan(plain, _scaled(DURATIONS, chunks), placement) == pytest.approx(ideal + bubble)
    assert makespan(one_f_one_b(ranks, m), DURATIONS) == pytest.approx(ideal + bubble * chunks)


def test_interleaved_batches_weight_passes_per_chunk():
    split = interleaved_one_f_one_b(2, 4, 2, True, hold={0: Holding(limit=8), 1: Holding(limit=8)})
    assert [str(a) for a in split[0] if a.kind is BACKWARD_WEIGHT] == ["W0-3@1", "W0-3"]
    simulate(split, DURATIONS, loop_placement(2, 2))


def test_interleaved_needs_whole_rounds():
    with pytest.raises(PipelineConfigError, match="not a multiple of 4: use num_microbatches=8"):
        interleaved_one_f_one_b(4, 6, 2)
    for bad in (0, 1.5, True):
        with pytest.raises(PipelineConfigError, match="num_chunks"):
            interleaved_one_f_one_b(2, 2, bad)


def test_zero_bubble_v_matches_the_diagram():
    assert [format_actions(a) for a in zero_bubble_v(2, 4)] == [
        "F0 F1 F2 FI0@1 W0@1 FI1@1 I0 W1@1 I1 F3 W0 FI2@1 W1 W2@1 I2 W2 FI3@1 W3@1 I3 W3",
        "F0 F0@1 F1 F1@1 I0@1 I0 W0@1 I1@1 I1 F2 W0 F2@1 W1@1 F3 I2@1 I2 W1 F3@1 W2@1 W2 I3@1 I3 W3@1 W3",
    ]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8, 13, 16])
def test_zero_bubble_v_keeps_1f1b_memory_and_beats_zb_h1(ranks, microbatches):
    schedule = zero_bubble_v(ranks, microbatches)
    placement = v_placement(ranks)
    for seed in range(3):
        simulate(schedule, _random_durations(seed), placement)
    _check_order(schedule, 2, microbatches)
    for actions in schedule:
        assert {a.kind for a in actions} <= {FORWARD, FORWARD_INPUT, BACKWARD_INPUT, BACKWARD_WEIGHT}
        # chunk-sized micro-batches from F to W: at most 2P, the P whole-stage ones 1F1B's first rank holds
        assert max_held(actions) <= 2 * min(ranks, microbatches)
    # F, I and W of a chunk each half a stage's: faster than ZB-H1 and 1F1B on one chunk a rank
    zb_v = makespan(schedule, _scaled(DURATIONS, 2), placement)
    zb_h1 = makespan(zero_bubble_h1(ranks, microbatches), DURATIONS)
    assert zb_v <= zb_h1 <= makespan(one_f_one_b(ranks, microbatches), DURATIONS)
    if ranks > 1:
        assert zb_v < zb_h1
    if microbatches >= 2 * ranks:  # the bubble all but gone: (P + 1) / 2 chunk-sized ticks at most
        assert zb_v - microbatches * 3 <= (ranks + 1) / 2


def test_a_schedule_on_the_wrong_placement_deadlocks():
    # ZB-V's chunk 1 comes back up the ranks; on a loop placement it would wait for itself
    with pytest.raises(PipelineConfigError, match="deadlocks"):
        simulate(zero_bubble_v(3, 3), DURATIONS, loop_placement(3, 2))


def test_the_docstring_examples():
    import doctest

    from keras_pipe.schedules import virtual, zero_bubble

    for module in (virtual, zero_bubble):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_docs_show_what_the_simulator_says():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).parent.parent.parent
    spec = importlib.util.spec_from_file_location("schedules", root / "benchmarks" / "schedules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "schedules.md").read_text() == module.report(4, 8), "run benchmarks/schedules.py"


@pytest.mark.parametrize(
    "placement", [loop_placement(1, 2), loop_placement(3, 2), loop_placement(2, 3), v_placement(3)]
)
@pytest.mark.parametrize("microbatches", [1, 2, 5])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("whole_batch_loss", [False, True])
def test_gpipe_over_chunks_runs_any_placement_and_any_count(placement, microbatches, split, whole_batch_loss):
    # what a chunked pipeline runs for a short batch (interleaving needs whole rounds) or a whole-batch loss
    schedule = chunked_gpipe(placement, microbatches, split, whole_batch_loss)
    for seed in range(3):
        simulate(schedule, _random_durations(seed), placement)
    _check_order(schedule, len(placement[0]), microbatches)
    final = sum(map(len, placement)) - 1
    ((r, c),) = [(r, c) for r, stages in enumerate(placement) for c, k in enumerate(stages) if k == final]
    kinds = {a.kind for a in schedule[r] if a.chunk == c}
    # the loss's stage runs every forward before any backward where the loss needs the whole batch
    assert (FORWARD_HEAD in kinds) == whole_batch_loss, (whole_batch_loss, format_actions(schedule[r]))
    assert FORWARD not in kinds
    for last in (FORWARD, FORWARD_LOSS, FORWARD_HEAD):
        simulate(chunked_forward_only(placement, microbatches, last), DURATIONS, placement)


def test_gpipe_over_chunks_matches_the_diagram():
    assert [format_actions(a) for a in chunked_gpipe(loop_placement(2, 2), 2)] == [
        "F0 F1 F0@1 F1@1 B0@1 B1@1 B0 B1",
        "F0 F1 FB0@1 FB1@1 B0 B1",
    ]


@pytest.mark.parametrize("ranks, microbatches", [(2, 2), (2, 4), (3, 6), (4, 8)])
def test_zero_bubble_schedules_run_one_w_a_chunk_where_ws_follow_each_other(ranks, microbatches):
    """ZB-V's middle rank ended with W0@1 W0 W1@1 W1 at m = 2: now W0-1@1 W0-1, the same sums in fewer calls."""
    from keras_pipe.schedules.actions import BACKWARD_WEIGHT
    from keras_pipe.schedules.schedule import make_schedule

    for name, chunks in (("zb-v", 2), ("zb-h1", 1)):
        merged = make_schedule(name, ranks, microbatches, num_chunks=chunks)
        plain = zero_bubble_v(ranks, microbatches) if name == "zb-v" else zero_bubble_h1(ranks, microbatches)
        for row, before in zip(merged, plain):
            for a, b in zip(row, row[1:]):
                assert not (a.kind is b.kind is BACKWARD_WEIGHT and a.chunk == b.chunk), format_actions(row)
            # every micro-batch's W still runs once a chunk, and the rest is unchanged, in order
            weights = sorted((a.chunk, i) for a in row if a.kind is BACKWARD_WEIGHT for i in a.microbatches)
            assert weights == sorted((a.chunk, i) for a in before if a.kind is BACKWARD_WEIGHT for i in a.microbatches)
            assert [a for a in row if a.kind is not BACKWARD_WEIGHT] == [
                a for a in before if a.kind is not BACKWARD_WEIGHT
            ]
        simulate(merged, DURATIONS, v_placement(ranks) if name == "zb-v" else None)
        for row, before in zip(merged, plain):
            assert max_held(row) <= max_held(before)
    assert format_actions(make_schedule("zb-v", 2, 2, num_chunks=2)[1]).endswith("I1 W0-1@1 W0-1")
