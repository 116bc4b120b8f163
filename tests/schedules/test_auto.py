"""schedule="auto" (schedules/auto.py): which steps time which candidate, and one pick from every rank's times."""

import doctest

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules import auto, schedule
from keras_pipe.schedules.auto import CANDIDATES, SchedulePicker, simulated_bubble


def _run(picker, seconds_of):
    """Feeds the picker the duration ``seconds_of(name, k)`` of each step until it is done timing."""
    count = {name: 0 for name in picker.candidates}
    names = []
    while picker.steps_left():
        name = picker.candidate()
        names.append(name)
        done = picker.record(seconds_of(name, count[name]))
        count[name] += 1
        if done:
            return names
    return names


def test_the_docstring_example():
    assert doctest.testmod(auto).failed == 0


def test_the_candidates_alternate_warm_up_first_then_timed():
    picker = SchedulePicker(num_stages=4, num_microbatches=8)
    names = _run(picker, lambda name, k: 1.0)
    assert names == list(CANDIDATES) * (auto.WARMUP_ROUNDS + auto.TIMED_ROUNDS)
    assert all(len(times) == auto.TIMED_ROUNDS for times in picker.times.values())  # warm-up steps not counted
    assert picker.current() == "1f1b"  # not decided until every rank's times are in


def test_each_step_counts_its_slowest_rank_and_each_candidate_its_median_step():
    # Rank 1 is slow on ZB-H1's second step (descheduled, say): the median ZB-H1 step is still 3.
    ranks = [{"1f1b": [5.0, 4.0, 6.0], "zb-h1": [3.0, 3.0, 3.0]}, {"1f1b": [4.5, 4.5, 4.5], "zb-h1": [3.0, 8.0, 2.0]}]
    picker = SchedulePicker(num_stages=2, num_microbatches=4)
    assert picker.decide(ranks) == "zb-h1"
    assert picker.typical == {"1f1b": 5.0, "zb-h1": 3.0}
    assert picker.current() == "zb-h1" and picker.steps_left() == 0 and not picker.record(1.0)


def test_a_tie_keeps_1f1b_and_every_rank_picks_alike_from_the_same_times():
    ranks = [{"1f1b": [2.0, 2.0, 2.0], "zb-h1": [2.0, 2.0, 2.0]}] * 3
    picks = {SchedulePicker(3, 6).decide(ranks) for _ in range(3)}
    assert picks == {"1f1b"}


def test_the_faster_candidate_wins_on_measured_steps():
    picker = SchedulePicker(num_stages=2, num_microbatches=4)
    _run(picker, lambda name, k: {"1f1b": 0.010, "zb-h1": 0.012}[name] + (0.5 if k == 0 else 0))
    assert picker.decide([picker.times]) == "1f1b"
    assert picker.describe() == (
        "auto: 1f1b (median step 10.0 ms against zb-h1 12.0 ms; simulated bubble "
        f"{100 * simulated_bubble('1f1b', 2, 4):.1f}%)"
    )


def test_one_stage_has_nothing_to_pick():
    picker = SchedulePicker(num_stages=1, num_microbatches=4)
    assert picker.picked == "1f1b" and picker.steps_left() == 0 and not picker.record(1.0)
    assert picker.describe() == "auto: 1f1b (one stage; simulated bubble 0.0%)"


def test_before_the_pick_the_summary_says_what_the_first_training_step_times():
    picker = SchedulePicker(num_stages=2, num_microbatches=4)
    picker.record(1.0)
    assert picker.describe() == "auto: not picked yet (the first training step times 1f1b and zb-h1)"


def test_a_schedule_left_out_is_said_with_its_reason_and_never_timed():
    picker = SchedulePicker(num_stages=2, num_microbatches=4, candidates=("1f1b", "zb-h1", "zb-v"), warmup=0, timed=1)
    picker.drop("zb-v", "balance or split_before give one stage a rank")
    assert picker.candidates == ("1f1b", "zb-h1") and picker.schedules() == ("1f1b", "zb-h1")
    assert picker.steps_left() == 2 and "zb-v" not in picker.times
    picker.record(0.002)
    assert picker.record(0.001)
    assert picker.decide([picker.times]) == "zb-h1"
    assert picker.describe().endswith("; zb-v not timed: balance or split_before give one stage a rank)")


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 12)])
def test_the_simulated_bubble_is_zb_h1s_smaller_and_1f1bs_the_textbook_one(p, m):
    assert simulated_bubble("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert simulated_bubble("zb-h1", p, m) < simulated_bubble("1f1b", p, m)
    assert 0 <= simulated_bubble("zb-h1", p, m) < 1


def test_auto_is_a_schedule_option_not_a_plan():
    schedule.check_name("auto")
    with pytest.raises(PipelineConfigError, match="'zb-h1', 'interleaved-1f1b', 'zb-v', 'auto'"):
        schedule.check_name("zigzag")
    with pytest.raises(PipelineConfigError, match="use one of '1f1b', 'gpipe', 'zb-h1'"):
        schedule.make_schedule("auto", 2, 4)


def test_with_several_numbers_of_micro_batches_every_pair_is_timed_and_the_pick_names_both():
    counts = auto.microbatch_candidates(2)
    assert counts == (2, 4, 8)
    picker = SchedulePicker(num_stages=2, num_microbatches=None, microbatch_counts=counts)
    assert picker.candidates == tuple(f"{name} m={m}" for name in CANDIDATES for m in counts)
    seen = []
    # wider micro-batches are cheaper per row, up to m=4 where the bubble starts to cost more: 1F1B at m=4 wins
    step = {("1f1b", 2): 0.030, ("1f1b", 4): 0.020, ("1f1b", 8): 0.025, ("zb-h1", 2): 0.031}

    def seconds(name, k):
        seen.append((picker.current(), picker.microbatches()))
        return step.get(seen[-1], 0.040)

    _run(picker, seconds)
    assert seen[: len(picker.candidates)] == [(n, m) for n in CANDIDATES for m in counts]
    assert picker.decide([picker.times]) == "1f1b m=4"
    assert (picker.current(), picker.microbatches()) == ("1f1b", 4)
    assert picker.describe().startswith("auto: 1f1b m=4 (median step 20.0 ms against 1f1b m=2 30.0 ms, ")
    assert picker.describe().endswith(f"simulated bubble {100 * simulated_bubble('1f1b', 2, 4):.1f}%)")


def test_a_fixed_schedule_with_auto_micro_batches_times_its_numbers_alone():
    picker = SchedulePicker(num_stages=4, num_microbatches=None, candidates=("zb-v",), microbatch_counts=(4, 8, 16))
    assert picker.candidates == ("zb-v m=4", "zb-v m=8", "zb-v m=16")
    assert picker.describe() == (
        "auto: not picked yet (the first training step times zb-v m=4, zb-v m=8 and zb-v m=16)"
    )
    assert SchedulePicker(1, None, microbatch_counts=auto.microbatch_candidates(1)).microbatches() == 1
