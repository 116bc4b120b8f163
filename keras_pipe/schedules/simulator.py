"""Schedules run on an ideal clock: the deadlock check, completeness, and the time a schedule takes.

Plain data in, plain data out: :func:`simulate` walks every stage's actions
(:mod:`keras_pipe.schedules.schedule`) at once, each starting when its stage is free
and its inputs have arrived, and raises, showing the stuck actions, where a
schedule would deadlock or skip a pass. Tested without MPI in
``tests/schedules/test_schedule.py``.

>>> from keras_pipe.schedules import one_f_one_b
>>> makespan(one_f_one_b(2, 4), {FORWARD: 1, BACKWARD: 1, FORWARD_BACKWARD: 2})
10
"""

from __future__ import annotations

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_BACKWARD,
    FORWARD_HEAD,
    FORWARD_INPUT,
    FORWARD_LOSS,
    RECV_B,
    RECV_F,
    SEED,
    SEND_B,
    SEND_F,
    Action,
    Kind,
    format_actions,
)
from keras_pipe.schedules.lowering import lower


def durations_of(forward: float, input_gradient: float, weight_gradient: float) -> dict:
    """Each kind's duration from those of F, I and W (a fused action takes the sum of its parts).

    >>> durations_of(1, 2, 3)[FORWARD_BACKWARD]
    6
    """
    return {
        FORWARD: forward,
        BACKWARD_INPUT: input_gradient,
        BACKWARD_WEIGHT: weight_gradient,
        BACKWARD: input_gradient + weight_gradient,
        FORWARD_INPUT: forward + input_gradient,
        FORWARD_BACKWARD: forward + input_gradient + weight_gradient,
    }


# Relative duration of each kind on the simulator's clock: a forward, an
# input gradient and a weight gradient each cost about one matrix product per
# layer.
DURATIONS = durations_of(1, 1, 1)


def simulate(
    schedule: list[list[Action]], durations: dict | None = None, placement: list | None = None
) -> list[list[tuple[int, Action]]]:
    """Runs a schedule's lowered lists on an ideal clock and returns ``(start tick, action)`` per rank.

    The schedule is lowered first (:func:`~keras_pipe.schedules.lowering.lower`:
    its messages added) unless it is: the lists run are those the executor
    runs. Each action takes ``durations[kind]`` ticks per micro-batch (1 for
    a computing kind not given, ``FL`` and ``FH`` a forward's, 0 for a
    message or a seed). A send never blocks; a receive waits until its
    message was sent, and takes the oldest message its sender sent it of
    that kind (each ordered pair of virtual stages keeps its messages in
    order, as MPI does); a computing action starts when its rank is free and
    what it reads is there (its received inputs or output gradients, its own
    forward or input gradient).

    Raises :class:`PipelineConfigError` showing the stuck actions if the
    lists deadlock; naming the action if a receive would take another
    micro-batch's message, a send sends what was not computed, or a message
    is never received; or the stage if it does not run every forward, input
    gradient and weight gradient exactly once.

    ``placement[r][c]``: the virtual stage that chunk ``c`` of rank ``r`` holds
    (:mod:`keras_pipe.schedules.virtual`; by default rank ``r`` holds stage ``r`` alone).
    """
    durations = durations or {}
    placement = placement or [[s] for s in range(len(schedule))]
    schedule = lower(schedule, placement)
    num_virtual = sum(map(len, placement))
    microbatches = 1 + max((i for actions in schedule for a in actions for i in a.microbatches), default=-1)
    done: dict[tuple[int, str, int], float] = {}  # (virtual stage, part, micro-batch) -> end tick
    channels: dict[tuple[int, int, str], list] = {}  # (from, to, "F"/"B") -> [(micro-batch, sent at)], oldest first
    forwards = [0] * num_virtual  # forwards run on each virtual stage (a seed waits for all)
    num_ranks = len(schedule)
    position = [0] * num_ranks
    free_at = [0] * num_ranks
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(num_ranks)]
    while any(position[r] < len(schedule[r]) for r in range(num_ranks)):
        progressed = False
        for r in range(num_ranks):
            while position[r] < len(schedule[r]):  # (a rank runs on until it waits)
                action = schedule[r][position[r]]
                k = placement[r][action.chunk]
                ready = _ready(action, k, num_virtual, microbatches, done, channels, forwards, (r, position[r]))
                if ready is None:
                    break
                start = max([free_at[r], *ready])
                end = start + _ticks(action, durations)
                _complete(action, k, end, done, channels, forwards)
                free_at[r] = end
                timeline[r].append((start, action))
                position[r] += 1
                progressed = True
        if not progressed:
            raise PipelineConfigError("schedule deadlocks:\n" + _show(schedule, position))
    left = {key: [i for i, _ in queue] for key, queue in channels.items() if queue}
    if left:
        (source, destination, what), mbs = next(iter(left.items()))
        raise PipelineConfigError(
            f"virtual stage {source} sends {_WHAT[what]} of micro-batches {mbs} to virtual stage {destination}, "
            "which never receives them"
        )
    _check_complete(schedule, placement)
    return timeline


