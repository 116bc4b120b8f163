"""Schedules are plain data: checked in one process, without MPI."""

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_BACKWARD,
    FORWARD_INPUT,
    SCHEDULES,
    Holding,
    act,
    format_actions,
    forward_only,
    gpipe,
    hold_for,
    make_schedule,
    max_held,
    max_in_flight,
    one_f_one_b,
    zero_bubble_h1,
)
from keras_pipe.schedules.lowering import lower
from keras_pipe.schedules.simulator import DURATIONS, format_schedule, makespan, simulate


def test_one_f_one_b_matches_the_diagram():
    schedule = one_f_one_b(3, 4)
    assert [format_actions(a) for a in schedule] == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "FB0 FB1 FB2 FB3",
    ]


def test_gpipe_runs_all_forwards_then_backwards_in_order():
    assert format_actions(gpipe(3, 3)[1]) == "F0 F1 F2 B0 B1 B2"
    # The last stage needs no other rank for a backward: one fused action per micro-batch.
    assert format_actions(gpipe(3, 3)[2]) == "FB0 FB1 FB2"


def test_a_whole_batch_loss_runs_every_forward_of_the_last_stage_first():
    # A masked output's mean loss divides by the batch's unmasked entries: the
    # last stage counts them in its forwards before its first backward.
    # (its forwards sum the terms and count the divisors: FH)
    plan = gpipe(3, 3, whole_batch_loss=True)
    assert [format_actions(a) for a in plan] == ["F0 F1 F2 B0 B1 B2"] * 2 + ["FH0 FH1 FH2 B0 B1 B2"]
    assert makespan(plan, {FORWARD: 1, BACKWARD: 1}) == 2 * (3 + 3 - 1)  # no longer than GPipe


def test_split_backward_batches_weight_passes_within_the_memory_bound():
    # 1F1B: a stage holds at most P - s micro-batches from forward to W; W runs
    # over those it holds when holding one more would pass the bound.
    assert [format_actions(a) for a in one_f_one_b(2, 3, split_backward=True)] == [
        "F0 F1 I0 W0 F2 I1 I2 W1-2",
        "FI0 W0 FI1 W1 FI2 W2",
    ]
    # Where activations are small beside the weights (hold_for), one W per batch.
    everything = {0: Holding(limit=3), 1: Holding(limit=3)}
    assert [format_actions(a) for a in one_f_one_b(2, 3, split_backward=True, hold=everything)] == [
        "F0 F1 I0 F2 I1 I2 W0-2",
        "FI0 FI1 FI2 W0-2",
    ]
    # What a micro-batch holds for its W may cost more than its activations:
    # Dense's input and output gradient against its input alone, say.
    assert format_actions(one_f_one_b(4, 4, True, {0: Holding(cost=2.0)})[0]) == "F0 F1 F2 F3 I0 W0 I1 I2 W1-2 I3 W3"
    # GPipe holds every micro-batch anyway: one W over the batch on every stage.
    assert [format_actions(a) for a in gpipe(2, 2, split_backward=True)] == ["F0 F1 I0 I1 W0-1", "FI0 FI1 W0-1"]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8, 13])
@pytest.mark.parametrize("limit, cost", [(None, 1.0), (None, 2.0), (None, 0.5), (2, 1.0), (5, 3.0), (100, 1.0)])
def test_what_a_split_stage_holds_stays_within_the_schedule_bound(stages, microbatches, limit, cost):
    holds = {s: Holding(limit, cost) for s in range(stages)}
    for name in ("1f1b", "gpipe"):
        unsplit = make_schedule(name, stages, microbatches)
        split = make_schedule(name, stages, microbatches, True, holds)
        simulate(split, DURATIONS)  # (no deadlock, every part once)
        for s, (plain, actions) in enumerate(zip(unsplit, split)):
            bound = max(max_in_flight(plain), limit or 0) if name == "1f1b" else microbatches * max(cost, 1.0)
            # within the bound, but for one micro-batch held alone for its W (costing more than its activations)
            assert max_held(actions, cost) <= max(bound, max_in_flight(plain) - 1 + cost) + 1e-9, (name, s, actions)
            # no W sooner than the bound asks: one W where the whole batch fits
            weights = [a for a in actions if a.kind is BACKWARD_WEIGHT]
            if bound >= microbatches * max(cost, 1.0):
                assert len(weights) == 1, (name, s, format_actions(actions))
        assert [max_held(a) for a in unsplit] == [max_in_flight(a) for a in unsplit]


