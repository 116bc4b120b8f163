"""What a schedule is made of: the kinds of action, actions, holdings, and what every schedule shares.

The vocabulary of :mod:`keras_pipe.schedules.schedule` (whose docstring
describes each kind of action), with the checks of its arguments and the
split of ``B`` into ``I`` + batched ``W`` that every schedule applies. The
one-chunk, virtual-stage and zero-bubble schedules build on it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from keras_pipe.errors import PipelineConfigError


class Kind(enum.Enum):
    """What an action computes, or which message it sends or receives.

    The schedules (:mod:`.one_chunk`, :mod:`.virtual`, :mod:`.zero_bubble`)
    are made of the computing kinds; :func:`keras_pipe.schedules.lowering.lower`
    adds the messages (``SEND_F`` ... ``RECV_B``) and the last stage's
    ``SEED``, and the executor runs that list.
    """

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    FORWARD_BACKWARD = "FB"
    FORWARD_INPUT = "FI"
    FORWARD_LOSS = "FL"  # last stage, evaluation: the forward and the loss of one micro-batch
    FORWARD_HEAD = "FH"  # last stage, a loss over the whole batch: the forward, summing terms and divisors
    SEND_F = "SEND_F"  # the stage's outputs to the stages that read them
    RECV_F = "RECV_F"  # the stage's inputs from the stages that computed them
    SEND_B = "SEND_B"  # the gradients of the stage's inputs back to those stages
    RECV_B = "RECV_B"  # the gradients of the stage's outputs from the stages that read them
    SEED = "SEED"  # last stage, a loss over the whole batch: the outputs' gradients, once every forward counted

    @property
    def forwards(self) -> bool:
        return self in (Kind.FORWARD, Kind.FORWARD_BACKWARD, Kind.FORWARD_INPUT, Kind.FORWARD_LOSS, Kind.FORWARD_HEAD)

    @property
    def input_gradient(self) -> bool:
        """Whether the action computes the gradient of the stage input (and sends it upstream)."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.FORWARD_BACKWARD, Kind.FORWARD_INPUT)

    @property
    def weight_gradient(self) -> bool:
        return self in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT, Kind.FORWARD_BACKWARD)

    @property
    def communicates(self) -> bool:
        """Whether the action sends or receives a message (and computes nothing)."""
        return self in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


# The kinds as the tests and diagrams spell them.
FORWARD, BACKWARD = Kind.FORWARD, Kind.BACKWARD
BACKWARD_INPUT, BACKWARD_WEIGHT = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
FORWARD_BACKWARD, FORWARD_INPUT = Kind.FORWARD_BACKWARD, Kind.FORWARD_INPUT
FORWARD_LOSS, FORWARD_HEAD = Kind.FORWARD_LOSS, Kind.FORWARD_HEAD
SEND_F, RECV_F, SEND_B, RECV_B, SEED = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SEED


class Holding(NamedTuple):
    """What a stage may hold for its batched ``W``, in micro-batches' worth of activations.

    ``limit``: at most this much (``None``: the schedule's own bound, as the
    unsplit schedule holds; a larger one where :func:`hold_for` allows it).
    ``cost``: what a micro-batch between its ``I`` and its ``W`` holds (its
    weighted layers' inputs and output gradients) against what it holds in
    flight (its activations).
    """

    limit: float | None = None
    cost: float = 1.0


class Action(NamedTuple):
    """One step of a stage's schedule: ``kind`` on ``microbatches`` (one, except for a batched ``W``).

    ``chunk``: which of the rank's model chunks it runs (0 but in the schedules
    of :mod:`keras_pipe.schedules.virtual`, where a rank holds several virtual stages).
    """

    kind: Kind
    microbatches: tuple
    chunk: int = 0

    @property
    def microbatch(self) -> int:
        """The (first) micro-batch of the action."""
        return self.microbatches[0]

    def __str__(self) -> str:
        mbs = self.microbatches
        where = f"@{self.chunk}" if self.chunk else ""
        if len(mbs) > 1 and list(mbs) == list(range(mbs[0], mbs[-1] + 1)):
            return f"{self.kind.value}{mbs[0]}-{mbs[-1]}{where}"
        return self.kind.value + ",".join(map(str, mbs)) + where


def act(kind: Kind, *microbatches: int, chunk: int = 0) -> Action:
    """``act(Kind.FORWARD, 3)``: an action on the given micro-batches (of the rank's ``chunk``).

    >>> str(act(FORWARD, 3)), str(act(BACKWARD_WEIGHT, 0, 1, 2, chunk=1))
    ('F3', 'W0-2@1')
    """
    return Action(kind, tuple(microbatches), chunk)


def max_in_flight(actions: list[Action]) -> int:
    """The largest number of micro-batches whose activations a stage holds at once (between F and B/I)."""
    alive = peak = 0
    for action in actions:
        if action.kind in (FORWARD, FORWARD_HEAD):
            alive += 1
        elif action.kind in (BACKWARD, BACKWARD_INPUT):
            alive -= 1
        peak = max(peak, alive + (1 if action.kind in (FORWARD_BACKWARD, FORWARD_INPUT) else 0))
    return peak


