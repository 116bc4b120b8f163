"""The messages of a schedule as actions of its own: the list each rank's executor runs.

A schedule (:mod:`keras_pipe.schedules.schedule`) says what each rank
computes; :func:`lower` adds what it sends and receives, as torch's
pipelining adds ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` to its actions.
An action on virtual stage ``k`` (of ``V``; :mod:`keras_pipe.schedules.virtual`)

- receives its inputs right before it (``RECV_F``), where it forwards and
  ``k > 0``;
- receives the gradients of its outputs right before it (``RECV_B``), where it
  computes an input gradient without its forward (``B``, ``I``) and
  ``k < V - 1``; on the last virtual stage, where a loss over the whole
  batch seeds them once every forward counted its divisors, ``SEED`` takes
  the receive's place;
- sends its outputs right after it (``SEND_F``), where it is a plain forward
  and ``k < V - 1``;
- sends the gradients of its inputs right after it (``SEND_B``), where it
  computes them and ``k > 0``.

These are the messages, in the order, that the executor sent and received
inside its computing actions before they were data. A send starts at once
(MPI's ``Isend``) and a receive waits for its message; each ordered pair of
virtual stages keeps its messages in order (MPI's matching on source and
tag). :func:`keras_pipe.schedules.simulator.simulate` runs the lowered lists
so, matching each receive to its send.

>>> from keras_pipe.schedules.actions import format_actions
>>> from keras_pipe.schedules.one_chunk import one_f_one_b
>>> for actions in lower(one_f_one_b(2, 3)):
...     print(format_actions(actions))
F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 RECV_B2 B2
RECV_F0 FB0 SEND_B0 RECV_F1 FB1 SEND_B1 RECV_F2 FB2 SEND_B2
"""

from __future__ import annotations

from keras_pipe.schedules.actions import (
    FORWARD,
    RECV_B,
    RECV_F,
    SEED,
    SEND_B,
    SEND_F,
    Action,
)


def lower(schedule: list[list[Action]], placement: list[list[int]] | None = None) -> list[list[Action]]:
    """Each rank's actions with its messages (see the module's docstring); a lowered schedule is returned as it is.

    ``placement[r][c]``: the virtual stage of rank ``r``'s chunk ``c`` (by
    default rank ``r`` holds stage ``r`` alone).
    """
    placement = placement or [[s] for s in range(len(schedule))]
    num_virtual = sum(map(len, placement))
    return [lower_rank(actions, stages, num_virtual) for actions, stages in zip(schedule, placement)]


def lower_rank(actions: list[Action], stages: list[int], num_virtual: int) -> list[Action]:
    """One rank's actions with its messages; ``stages[c]``: the virtual stage of its chunk ``c``, of ``num_virtual``."""
    if is_lowered(actions):
        return list(actions)
    last = num_virtual - 1
    lowered: list[Action] = []
    for action in actions:
        kind, k = action.kind, stages[action.chunk]
        if kind.forwards and k > 0:
            lowered.append(Action(RECV_F, action.microbatches, action.chunk))
        if kind.input_gradient and not kind.forwards:
            lowered.append(Action(RECV_B if k < last else SEED, action.microbatches, action.chunk))
        lowered.append(action)
        if kind is FORWARD and k < last:
            lowered.append(Action(SEND_F, action.microbatches, action.chunk))
        if kind.input_gradient and k > 0:
            lowered.append(Action(SEND_B, action.microbatches, action.chunk))
    return lowered


def is_lowered(actions: list[Action]) -> bool:
    """Whether a rank's actions already hold their messages (an action that communicates, or a ``SEED``)."""
    return any(a.kind.communicates or a.kind is SEED for a in actions)


def computing(actions: list[Action]) -> list[Action]:
    """A lowered rank's actions without its messages and seeds: what the schedule computes.

    >>> from keras_pipe.schedules.one_chunk import one_f_one_b
    >>> [str(a) for a in computing(lower(one_f_one_b(2, 3))[1])]
    ['FB0', 'FB1', 'FB2']
    """
    return [a for a in actions if not (a.kind.communicates or a.kind is SEED)]
