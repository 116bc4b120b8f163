"""Zero-bubble schedules (Qi et al., 2024), found by running the pipeline on the simulator's clock.

The backward is split into ``I`` (the input gradient the previous stage
waits for) and ``W`` (the weight gradients, which nobody waits for), and
each ``W`` is placed where its rank would otherwise wait. The order is found
by list scheduling: on a clock where a chunk's ``F``, ``I`` and ``W`` take
one tick each (the paper's assumption), each rank, whenever it is free, runs
the first of

1. an ``I`` whose gradient has arrived (the deeper chunk first),
2. a forward whose input has arrived, while the rank holds fewer
   micro-batches in flight (from ``F`` to ``I``) and in all (from ``F`` to
   ``W``) than its bounds,
3. its oldest pending ``W``.

Back-to-back ``W`` of one chunk then run as one ``W`` over their
micro-batches (what is proportional to the weights is paid once).

Each chunk runs its forwards, ``I`` and ``W`` in micro-batch order (weight
gradients are summed in that order, as by every schedule). The order found
is valid whatever the real durations: it is one that ran, and each rank's
next action waits only for what came before it on other ranks.

- :func:`zero_bubble_h1`: one chunk a rank, 1F1B's ``P - s`` micro-batches
  in flight on stage ``s``, and at most ``P`` held in all (1F1B's peak, that
  of its first stage): the later stages may hold their ``W`` back;
- :func:`zero_bubble_v`: two chunks a rank in a V
  (:func:`keras_pipe.schedules.virtual.v_placement`), at most ``2P`` chunk-sized
  micro-batches held: the ``P`` whole-stage ones 1F1B's first rank holds.
"""

from __future__ import annotations

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules.actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_INPUT,
    Action,
    _check,
    act,
)
from keras_pipe.schedules.virtual import v_placement


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's peak memory, each ``W`` where its stage would wait.

    Stage ``s`` holds at most ``P - s`` micro-batches between ``F`` and
    ``I``, as 1F1B, and at most ``P`` between ``F`` and ``W`` (1F1B's peak,
    on its first stage): each stage's ``W`` fill the warm-up and cool-down,
    where 1F1B waits for gradients, and the later stages hold theirs back so
    that their ``I`` go upstream sooner. On the simulator's clock with ``F``,
    ``I`` and ``W`` of one tick each, ``3m + P - 1`` ticks against 1F1B's
    ``3 (m + P - 1)`` on two stages.

    ```
    # ZB-H1, 3 stages, 4 micro-batches:
    # stage 0: F0 F1 F2 I0 W0 I1 F3 I2 W1-2 I3 W3
    # stage 1:    F0 F1 I0 F2 I1 W0 I2 F3 W1-2 I3 W3
    # stage 2:       FI0 FI1 FI2 W0-1 FI3 W2-3
    ```

    >>> [str(a) for a in zero_bubble_h1(2, 3)[1]]
    ['FI0', 'FI1', 'W0-1', 'FI2', 'W2']
    """
    _check(num_stages, num_microbatches)
    p = num_stages
    in_flight = [p - s for s in range(p)]
    return _list_schedule([[s] for s in range(p)], num_microbatches, in_flight, [p] * p)


def zero_bubble_v(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-V over :func:`~keras_pipe.schedules.virtual.v_placement`: each rank's actions.

    Rank ``r`` holds virtual stages ``r`` and ``2P - 1 - r``: the first rank
    holds the first and the last (the loss), and every rank at most ``2P``
    chunk-sized micro-batches from ``F`` to ``W``.

    ```
    # ZB-V, 2 ranks, 4 micro-batches ("@1": chunk 1, the V's way back; rank 0 computes the loss):
    # rank 0: F0 F1 F2 FI0@1 W0@1 FI1@1 I0 W1@1 I1 F3 W0 FI2@1 W1 W2@1 I2 W2 FI3@1 W3@1 I3 W3
    # rank 1: F0 F0@1 F1 F1@1 I0@1 I0 W0@1 I1@1 I1 F2 W0 F2@1 W1@1 F3 I2@1 I2 W1 F3@1 W2@1 W2 I3@1 I3 W3@1 W3
    ```

    >>> [str(a) for a in zero_bubble_v(1, 2)[0]]
    ['F0', 'FI0@1', 'I0', 'W0@1', 'F1', 'W0', 'FI1@1', 'I1', 'W1@1', 'W1']
    """
    _check(num_ranks, num_microbatches)
    p = num_ranks
    return _list_schedule(v_placement(p), num_microbatches, [2 * p] * p, [2 * p] * p)


