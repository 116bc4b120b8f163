"""Pipeline schedules as plain data: the ordered actions of every stage.

A schedule says, for each stage, in which order it runs which computation on
which micro-batch. It holds no tensors and does no communication, so it is
generated and checked in a single process; :mod:`keras_pipe.engine.executor` walks
it, and :mod:`keras_pipe.schedules.simulator` runs it on an ideal clock (the deadlock
and completeness checks, the time it takes). Communication follows from the actions: a forward on stage ``s > 0``
receives activations from ``s - 1``, a forward on stage ``s < last`` sends
them to ``s + 1``; an action computing an input gradient receives the
gradient of the stage output from ``s + 1`` (unless ``s`` is last) and sends
the gradient of the stage input to ``s - 1`` (unless ``s`` is first).

The kinds of action (:class:`Kind`), as in the zero-bubble papers:

- ``F``: the forward of one micro-batch;
- ``B``: its whole backward, input gradient and weight gradients together;
- ``I``: only the gradient with respect to the stage input (what the
  previous stage waits for), keeping what the weight gradients need;
- ``W``: the weight gradients of one or more micro-batches, in one pass;
- ``FB`` and ``FI``: the last stage's forward, loss and ``B`` (or ``I``) of
  one micro-batch as one computation. The last stage needs nothing from
  another rank between its forward and its backward, so the schedule says so
  with one action instead of a rule the executor would have to remember.

With a split backward (``I`` + ``W``), ``"1f1b"`` and ``"gpipe"`` batch
the ``W`` of as many micro-batches as the schedule's memory bound allows:
a micro-batch is *held* from its forward to its ``W`` (its activations, then
what its weight gradients need: :class:`Holding` says what that costs
against its activations), and a stage never holds more than the unsplit
schedule does (1F1B: ``min(P - s, m)`` micro-batches' activations on stage
``s``; GPipe: ``m``), or what :func:`hold_for` allows where activations are
small beside the weights. Where holding more would pass the bound, the
held micro-batches' ``W`` runs first, over all of them in one pass: the
work proportional to the weights is paid once per ``W``, and the ``W`` of
the later stages fills the cool-down bubble. ``"zb-h1"`` (Qi et al., *Zero Bubble Pipeline
Parallelism*, 2024) runs one ``W`` per micro-batch, placed to fill the
bubbles at 1F1B's activation memory.

Every schedule runs the input-gradient passes of a stage in micro-batch
order 0, 1, ..., m - 1 and weight gradients are summed in that order.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from keras_pipe.errors import PipelineConfigError

SCHEDULES = ("1f1b", "gpipe", "zb-h1")
# Several model chunks a rank (virtual stages; :mod:`keras_pipe.schedules.virtual`): interleaved 1F1B over the
# loop placement (``num_chunks`` of them), ZB-V over the V placement (two).
CHUNKED_SCHEDULES = ("interleaved-1f1b", "zb-v")


class Kind(enum.Enum):
    """What an action computes."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    FORWARD_BACKWARD = "FB"
    FORWARD_INPUT = "FI"

    @property
    def forwards(self) -> bool:
        return self in (Kind.FORWARD, Kind.FORWARD_BACKWARD, Kind.FORWARD_INPUT)

    @property
    def input_gradient(self) -> bool:
        """Whether the action computes the gradient of the stage input (and sends it upstream)."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.FORWARD_BACKWARD, Kind.FORWARD_INPUT)

    @property
    def weight_gradient(self) -> bool:
        return self in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT, Kind.FORWARD_BACKWARD)


# The kinds as the tests and diagrams spell them.
FORWARD, BACKWARD = Kind.FORWARD, Kind.BACKWARD
BACKWARD_INPUT, BACKWARD_WEIGHT = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
FORWARD_BACKWARD, FORWARD_INPUT = Kind.FORWARD_BACKWARD, Kind.FORWARD_INPUT


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
    unless ``whole_batch_loss``: then it too runs all its forwards first,
    because its loss needs the whole batch before any backward (the mean of
    a masked output is over the batch's unmasked entries, counted only by
    the forwards).

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
    ['F0', 'F1', 'B0', 'B1']
    """
    _check(num_stages, num_microbatches)
    m = num_microbatches
    stage = [act(FORWARD, i) for i in range(m)] + [act(BACKWARD, i) for i in range(m)]
    last = list(stage) if whole_batch_loss else [act(FORWARD_BACKWARD, i) for i in range(m)]
    plan = [list(stage) for _ in range(num_stages - 1)] + [last]
    # (holding every micro-batch for one W, whatever it costs: GPipe's memory for its speed)
    hold = {s: Holding(None, (hold or {}).get(s, Holding()).cost) for s in range(num_stages)}
    return _split(plan, split_backward, _holdings(hold, [m * max(h.cost, 1.0) for h in hold.values()]))


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


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2024): 1F1B's memory, the backward split, each ``W`` where its stage would wait.

    See :func:`keras_pipe.schedules.zero_bubble.zero_bubble_h1`.

    >>> [str(a) for a in zero_bubble_h1(2, 3)[0]]
    ['F0', 'F1', 'I0', 'W0', 'I1', 'F2', 'W1', 'I2', 'W2']
    """
    from keras_pipe.schedules import zero_bubble

    return zero_bubble.zero_bubble_h1(num_stages, num_microbatches)


def forward_only(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Forwards only, in order: the schedule of ``evaluate`` and ``predict``."""
    _check(num_stages, num_microbatches)
    return [[act(FORWARD, i) for i in range(num_microbatches)] for _ in range(num_stages)]