def test_hold_for_weighs_activations_against_the_weights():
    mib = 1 << 20
    # small activations beside the weights: hold the batch for one W
    assert hold_for(256 * mib, held_bytes=8 * mib, kept_bytes=8 * mib, num_microbatches=8) == Holding(8.0, 1.0)
    assert hold_for(256 * mib, held_bytes=16 * mib, kept_bytes=8 * mib, num_microbatches=8) == Holding(8.0, 2.0)
    # activations that dominate: the schedule's own bound, each held micro-batch at its cost
    assert hold_for(4 * mib, held_bytes=64 * mib, kept_bytes=32 * mib, num_microbatches=8) == Holding(None, 2.0)
    # the last stage keeps nothing between its forward and its I: cost 1
    assert hold_for(4 * mib, held_bytes=64 * mib, kept_bytes=None, num_microbatches=8) == Holding(None, 1.0)
    # a few MiB in all are held whatever the weights (a W per micro-batch would save nothing that matters)
    assert hold_for(64 << 10, held_bytes=1 * mib, kept_bytes=1 * mib, num_microbatches=8) == Holding(8.0, 1.0)
    assert hold_for(64 << 10, held_bytes=4 * mib, kept_bytes=4 * mib, num_microbatches=8) == Holding(4.0, 1.0)


def test_gpipe_runs_one_weight_pass_whatever_holding_costs():
    for cost in (0.5, 1.0, 3.0):
        for actions in gpipe(3, 4, True, hold={s: Holding(cost=cost) for s in range(3)}):
            assert [str(a) for a in actions if a.kind is BACKWARD_WEIGHT] == ["W0-3"]


def test_zero_bubble_h1_matches_the_diagram():
    assert [format_actions(a) for a in zero_bubble_h1(3, 4)] == [
        "F0 F1 F2 I0 W0 I1 F3 I2 W1-2 I3 W3",
        "F0 F1 I0 F2 I1 W0 I2 F3 W1-2 I3 W3",
        "FI0 FI1 FI2 W0-1 FI3 W2-3",
    ]


@pytest.mark.parametrize("stages", [2, 3, 4, 7])
@pytest.mark.parametrize("microbatches", [2, 4, 8, 13])
def test_zero_bubble_h1_fills_the_bubble_at_1f1b_peak_memory(stages, microbatches):
    # F, I and W one tick each: 1F1B takes 3 (m + P - 1); ZB-H1's W fill the
    # warm-up and cool-down, down to the ideal 3m + P - 1 on two stages (an even m).
    schedule = zero_bubble_h1(stages, microbatches)
    ticks = makespan(schedule, DURATIONS)
    assert ticks < makespan(one_f_one_b(stages, microbatches), DURATIONS)
    assert ticks <= 3 * microbatches + 2 * (stages - 1)
    if stages == 2 and microbatches % 2 == 0:
        assert ticks == 3 * microbatches + 1
    for s, actions in enumerate(schedule):
        assert max_in_flight(actions) == min(stages - s, microbatches)  # 1F1B's in flight
        assert max_held(actions) <= min(stages, microbatches)  # 1F1B's peak in all


def _parts(actions):
    """(part, micro-batch) for each forward, input gradient and weight gradient an action list runs."""
    seen = []
    for action in actions:
        for i in action.microbatches:
            if action.kind.forwards:
                seen.append(("F", i))
            if action.kind.input_gradient:
                seen.append(("I", i))
            if action.kind.weight_gradient:
                seen.append(("W", i))
    return seen


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8, 13])
def test_every_schedule_completes_without_deadlock(name, split, stages, microbatches):
    schedule = make_schedule(name, stages, microbatches, split)
    timeline = simulate(schedule, DURATIONS)
    for stage, actions in enumerate(schedule):
        assert sorted(_parts(actions)) == sorted((p, i) for p in "FIW" for i in range(microbatches))
        # Input gradients in micro-batch order on every stage: gradients are
        # summed in the same order by every schedule.
        assert [a.microbatch for a in actions if a.kind.input_gradient] == list(range(microbatches))
        assert [a for _, a in timeline[stage]] == lower(schedule)[stage]  # (what the executor runs)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_activation_memory_bound(stages, microbatches):
    for s, actions in enumerate(one_f_one_b(stages, microbatches)):
        assert max_in_flight(actions) == min(stages - s, microbatches)
    for s, actions in enumerate(zero_bubble_h1(stages, microbatches)):
        assert max_in_flight(actions) == min(stages - s, microbatches)
    for s, actions in enumerate(gpipe(stages, microbatches)):
        assert max_in_flight(actions) == (1 if s == stages - 1 else microbatches)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (3, 3)])
def test_both_classic_schedules_take_the_ideal_time(stages, microbatches):
    # With unit-time forwards and backwards (the last stage's fused pair
    # taking two), both finish in 2 * (m + P - 1) ticks: the bubble is
    # (P - 1) / (m + P - 1) of the time.
    durations = {FORWARD: 1, BACKWARD: 1, FORWARD_BACKWARD: 2}
    for name in ("1f1b", "gpipe"):
        assert makespan(make_schedule(name, stages, microbatches), durations) == 2 * (microbatches + stages - 1)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (2, 8), (4, 8)])