def _list_schedule(placement: list, m: int, in_flight_bound: list, held_bound: list) -> list[list[Action]]:
    """Each rank's actions, found on a unit clock by the priorities of the module's docstring."""
    p = len(placement)
    last = sum(map(len, placement)) - 1
    done: dict[tuple, int] = {}  # (virtual stage, "F"/"I", micro-batch) -> end tick
    next_f = [[0] * len(chunks) for chunks in placement]
    next_i = [[0] * len(chunks) for chunks in placement]
    pending_w: list[list] = [[] for _ in range(p)]  # (chunk, micro-batch), in the order their I ran
    in_flight, held, free_at = [0] * p, [0] * p, [0] * p
    schedule: list[list[Action]] = [[] for _ in range(p)]
    tick, remaining = 0, sum(3 * m * len(chunks) for chunks in placement)
    deeper_first = [sorted(range(len(chunks)), key=lambda c, chunks=chunks: -chunks[c]) for chunks in placement]

    def arrived(key) -> bool:
        return done.get(key, tick + 1) <= tick

    def choose(r):
        for c in deeper_first[r]:  # an I whose gradient arrived (the last stage's I is in its FI)
            k, i = placement[r][c], next_i[r][c]
            if k != last and i < next_f[r][c] and arrived((k + 1, "I", i)):
                return BACKWARD_INPUT, c, i
        if in_flight[r] < in_flight_bound[r] and held[r] < held_bound[r]:
            for c in deeper_first[r]:  # a forward whose input arrived
                k, i = placement[r][c], next_f[r][c]
                if i < m and (k == 0 or arrived((k - 1, "F", i))):
                    return (FORWARD_INPUT if k == last else FORWARD), c, i
        if pending_w[r]:
            return (BACKWARD_WEIGHT, *pending_w[r].pop(0))
        return None

    while remaining:
        progressed = False
        for r in range(p):
            chosen = choose(r) if free_at[r] <= tick else None
            if chosen is None:
                continue
            kind, c, i = chosen
            k, ticks = placement[r][c], 2 if kind is FORWARD_INPUT else 1
            schedule[r].append(act(kind, i, chunk=c))
            free_at[r], remaining, progressed = tick + ticks, remaining - ticks, True
            if kind.forwards:
                next_f[r][c] += 1
                in_flight[r] += kind is FORWARD
                held[r] += 1
                done[(k, "F", i)] = tick + ticks
            if kind.input_gradient:
                next_i[r][c] += 1
                in_flight[r] -= kind is BACKWARD_INPUT
                done[(k, "I", i)] = tick + ticks
                pending_w[r].append((c, i))
            held[r] -= kind is BACKWARD_WEIGHT
        if remaining and not progressed and all(t <= tick for t in free_at):  # (a bug: shown if it happens)
            raise PipelineConfigError(f"no rank can run an action at tick {tick} (m={m}, placement {placement})")
        tick += 1
    return [_merge_weights(actions) for actions in schedule]


def _merge_weights(actions: list[Action]) -> list[Action]:
    """Back-to-back ``W`` of one chunk run as one (the work proportional to the weights paid once)."""
    merged: list[Action] = []
    for action in actions:
        previous = merged[-1] if merged else None
        if (
            action.kind is BACKWARD_WEIGHT
            and previous is not None
            and previous.kind is BACKWARD_WEIGHT
            and previous.chunk == action.chunk
        ):
            merged[-1] = Action(BACKWARD_WEIGHT, previous.microbatches + action.microbatches, action.chunk)
        else:
            merged.append(action)
    return merged