_WHAT = {"F": "the activations", "B": "the gradients"}


def _ready(action, k, num_virtual, microbatches, done, channels, forwards, where) -> list | None:
    """The ticks ``action`` waits for on virtual stage ``k`` (``None``: it cannot start yet).

    Raises where it never could: a receive that would take another
    micro-batch's message, a send of what the rank has not computed.
    """
    kind = action.kind
    if kind in (RECV_F, RECV_B):
        key = (k - 1, k, "F") if kind is RECV_F else (k + 1, k, "B")
        if key[0] < 0 or key[0] >= num_virtual:
            raise PipelineConfigError(f"rank {where[0]}'s action {where[1]} ({action}): virtual stage {k} has no peer")
        queue = channels.get(key)
        if not queue:
            return None
        if queue[0][0] != action.microbatch:
            raise PipelineConfigError(
                f"rank {where[0]}'s action {where[1]} ({action}) on virtual stage {k} would receive "
                f"{_WHAT[key[2]]} of micro-batch {queue[0][0]}: messages from virtual stage {key[0]} come in the "
                "order they were sent"
            )
        return [queue[0][1]]
    if kind in (SEND_F, SEND_B):
        part = "F" if kind is SEND_F else "I"
        if (k, part, action.microbatch) not in done:
            raise PipelineConfigError(
                f"rank {where[0]}'s action {where[1]} ({action}) on virtual stage {k} sends what it has not computed"
            )
        return [done[(k, part, action.microbatch)]]
    if kind is SEED:  # (the divisors of the whole batch: every forward of the stage counted first)
        return [] if forwards[k] == microbatches else None
    deps = [d for i in action.microbatches for d in _dependencies(k, kind, i)]
    if all(d in done for d in deps):
        return [done[d] for d in deps]
    return None


def _complete(action, k, end, done, channels, forwards) -> None:
    """What ``action`` on virtual stage ``k`` leaves behind once it ends at tick ``end``."""
    kind, i = action.kind, action.microbatch
    if kind is SEND_F:
        channels.setdefault((k, k + 1, "F"), []).append((i, end))
    elif kind is SEND_B:
        channels.setdefault((k, k - 1, "B"), []).append((i, end))
    elif kind in (RECV_F, RECV_B):
        channels[(k - 1, k, "F") if kind is RECV_F else (k + 1, k, "B")].pop(0)
        done[(k, "received " + kind.value[-1], i)] = end
    elif kind is SEED:
        done[(k, "received B", i)] = end
    else:
        forwards[k] += kind.forwards
        for j in action.microbatches:
            for part in _parts(kind):
                done[(k, part, j)] = end


def makespan(schedule: list[list[Action]], durations: dict | None = None, placement: list | None = None) -> int:
    """Ticks from the first action's start to the last one's end, on :func:`simulate`'s clock."""
    durations = durations or {}
    timeline = simulate(schedule, durations, placement)
    return max(start + _ticks(a, durations) for stage in timeline for start, a in stage)


def bubble(schedule: list[list[Action]], durations: dict | None = None, placement: list | None = None) -> float:
    """The share of the ranks' time they wait, on :func:`simulate`'s clock (from the first start to the last end).

    >>> from keras_pipe.schedules import one_f_one_b
    >>> round(bubble(one_f_one_b(2, 4), DURATIONS), 3)  # (P - 1) / (m + P - 1): B takes two ticks, F one
    0.2
    """
    durations = durations or {}
    busy = sum(_ticks(action, durations) for actions in schedule for action in actions)
    return 1 - busy / (makespan(schedule, durations, placement) * len(schedule))


def format_schedule(schedule: list[list[Action]], marks: dict | None = None) -> str:
    """One line per stage; ``marks = {stage: position}`` flags an action with ``<-- ERROR HERE``."""
    return _show(schedule, [(marks or {}).get(s, -1) for s in range(len(schedule))], "<-- ERROR HERE")