def max_held(actions: list[Action], cost: float = 1.0) -> float:
    """The most a stage holds between its actions, in micro-batches' worth of activations.

    A micro-batch in flight (between its forward and its ``I``) counts one; one
    between its ``I`` and its ``W`` counts ``cost`` (what the weight gradients
    read: each weighted layer's input and output gradient). A ``W`` run right
    after an ``I`` frees what that ``I`` held at once. With an unsplit
    backward this is :func:`max_in_flight`.

    >>> from keras_pipe.schedules.one_chunk import gpipe, one_f_one_b
    >>> max_held(one_f_one_b(2, 4, split_backward=True)[0]), max_held(gpipe(2, 4, split_backward=True)[0])
    (2.0, 4.0)
    """
    in_flight, pending, peak = 0, 0, 0.0
    for position, action in enumerate(actions):
        if action.kind in (FORWARD_BACKWARD, FORWARD_INPUT):
            peak = max(peak, in_flight + cost * pending + 1)
        in_flight += action.kind in (FORWARD, FORWARD_HEAD)
        in_flight -= action.kind in (BACKWARD, BACKWARD_INPUT)
        pending += action.kind in (BACKWARD_INPUT, FORWARD_INPUT)
        pending -= len(action.microbatches) if action.kind is BACKWARD_WEIGHT else 0
        following = actions[position + 1] if position + 1 < len(actions) else None
        if following is None or following.kind is not BACKWARD_WEIGHT:
            peak = max(peak, in_flight + cost * pending)
    return peak


def format_actions(actions: list[Action]) -> str:
    """``'F0 F1 B0 B1'``: a stage's actions as in the diagrams above."""
    return " ".join(str(a) for a in actions)


def _holdings(hold: dict | None, bounds: list) -> list[Holding]:
    """Each stage's :class:`Holding`, its limit at least the schedule's own ``bounds[s]``."""
    result = []
    for s, bound in enumerate(bounds):
        given = (hold or {}).get(s, Holding())
        result.append(Holding(max(bound, given.limit or 0), given.cost))
    return result


def _split(schedule: list[list[Action]], split_backward: bool, holdings: list) -> list[list[Action]]:
    """B -> I and FB -> FI; each stage's W batched over what it holds, within its :class:`Holding`.

    A ``W`` runs over one chunk's micro-batches (a chunk's layers are its
    own): where a rank holds several, what it holds is flushed chunk by chunk.
    """
    if not split_backward:
        return schedule
    renamed = {BACKWARD: BACKWARD_INPUT, FORWARD_BACKWARD: FORWARD_INPUT}
    result = []
    for actions, (limit, cost) in zip(schedule, holdings):
        split: list[Action] = []
        in_flight, pending = 0, {}  # pending: chunk -> the micro-batches whose I ran, W not yet
        for action in (Action(renamed.get(a.kind, a.kind), a.microbatches, a.chunk) for a in actions):
            held = sum(map(len, pending.values()))
            # a forward that would pass the limit runs once the held micro-batches' W freed them
            if action.kind.forwards and held and in_flight + cost * held + 1 > limit + 1e-9:
                split += _weights(pending)
            split.append(action)
            in_flight += action.kind is FORWARD
            if action.kind.input_gradient:
                in_flight -= action.kind is BACKWARD_INPUT
                pending.setdefault(action.chunk, []).append(action.microbatch)
                # (what an I holds for W may cost more)
                if in_flight + cost * sum(map(len, pending.values())) > limit + 1e-9:
                    split += _weights(pending)
        result.append(split + _weights(pending))
    return result


def _last_forwards(actions: list[Action], kind: Kind, chunk: int = 0) -> list[Action]:
    """The last virtual stage's forwards (``chunk``'s ``F``) as ``kind``: ``FORWARD_HEAD`` or ``FORWARD_LOSS``."""
    return [Action(kind, a.microbatches, a.chunk) if a.kind is FORWARD and a.chunk == chunk else a for a in actions]


def _weights(pending: dict) -> list[Action]:
    """One ``W`` per chunk over its pending micro-batches; ``pending`` is emptied."""
    weights = [Action(BACKWARD_WEIGHT, tuple(mbs), chunk) for chunk, mbs in pending.items()]
    pending.clear()
    return weights


def merge_weight_runs(actions: list[Action]) -> list[Action]:
    """Each run of consecutive ``W`` actions as one ``W`` a chunk, over the run's micro-batches of that chunk.

    Nothing runs between the ``W`` of a run (no forward, no input gradient,
    no message), so one ``W`` over their micro-batches computes the same sums
    in fewer program calls, each paying once for reading and adding into the
    weights' gradients; what the stage holds at the run's start is its most
    either way. ZB-V's tail on its middle rank is four ``W`` of two chunks:

    >>> format_actions(merge_weight_runs([act(BACKWARD_INPUT, 1), act(BACKWARD_WEIGHT, 0, chunk=1),
    ...     act(BACKWARD_WEIGHT, 0), act(BACKWARD_WEIGHT, 1, chunk=1), act(BACKWARD_WEIGHT, 1)]))
    'I1 W0-1@1 W0-1'
    """
    merged: list[Action] = []
    run: dict[int, list[int]] = {}
    for action in [*actions, None]:
        if action is not None and action.kind is BACKWARD_WEIGHT:
            run.setdefault(action.chunk, []).extend(action.microbatches)
            continue
        merged += [Action(BACKWARD_WEIGHT, tuple(mbs), chunk) for chunk, mbs in run.items()]
        run = {}
        if action is not None:
            merged.append(action)
    return merged


def _check(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineConfigError(f"num_stages must be a positive integer, got {num_stages!r}.")
    check_microbatches(num_microbatches)


def check_microbatches(num_microbatches) -> None:
    """Raises :class:`PipelineConfigError` unless ``num_microbatches`` is a positive integer."""
    check_count("num_microbatches", num_microbatches, '1 means no micro-batching; or "auto"')


def check_count(name: str, value, meaning_of_one: str) -> None:
    """Raises :class:`PipelineConfigError` unless ``value`` is a positive integer (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineConfigError(f"{name}={value!r}: it must be a positive integer ({meaning_of_one}).")