def make_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    split_backward: bool = False,
    hold: dict | None = None,
    num_chunks: int = 1,
) -> list[list[Action]]:
    """The training schedule called ``name`` (one of :data:`SCHEDULES` or :data:`CHUNKED_SCHEDULES`).

    ``split_backward`` asks for I + W actions instead of B (``"zb-h1"`` and
    ``"zb-v"`` always split); ``hold`` maps a stage to its :class:`Holding`
    (what it may hold for a batched ``W``; the schedule's own bound where
    none is given). ``num_stages`` counts ranks: with ``num_chunks`` chunks a
    rank, each rank's actions name the chunk they run (see :func:`placement`).

    >>> [str(a) for a in make_schedule("interleaved-1f1b", 2, 2, num_chunks=2)[1]]
    ['F0', 'F1', 'FB0@1', 'FB1@1', 'B0', 'B1']
    """
    check_name(name, auto=False)
    check_chunks(name, num_chunks)
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches, split_backward, hold)
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches, split_backward, hold=hold)
    if name == "interleaved-1f1b":
        from keras_pipe.schedules import virtual

        return virtual.interleaved_one_f_one_b(num_stages, num_microbatches, num_chunks, split_backward, hold)
    from keras_pipe.schedules import zero_bubble

    if name == "zb-v":
        return zero_bubble.zero_bubble_v(num_stages, num_microbatches)
    return zero_bubble_h1(num_stages, num_microbatches)


def placement(name: str, num_stages: int, num_chunks: int = 1) -> list[list[int]]:
    """Which virtual stage each rank's chunk holds under schedule ``name``: ``placement[r][c]``.

    >>> placement("1f1b", 2), placement("interleaved-1f1b", 2, 2), placement("zb-v", 2, 2)
    ([[0], [1]], [[0, 2], [1, 3]], [[0, 3], [1, 2]])
    """
    from keras_pipe.schedules import virtual

    check_chunks(name, num_chunks)
    if name == "zb-v":
        return virtual.v_placement(num_stages)
    return virtual.loop_placement(num_stages, num_chunks)


def default_chunks(name: str) -> int:
    """The chunks a rank holds under schedule ``name`` unless told: two for a chunked schedule, else one."""
    return 2 if name in CHUNKED_SCHEDULES else 1


def check_chunks(name: str, num_chunks) -> None:
    """Raises :class:`PipelineConfigError` unless schedule ``name`` runs ``num_chunks`` chunks a rank."""
    check_count("num_chunks", num_chunks, "one stage a rank")
    if name == "zb-v" and num_chunks != 2:
        raise PipelineConfigError(f"schedule='zb-v' runs two chunks a rank (a V), not num_chunks={num_chunks}.")
    if name == "interleaved-1f1b" and num_chunks < 2:
        raise PipelineConfigError(
            "schedule='interleaved-1f1b' needs num_chunks of 2 or more (one chunk a rank is schedule='1f1b')."
        )
    if name not in CHUNKED_SCHEDULES and num_chunks != 1:
        raise PipelineConfigError(
            f"schedule={name!r} runs one chunk a rank, not num_chunks={num_chunks}; several chunks a rank "
            f"run under {' or '.join(map(repr, CHUNKED_SCHEDULES))}."
        )