def _parts(kind: Kind) -> tuple:
    """What an action completes: its forward ("F"), input gradient ("I") and/or weight gradient ("W")."""
    return tuple(
        part for part, has in (("F", kind.forwards), ("I", kind.input_gradient), ("W", kind.weight_gradient)) if has
    )


def _dependencies(stage: int, kind: Kind, i: int) -> list[tuple[int, str, int]]:
    """What a computing action on ``stage`` reads: its received inputs or output gradients, its own earlier parts."""
    deps = []
    if kind.forwards and stage > 0:
        deps.append((stage, "received F", i))
    if kind.input_gradient and not kind.forwards:
        deps.append((stage, "F", i))
        deps.append((stage, "received B", i))
    if kind is BACKWARD_WEIGHT:
        deps.append((stage, "I", i))
    return deps


def _check_complete(schedule: list[list[Action]], placement: list) -> None:
    microbatches = range(1 + max((a.microbatch for actions in schedule for a in actions), default=-1))
    for s, actions in enumerate(schedule):
        for chunk in range(len(placement[s])):
            _check_chunk(s, chunk, [a for a in actions if a.chunk == chunk], len(microbatches), len(placement[s]) > 1)


def _check_chunk(s: int, chunk: int, actions: list, microbatches: int, several: bool) -> None:
    counts = {part: [0] * microbatches for part in "FIW"}
    for action in actions:
        for i in action.microbatches:
            for part in _parts(action.kind):
                counts[part][i] += 1
    forward_only_stage = not any(counts["I"]) and not any(counts["W"])
    expected = {"F": 1, "I": 0, "W": 0} if forward_only_stage else {"F": 1, "I": 1, "W": 1}
    for part, count in counts.items():
        if any(c != expected[part] for c in count):
            where = f"stage {s}" + (f" chunk {chunk}" if several else "")
            raise PipelineConfigError(f"{where} does not run each micro-batch's {part} once: {format_actions(actions)}")


def _show(schedule: list[list[Action]], position: list[int], mark: str = "<-- STUCK HERE") -> str:
    lines = []
    for s, actions in enumerate(schedule):
        parts = [str(a) + (f" {mark}" if i == position[s] else "") for i, a in enumerate(actions)]
        lines.append(f"stage {s}: " + " ".join(parts))
    return "\n".join(lines)


def gantt(schedule: list[list[Action]], durations: dict | None = None, placement: list | None = None) -> str:
    """A text chart of :func:`simulate`'s run, a character per tick (integer durations).

    ``F``/``I``/``W``/``B`` for chunk 0, lower case for chunk 1 (``f``/``i``/``w``/``b``),
    digits for chunks 2 and up; fused actions show their parts (``FI`` ->
    ``F`` then ``I``), ``.`` is a tick the rank waits.

    >>> from keras_pipe.schedules import one_f_one_b
    >>> print(gantt(one_f_one_b(2, 2), {FORWARD: 1, BACKWARD: 2, FORWARD_BACKWARD: 3}))
    rank 0 |FF..BB.BB|
    rank 1 |.FBBFBB..|
    """
    durations = durations or {}
    timeline = simulate(schedule, durations, placement)
    width = int(max((start + _ticks(a, durations) for stage in timeline for start, a in stage), default=0))
    rows = []
    for r, stage in enumerate(timeline):
        row = ["."] * width
        for start, action in stage:
            ticks = int(_ticks(action, durations))
            if not ticks:  # (a message or a seed, taking no time)
                continue
            letters = "".join(_parts(action.kind)).replace("IW", "B")
            marks = "".join(letter * int(durations.get(Kind(letter), 1)) for letter in letters)
            marks *= len(action.microbatches)
            marks = (marks + marks[-1] * ticks)[:ticks]
            row[int(start) : int(start) + ticks] = [_mark(letter, action.chunk) for letter in marks]
        rows.append(f"rank {r} |{''.join(row)}|")
    return "\n".join(rows)


def _ticks(action: Action, durations: dict) -> float:
    """How long ``action`` takes: its kind's duration per micro-batch (see :func:`simulate` for the defaults)."""
    kind = action.kind
    per = durations.get(kind)
    if per is None:
        if kind.communicates or kind is SEED:
            per = 0
        else:
            per = durations.get(FORWARD, 1) if kind in (FORWARD_LOSS, FORWARD_HEAD) else 1
    return per * len(action.microbatches)


def _mark(letter: str, chunk: int) -> str:
    return letter if chunk == 0 else letter.lower() if chunk == 1 else str(chunk)