def test_a_split_backward_shrinks_the_bubble(stages, microbatches):
    # F, I and W one tick each: splitting B = I + W and running W last lets
    # the later stages' W fill the cool-down.
    # 1F1B's memory bound may force a W per micro-batch: never slower than
    # the classic; holding the batch for one W (hold_for) is faster.
    classic = makespan(one_f_one_b(stages, microbatches), DURATIONS)
    for name in SCHEDULES:
        assert makespan(make_schedule(name, stages, microbatches, True), DURATIONS) <= classic
    everything = {s: Holding(limit=microbatches) for s in range(stages)}
    assert makespan(one_f_one_b(stages, microbatches, True, everything), DURATIONS) < classic


def test_forward_only():
    assert [format_actions(a) for a in forward_only(2, 2)] == ["F0 F1", "F0 F1"]
    simulate(forward_only(3, 5))


def test_a_deadlocking_schedule_is_shown():
    bad = [[act(FORWARD, 0), act(BACKWARD, 0)], [act(FORWARD_BACKWARD, 0)], [act(BACKWARD, 0), act(FORWARD, 0)]]
    with pytest.raises(PipelineConfigError, match="<-- STUCK HERE"):
        simulate(bad)


def test_a_weight_pass_before_its_input_gradient_deadlocks():
    bad = [
        [act(FORWARD, 0), act(BACKWARD_WEIGHT, 0), act(BACKWARD_INPUT, 0)],
        [act(FORWARD_INPUT, 0), act(BACKWARD_WEIGHT, 0)],
    ]
    with pytest.raises(PipelineConfigError, match=r"stage 0: F0 SEND_F0 W0 <-- STUCK HERE RECV_B0 I0"):
        simulate(bad)


def test_a_schedule_that_skips_a_weight_pass_is_refused():
    incomplete = [[act(FORWARD, 0), act(BACKWARD_INPUT, 0)], [act(FORWARD_BACKWARD, 0)]]
    with pytest.raises(PipelineConfigError, match="stage 0 does not run each micro-batch's W once"):
        simulate(incomplete)


def test_format_schedule_marks_the_failing_action():
    text = format_schedule(one_f_one_b(2, 2), {0: 2})
    assert text.splitlines()[0] == "stage 0: F0 F1 B0 <-- ERROR HERE B1"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_microbatch_counts_are_refused(bad):
    with pytest.raises(PipelineConfigError, match="num_microbatches"):
        one_f_one_b(2, bad)


def test_unknown_schedule():
    with pytest.raises(PipelineConfigError, match="'1f1b', 'gpipe', 'zb-h1'"):
        make_schedule("zigzag", 2, 2)


def test_the_docstring_examples():
    import doctest

    import keras_pipe.schedules
    from keras_pipe.schedules import actions, lowering, one_chunk, schedule, simulator

    for module in (keras_pipe.schedules, actions, lowering, one_chunk, schedule, simulator):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_the_registry_answers_for_every_name_and_auto():
    """Every question the engine and the model ask of a schedule name, answered by schedules/schedule.py's registry
    (``"auto"`` too: one stage a rank until it picks), as the names were compared before the registry."""
    from keras_pipe.schedules import schedule

    assert schedule.SCHEDULES == ("1f1b", "gpipe", "zb-h1")
    assert schedule.CHUNKED_SCHEDULES == ("interleaved-1f1b", "zb-v")
    assert [name for name in schedule.REGISTRY if schedule.needs_split_backward(name)] == ["zb-h1", "zb-v"]
    assert [name for name in schedule.REGISTRY if schedule.needs_whole_rounds(name)] == ["interleaved-1f1b"]
    assert {name: schedule.default_chunks(name) for name in (*schedule.REGISTRY, "auto")} == {
        "1f1b": 1,
        "gpipe": 1,
        "zb-h1": 1,
        "interleaved-1f1b": 2,
        "zb-v": 2,
        "auto": 1,
    }
    assert schedule.placement("auto", 3) == [[0], [1], [2]]
    assert schedule.placement("zb-v", 2, 2) == [[0, 3], [1, 2]]
    assert schedule.placement("interleaved-1f1b", 2, 3) == [[0, 2, 4], [1, 3, 5]]
    assert not schedule.needs_split_backward("auto") and not schedule.needs_whole_rounds("auto")
    assert schedule.is_auto("auto") and not schedule.is_auto("1f1b")
    with pytest.raises(PipelineConfigError, match="'zb-v' runs two chunks a rank"):
        schedule.check_chunks("zb-v", 3)
    with pytest.raises(PipelineConfigError, match="'interleaved-1f1b' needs num_chunks of 2 or more"):
        schedule.check_chunks("interleaved-1f1b", 1)
    with pytest.raises(PipelineConfigError, match="'auto' runs one chunk a rank"):
        schedule.check_chunks("auto", 2)
    with pytest.raises(PipelineConfigError, match="not known"):
        schedule.kind_of("auto")
