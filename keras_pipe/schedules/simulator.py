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
    FORWARD_INPUT,
    Action,
    Kind,
    format_actions,
)


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
    """Runs a schedule on an ideal clock and returns ``(start tick, action)`` per stage.

    Each action takes ``durations[kind]`` ticks per micro-batch (all 1 by
    default), sends never block, and an action starts when its stage is free
    and its inputs have arrived. Raises :class:`PipelineConfigError` showing
    the stuck actions if the schedule deadlocks, or the stage if it does not
    run every forward, input gradient and weight gradient exactly once.

    ``placement[r][c]``: the virtual stage that chunk ``c`` of rank ``r`` holds
    (:mod:`keras_pipe.schedules.virtual`; by default rank ``r`` holds stage ``r`` alone).
    """
    durations = durations or {}
    placement = placement or [[s] for s in range(len(schedule))]
    num_virtual = sum(map(len, placement))
    done: dict[tuple[int, str, int], int] = {}  # (virtual stage, "F"/"I"/"W", microbatch) -> end tick
    num_stages = len(schedule)
    position = [0] * num_stages
    free_at = [0] * num_stages
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if position[s] == len(schedule[s]):
                continue
            action = schedule[s][position[s]]
            k = placement[s][action.chunk]
            deps = [d for i in action.microbatches for d in _dependencies(k, action.kind, i, num_virtual)]
            if all(d in done for d in deps):
                start = max([free_at[s]] + [done[d] for d in deps])
                end = start + _ticks(action, durations)
                for i in action.microbatches:
                    for part in _parts(action.kind):
                        done[(k, part, i)] = end
                free_at[s] = end
                timeline[s].append((start, action))
                position[s] += 1
                progressed = True
        if not progressed:
            raise PipelineConfigError("schedule deadlocks:\n" + _show(schedule, position))
    _check_complete(schedule, placement)
    return timeline


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


def _dependencies(stage: int, kind: Kind, i: int, num_stages: int) -> list[tuple[int, str, int]]:
    deps = []
    if kind.forwards and stage > 0:
        deps.append((stage - 1, "F", i))
    if kind.input_gradient and not kind.forwards:
        deps.append((stage, "F", i))
    if kind.input_gradient and stage < num_stages - 1:
        deps.append((stage + 1, "I", i))
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
            letters = "".join(_parts(action.kind)).replace("IW", "B")
            marks = "".join(letter * int(durations.get(Kind(letter), 1)) for letter in letters)
            marks *= len(action.microbatches)
            marks = (marks + marks[-1] * ticks)[:ticks]
            row[int(start) : int(start) + ticks] = [_mark(letter, action.chunk) for letter in marks]
        rows.append(f"rank {r} |{''.join(row)}|")
    return "\n".join(rows)


def _ticks(action: Action, durations: dict) -> float:
    """How long ``action`` takes: its kind's duration per micro-batch."""
    return durations.get(action.kind, 1) * len(action.microbatches)


def _mark(letter: str, chunk: int) -> str:
    return letter if chunk == 0 else letter.lower() if chunk == 1 else str(chunk)
