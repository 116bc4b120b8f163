"""Pipeline schedules as plain data: the ordered actions of every stage.

A schedule says, for each stage, in which order it runs the forward and the
backward pass of each micro-batch. It holds no tensors and does no
communication, so it is generated and checked in a single process; the
executor in :mod:`keras_pipe.stage` walks it. Communication follows from the
actions: a forward on stage ``s > 0`` receives activations from ``s - 1``, a
forward on stage ``s < last`` sends them to ``s + 1``; a backward receives the
gradient from ``s + 1`` (unless ``s`` is last) and sends the gradient of its
input to ``s - 1`` (unless ``s`` is first).

Both schedules run the backward passes of a stage in micro-batch order
0, 1, ..., m - 1, so weight gradients are summed in the same order and the two
schedules give bit-identical training results. In both, the last stage runs
each micro-batch's backward right after its forward: it needs nothing from
another rank for it, the executor fuses the two into one graph, and the
last stage keeps one micro-batch of activations instead of ``m``.
"""

from __future__ import annotations

from typing import NamedTuple

from keras_pipe.errors import PipelineConfigError

FORWARD = "F"
BACKWARD = "B"
SCHEDULES = ("1f1b", "gpipe")


class Action(NamedTuple):
    """One step of a stage's schedule: ``kind`` (``"F"`` or ``"B"``) of a micro-batch."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards (GPipe).

    Every stage but the last keeps the activations of all ``m``
    micro-batches alive; the last one runs each backward after its forward.

    ```
    # GPipe, 3 stages, 4 micro-batches:
    # stage 0: F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3
    # stage 1:    F0 F1 F2 F3 .. .. B0 B1 B2 B3
    # stage 2:       F0 B0 F1 B1 F2 B2 F3 B3
    ```

    Example:

    >>> [str(a) for a in gpipe(2, 2)[0]]
    ['F0', 'F1', 'B0', 'B1']
    >>> [str(a) for a in gpipe(2, 2)[1]]
    ['F0', 'B0', 'F1', 'B1']
    """
    _check(num_stages, num_microbatches)
    m = num_microbatches
    stage = [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)]
    last = [Action(kind, i) for i in range(m) for kind in (FORWARD, BACKWARD)]
    return [list(stage) for _ in range(num_stages - 1)] + [last]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """One forward, one backward (PipeDream-Flush / 1F1B).

    Stage ``s`` runs ``P - s - 1`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards. It keeps
    at most ``P - s`` micro-batches of activations alive instead of ``m``.

    ```
    # 1F1B, 3 stages, 4 micro-batches (F = forward, B = backward):
    # stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    # stage 1:    F0 F1 B0 F2 B1 F3 B2 B3
    # stage 2:       F0 B0 F1 B1 F2 B2 F3 B3
    ```

    Example:

    >>> [str(a) for a in one_f_one_b(3, 4)[0]]
    ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    _check(num_stages, num_microbatches)
    m = num_microbatches
    schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_backward < m:
            if next_forward < m:
                actions.append(Action(FORWARD, next_forward))
                next_forward += 1
            actions.append(Action(BACKWARD, next_backward))
            next_backward += 1
        schedule.append(actions)
    return schedule


def forward_only(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Forwards only, in order: the schedule of ``evaluate`` and ``predict``."""
    _check(num_stages, num_microbatches)
    return [[Action(FORWARD, i) for i in range(num_microbatches)] for _ in range(num_stages)]


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Returns the training schedule called ``name`` (``"1f1b"`` or ``"gpipe"``)."""
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches)
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    raise PipelineConfigError(f"schedule={name!r} is not known; use one of {', '.join(repr(s) for s in SCHEDULES)}.")


def max_in_flight(actions: list[Action]) -> int:
    """The largest number of micro-batches whose activations a stage holds at once."""
    alive = peak = 0
    for action in actions:
        alive += 1 if action.kind == FORWARD else -1
        peak = max(peak, alive)
    return peak


def simulate(schedule: list[list[Action]]) -> list[list[tuple[int, Action]]]:
    """Runs a schedule on an ideal clock and returns ``(tick, action)`` per stage.

    Every action takes one tick, sends never block, and an action starts when
    its stage is free and its input has arrived. Raises
    :class:`PipelineConfigError` showing the stuck actions if the schedule
    deadlocks or does not run every forward and backward exactly once.
    """
    num_stages = len(schedule)
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> end tick
    position = [0] * num_stages
    free_at = [0] * num_stages
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if position[s] == len(schedule[s]):
                continue
            action = schedule[s][position[s]]
            deps = _dependencies(s, action, num_stages)
            if all(d in done for d in deps):
                start = max([free_at[s]] + [done[d] for d in deps])
                done[(s, action.kind, action.microbatch)] = start + 1
                free_at[s] = start + 1
                timeline[s].append((start, action))
                position[s] += 1
                progressed = True
        if not progressed:
            raise PipelineConfigError("schedule deadlocks:\n" + _describe(schedule, position))
    for s, actions in enumerate(schedule):
        expected = {(k, i) for k in (FORWARD, BACKWARD) for i in range(_num_mb(schedule))}
        seen = [(a.kind, a.microbatch) for a in actions]
        if len(seen) != len(set(seen)) or (
            set(seen) != expected and set(seen) != {e for e in expected if e[0] == FORWARD}
        ):
            raise PipelineConfigError(f"stage {s} does not run each micro-batch once: {format_actions(actions)}")
    return timeline


def format_actions(actions: list[Action]) -> str:
    """``'F0 F1 B0 B1'``: a stage's actions as in the diagrams above."""
    return " ".join(str(a) for a in actions)


def _dependencies(stage: int, action: Action, num_stages: int) -> list[tuple[int, str, int]]:
    deps = []
    if action.kind == FORWARD and stage > 0:
        deps.append((stage - 1, FORWARD, action.microbatch))
    if action.kind == BACKWARD:
        deps.append((stage, FORWARD, action.microbatch))
        if stage < num_stages - 1:
            deps.append((stage + 1, BACKWARD, action.microbatch))
    return deps


def _num_mb(schedule: list[list[Action]]) -> int:
    return 1 + max(a.microbatch for actions in schedule for a in actions)


def _describe(schedule: list[list[Action]], position: list[int]) -> str:
    lines = []
    for s, actions in enumerate(schedule):
        parts = [str(a) + (" <-- STUCK HERE" if i == position[s] else "") for i, a in enumerate(actions)]
        lines.append(f"stage {s}: " + " ".join(parts))
    return "\n".join(lines)


def _check(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineConfigError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise PipelineConfigError(
            f"num_microbatches must be a positive integer, got {num_microbatches!r}; "
            "use num_microbatches=1 for no micro-batching."
        )
