"""Schedules are plain data: checked in one process, without MPI."""

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedule import (
    BACKWARD,
    FORWARD,
    Action,
    format_actions,
    forward_only,
    gpipe,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    simulate,
)


def test_one_f_one_b_matches_the_diagram():
    schedule = one_f_one_b(3, 4)
    assert [format_actions(a) for a in schedule] == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_gpipe_runs_all_forwards_then_backwards_in_order():
    assert format_actions(gpipe(3, 3)[1]) == "F0 F1 F2 B0 B1 B2"
    # The last stage needs no other rank for a backward: it runs right after the forward.
    assert format_actions(gpipe(3, 3)[2]) == "F0 B0 F1 B1 F2 B2"


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8, 13])
def test_every_schedule_completes_without_deadlock(name, stages, microbatches):
    schedule = make_schedule(name, stages, microbatches)
    timeline = simulate(schedule)
    for stage, actions in enumerate(schedule):
        assert sorted((a.kind, a.microbatch) for a in actions) == sorted(
            [(FORWARD, i) for i in range(microbatches)] + [(BACKWARD, i) for i in range(microbatches)]
        )
        # Backwards in micro-batch order on every stage: gradients are summed
        # in the same order by both schedules.
        assert [a.microbatch for a in actions if a.kind == BACKWARD] == list(range(microbatches))
        assert len(timeline[stage]) == len(actions)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_activation_memory_bound(stages, microbatches):
    for s, actions in enumerate(one_f_one_b(stages, microbatches)):
        assert max_in_flight(actions) == min(stages - s, microbatches)
    for s, actions in enumerate(gpipe(stages, microbatches)):
        assert max_in_flight(actions) == (1 if s == stages - 1 else microbatches)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (3, 3)])
def test_both_schedules_take_the_ideal_time(stages, microbatches):
    # With unit-time actions, both finish in 2 * (m + P - 1) ticks: the bubble
    # is (P - 1) / (m + P - 1) of the time.
    for name in ("1f1b", "gpipe"):
        timeline = simulate(make_schedule(name, stages, microbatches))
        end = max(tick for stage in timeline for tick, _ in stage) + 1
        assert end == 2 * (microbatches + stages - 1)


def test_forward_only():
    assert [format_actions(a) for a in forward_only(2, 2)] == ["F0 F1", "F0 F1"]
    simulate(forward_only(3, 5))


def test_a_deadlocking_schedule_is_shown():
    bad = [[Action(FORWARD, 0), Action(BACKWARD, 0)], [Action(BACKWARD, 0), Action(FORWARD, 0)]]
    with pytest.raises(PipelineConfigError, match="<-- STUCK HERE"):
        simulate(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_microbatch_counts_are_refused(bad):
    with pytest.raises(PipelineConfigError, match="num_microbatches"):
        one_f_one_b(2, bad)


def test_unknown_schedule():
    with pytest.raises(PipelineConfigError, match="'1f1b', 'gpipe'"):
        make_schedule("zigzag", 2, 2)
