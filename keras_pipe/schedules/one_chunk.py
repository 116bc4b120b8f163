"""GPipe, 1F1B and forwards only: the schedules of one chunk a rank that the others build on."""

from __future__ import annotations

from keras_pipe.schedules.actions import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    FORWARD_HEAD,
    Action,
    Holding,
    Kind,
    _check,
    _holdings,
    _last_forwards,
    _split,
    act,
    max_in_flight,
)


def gpipe(
    num_stages: int,
    num_microbatches: int,
    split_backward: bool = False,
    whole_batch_loss: bool = False,
    hold: dict | None = None,
) -> list[list[Action]]:
    """All forwards, then all backwards (GPipe).

    Every stage but the last keeps the activations of all ``m``
    micro-batches alive; the last one runs each backward with its forward,
    unless ``whole_batch_loss``: then it too runs all its forwards first
    (``FH``: each sums its terms and counts their divisors), because its
    loss needs the whole batch before any backward (the mean of a masked
    output is over the batch's unmasked entries, counted only by the
    forwards).

    ```
    # GPipe, 3 stages, 4 micro-batches:
    # stage 0: F0 F1 F2 F3 .. .. .. .. .. .. B0 B1 B2 B3
    # stage 1:    F0 F1 F2 F3 .. .. B0 B1 B2 B3
    # stage 2:       FB0 FB1 FB2 FB3
    # with split_backward=True the Bs become Is (FBs FIs) and each stage ends with W0-3:
    # GPipe holds every micro-batch anyway, so its W is always one pass over the batch.
    ```

    Example:

    >>> [str(a) for a in gpipe(2, 2)[0]]
    ['F0', 'F1', 'B0', 'B1']
    >>> [str(a) for a in gpipe(2, 2, split_backward=True)[1]]
    ['FI0', 'FI1', 'W0-1']
    >>> [str(a) for a in gpipe(2, 2, whole_batch_loss=True)[1]]
    ['FH0', 'FH1', 'B0', 'B1']
    """
    _check(num_stages, num_microbatches)
    m = num_microbatches
    stage = [act(FORWARD, i) for i in range(m)] + [act(BACKWARD, i) for i in range(m)]
    last = list(stage) if whole_batch_loss else [act(FORWARD_BACKWARD, i) for i in range(m)]
    plan = [list(stage) for _ in range(num_stages - 1)] + [last]
    # (holding every micro-batch for one W, whatever it costs: GPipe's memory for its speed)
    hold = {s: Holding(None, (hold or {}).get(s, Holding()).cost) for s in range(num_stages)}
    plan = _split(plan, split_backward, _holdings(hold, [m * max(h.cost, 1.0) for h in hold.values()]))
    return plan[:-1] + [_last_forwards(plan[-1], FORWARD_HEAD)] if whole_batch_loss else plan


def one_f_one_b(
    num_stages: int, num_microbatches: int, split_backward: bool = False, hold: dict | None = None
) -> list[list[Action]]:
    """One forward, one backward (PipeDream-Flush / 1F1B).

    Stage ``s`` runs ``P - s - 1`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards. It keeps
    at most ``P - s`` micro-batches of activations alive instead of ``m``.

    With ``split_backward``, a stage's ``W`` runs over the micro-batches it
    holds whenever holding more would pass that bound (or the larger limit
    of ``hold[s]``, a :class:`Holding`): what a stage holds stays 1F1B's.

    ```
    # 1F1B, 3 stages, 4 micro-batches (F = forward, B = backward):
    # stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    # stage 1:    F0 F1 B0 F2 B1 F3 B2 B3
    # stage 2:       FB0 FB1 FB2 FB3
    ```

    Example:

    >>> [str(a) for a in one_f_one_b(3, 4)[0]]
    ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    >>> [str(a) for a in one_f_one_b(2, 3, split_backward=True)[0]]
    ['F0', 'F1', 'I0', 'W0', 'F2', 'I1', 'I2', 'W1-2']
    >>> [str(a) for a in one_f_one_b(2, 3, split_backward=True, hold={0: Holding(limit=3)})[0]]
    ['F0', 'F1', 'I0', 'F2', 'I1', 'I2', 'W0-2']
    """
    _check(num_stages, num_microbatches)
    schedule = []
    for s in range(num_stages - 1):
        schedule.append(_one_f_one_b_stage(num_stages, s, num_microbatches, BACKWARD))
    schedule.append([act(FORWARD_BACKWARD, i) for i in range(num_microbatches)])
    return _split(schedule, split_backward, _holdings(hold, [max_in_flight(actions) for actions in schedule]))


def forward_only(num_stages: int, num_microbatches: int, last: Kind = FORWARD) -> list[list[Action]]:
    """Forwards only, in order: the schedule of ``evaluate`` and ``predict``.

    ``last``: what the last stage runs: ``FORWARD`` (``predict``: its outputs
    are the predictions), ``FORWARD_LOSS`` (``evaluate``: the loss too) or
    ``FORWARD_HEAD`` (``evaluate`` of a loss over the whole batch).

    >>> [[str(a) for a in actions] for actions in forward_only(2, 2, Kind.FORWARD_LOSS)]
    [['F0', 'F1'], ['FL0', 'FL1']]
    """
    _check(num_stages, num_microbatches)
    plan = [[act(FORWARD, i) for i in range(num_microbatches)] for _ in range(num_stages)]
    return plan[:-1] + [_last_forwards(plan[-1], last)]


def _one_f_one_b_stage(num_stages: int, s: int, m: int, backward: Kind) -> list[Action]:
    warmup = min(num_stages - s - 1, m)
    actions = [act(FORWARD, i) for i in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < m:
        if next_forward < m:
            actions.append(act(FORWARD, next_forward))
            next_forward += 1
        actions.append(act(backward, next_backward))
        next_backward += 1
    return actions
