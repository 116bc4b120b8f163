"""A schedule's messages as actions of its own: the lowered lists, run on the simulator as the executor runs them."""

import random

import pytest

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules import (
    BACKWARD,
    CHUNKED_SCHEDULES,
    FORWARD,
    FORWARD_HEAD,
    FORWARD_LOSS,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEED,
    SEND_B,
    SEND_F,
    act,
    computing,
    format_actions,
    forward_only,
    gpipe,
    lower,
    make_schedule,
    one_f_one_b,
    placement,
    simulate,
    zero_bubble_v,
)
from keras_pipe.schedules.simulator import durations_of
from keras_pipe.schedules.virtual import chunked_forward_only, chunked_gpipe, v_placement, whole_rounds


def test_one_f_one_b_lowered():
    # a receive right before the action that reads it, a send right after the one that computed it
    assert [format_actions(a) for a in lower(one_f_one_b(2, 4))] == [
        "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 F3 SEND_F3 RECV_B2 B2 RECV_B3 B3",
        "RECV_F0 FB0 SEND_B0 RECV_F1 FB1 SEND_B1 RECV_F2 FB2 SEND_B2 RECV_F3 FB3 SEND_B3",
    ]
    # what it computes is the schedule; lowering twice changes nothing
    assert [computing(a) for a in lower(one_f_one_b(3, 5))] == one_f_one_b(3, 5)
    assert lower(lower(one_f_one_b(3, 5))) == lower(one_f_one_b(3, 5))


def test_zero_bubble_v_lowered():
    # rank 0 holds virtual stages 0 and 3: chunk 0 receives nothing, chunk 1 (the loss) sends no activations
    lowered = lower(zero_bubble_v(2, 2), v_placement(2))
    assert [format_actions(a) for a in lowered] == [
        "F0 SEND_F0 F1 SEND_F1 RECV_F0@1 FI0@1 SEND_B0@1 RECV_F1@1 FI1@1 SEND_B1@1 RECV_B0 I0 W0@1 RECV_B1 I1 "
        "W1@1 W0-1",
        "RECV_F0 F0 SEND_F0 RECV_F0@1 F0@1 SEND_F0@1 RECV_F1 F1 SEND_F1 RECV_F1@1 F1@1 SEND_F1@1 "
        "RECV_B0@1 I0@1 SEND_B0@1 RECV_B0 I0 SEND_B0 RECV_B1@1 I1@1 SEND_B1@1 RECV_B1 I1 SEND_B1 W0@1 W0 W1@1 W1",
    ]


def test_the_last_stages_own_forwards_and_seeds():
    # evaluation: the loss in the last stage's forward; a loss over the whole batch: its forwards
    # count the divisors, then each backward is seeded where another stage's would receive
    assert format_actions(lower(forward_only(2, 2, FORWARD_LOSS))[1]) == "RECV_F0 FL0 RECV_F1 FL1"
    assert format_actions(lower(forward_only(2, 2))[1]) == "RECV_F0 F0 RECV_F1 F1"  # (predict)
    assert format_actions(lower(gpipe(2, 2, whole_batch_loss=True))[1]) == (
        "RECV_F0 FH0 RECV_F1 FH1 SEED0 B0 SEND_B0 SEED1 B1 SEND_B1"
    )
    assert format_actions(lower(gpipe(1, 2, True, whole_batch_loss=True))[0]) == "FH0 FH1 SEED0 I0 SEED1 I1 W0-1"


def _random_durations(seed):
    rng = random.Random(seed)
    durations = durations_of(*(rng.uniform(0.2, 3.0) for _ in range(3)))
    durations.update({kind: rng.uniform(0.0, 0.5) for kind in (SEND_F, RECV_F, SEND_B, RECV_B)})
    return durations