def hold_for(
    weight_bytes: int,
    held_bytes: int,
    kept_bytes: int | None,
    num_microbatches: int,
    share: float = 0.25,
    floor: int = 16 << 20,
) -> Holding:
    """What a stage may hold for its batched ``W``, from what it measured: a :class:`Holding`.

    A ``W`` per micro-batch pays the work proportional to the weights (each
    weight gradient written) once per micro-batch; holding micro-batches for
    one ``W`` costs what each holds until then (``held_bytes``: its weighted
    layers' inputs and output gradients; ``kept_bytes``: what it holds in
    flight, its activations, unknown on the last stage). A stage may hold as
    many as fit in ``share`` of its weights' bytes, or in ``floor`` bytes
    (below which a ``W`` per micro-batch saves nothing that matters and costs
    a program call each): where activations are small beside the weights
    (small micro-batches, wide layers) ``W`` runs once per batch, and where
    they dominate the schedule's own bound stands (1F1B's memory).

    >>> hold_for(weight_bytes=64 << 20, held_bytes=1 << 20, kept_bytes=1 << 20, num_microbatches=8)
    Holding(limit=8.0, cost=1.0)
    >>> hold_for(weight_bytes=4 << 20, held_bytes=64 << 20, kept_bytes=32 << 20, num_microbatches=8)
    Holding(limit=None, cost=2.0)
    """
    cost = held_bytes / kept_bytes if kept_bytes else 1.0
    if held_bytes <= 0:
        return Holding(float(num_microbatches) * max(cost, 1.0), cost)
    fit = min(num_microbatches, int(max(share * weight_bytes, floor) // held_bytes))
    return Holding(fit * cost if fit else None, cost)


def check_name(name, auto: bool = True) -> None:
    """Raises :class:`PipelineConfigError` unless ``name`` is a schedule, or ``"auto"`` (:mod:`.auto`)."""
    known = (*SCHEDULES, *CHUNKED_SCHEDULES, "auto") if auto else (*SCHEDULES, *CHUNKED_SCHEDULES)
    if name not in known:
        raise PipelineConfigError(f"schedule={name!r} is not known; use one of {', '.join(map(repr, known))}.")


def needs_split_backward(name: str) -> bool:
    """Whether the schedule only exists with a split backward (I and W)."""
    return name in ("zb-h1", "zb-v")


def max_in_flight(actions: list[Action]) -> int:
    """The largest number of micro-batches whose activations a stage holds at once (between F and B/I)."""
    alive = peak = 0
    for action in actions:
        if action.kind is FORWARD:
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

    >>> max_held(one_f_one_b(2, 4, split_backward=True)[0]), max_held(gpipe(2, 4, split_backward=True)[0])
    (2.0, 4.0)
    """
    in_flight, pending, peak = 0, 0, 0.0
    for position, action in enumerate(actions):
        if action.kind in (FORWARD_BACKWARD, FORWARD_INPUT):
            peak = max(peak, in_flight + cost * pending + 1)
        in_flight += action.kind is FORWARD
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


def _weights(pending: dict) -> list[Action]:
    """One ``W`` per chunk over its pending micro-batches; ``pending`` is emptied."""
    weights = [Action(BACKWARD_WEIGHT, tuple(mbs), chunk) for chunk, mbs in pending.items()]
    pending.clear()
    return weights


def _check(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineConfigError(f"num_stages must be a positive integer, got {num_stages!r}.")
    check_microbatches(num_microbatches)


def check_microbatches(num_microbatches) -> None:
    """Raises :class:`PipelineConfigError` unless ``num_microbatches`` is a positive integer."""
    check_count("num_microbatches", num_microbatches, "1 means no micro-batching")


def check_count(name: str, value, meaning_of_one: str) -> None:
    """Raises :class:`PipelineConfigError` unless ``value`` is a positive integer (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineConfigError(f"{name}={value!r}: it must be a positive integer ({meaning_of_one}).")