def plans(name: str, ranks: int, m: int, chunks: int, split: bool):
    """What a pipeline of ``ranks`` may run for a batch of ``m`` micro-batches under ``name``: (phase, schedule)."""
    where = placement(name, ranks, chunks)
    if chunks == 1:
        yield "train", make_schedule(name, ranks, m, split)
        yield "train, whole-batch loss", gpipe(ranks, m, split, whole_batch_loss=True)
        for last in (FORWARD, FORWARD_LOSS, FORWARD_HEAD):
            yield f"forwards ({last.value})", forward_only(ranks, m, last)
        return
    if name == "zb-v" or whole_rounds(ranks, m):
        yield "train", make_schedule(name, ranks, m, split, num_chunks=chunks)
    else:
        yield "train, a short batch", chunked_gpipe(where, m, split)
    yield "train, whole-batch loss", chunked_gpipe(where, m, split, whole_batch_loss=True)
    for last in (FORWARD, FORWARD_LOSS, FORWARD_HEAD):
        yield f"forwards ({last.value})", chunked_forward_only(where, m, last)


GRID = [
    (name, ranks, m, chunks)
    for name in SCHEDULES + CHUNKED_SCHEDULES
    for ranks in (1, 2, 3, 4, 5)
    for m in range(1, 9)
    for chunks in ((1,) if name in SCHEDULES else (2, 3) if name == "interleaved-1f1b" else (2,))
]


@pytest.mark.parametrize("name, ranks, m, chunks", GRID)
def test_every_lowered_schedule_matches_its_messages(name, ranks, m, chunks):
    # Every schedule, P, m and v, in every phase, with and without a split backward: each receive
    # takes the message its peer sent for that micro-batch (in the order sent), nothing is left
    # unreceived, no deadlock, every part once. (Replicas run these same lists, a pipeline each.)
    where = placement(name, ranks, chunks)
    for split in (False, True):
        for phase, schedule in plans(name, ranks, m, chunks, split):
            lowered = lower(schedule, where)
            assert [computing(actions) for actions in lowered] == schedule, phase
            sends = sum(a.kind in (SEND_F, SEND_B) for actions in lowered for a in actions)
            receives = sum(a.kind in (RECV_F, RECV_B) for actions in lowered for a in actions)
            assert sends == receives, phase
            for seed in range(2):
                timeline = simulate(lowered, _random_durations(seed), where)
                assert [[a for _, a in row] for row in timeline] == lowered, phase


def test_a_receive_that_would_take_another_microbatchs_message_is_refused():
    bad = [
        [act(FORWARD, 0), act(SEND_F, 0), act(FORWARD, 1), act(SEND_F, 1)],
        [act(RECV_F, 1), act(FORWARD, 1), act(RECV_F, 0), act(FORWARD, 0)],
    ]
    with pytest.raises(
        PipelineConfigError, match=r"\(RECV_F1\) on virtual stage 1 would receive the activations of micro-batch 0"
    ):
        simulate(bad)


def test_a_message_never_received_is_refused():
    bad = [[act(FORWARD, 0), act(SEND_F, 0), act(FORWARD, 1), act(SEND_F, 1)], [act(RECV_F, 0), act(FORWARD, 0)]]
    with pytest.raises(PipelineConfigError, match=r"micro-batches \[1\] to virtual stage 1, which never receives"):
        simulate(bad)


def test_a_send_of_what_was_not_computed_is_refused():
    bad = [[act(SEND_F, 0), act(FORWARD, 0)], [act(RECV_F, 0), act(FORWARD, 0)]]
    with pytest.raises(PipelineConfigError, match="sends what it has not computed"):
        simulate(bad)


def test_a_forward_before_its_receive_deadlocks():
    bad = [[act(FORWARD, 0), act(SEND_F, 0)], [act(FORWARD, 0), act(RECV_F, 0)]]
    with pytest.raises(PipelineConfigError, match=r"stage 1: F0 <-- STUCK HERE RECV_F0"):
        simulate(bad)


def test_a_seed_waits_for_every_forward():
    bad = [[act(FORWARD_HEAD, 0), act(SEED, 0), act(BACKWARD, 0), act(FORWARD_HEAD, 1)]]
    with pytest.raises(PipelineConfigError, match="SEED0 <-- STUCK HERE"):
        simulate(bad)
