"""Pipeline schedules as plain data: the ordered actions of every stage.

A schedule says, for each stage, in which order it runs which computation on
which micro-batch. It holds no tensors and does no communication, so it is
generated and checked in a single process. Its communication follows from
the actions, and :func:`keras_pipe.schedules.lowering.lower` adds it as actions
of its own: a forward on stage ``s > 0`` receives activations from ``s - 1``
(``RECV_F``), a forward on stage ``s < last`` sends them to ``s + 1``
(``SEND_F``); an action computing an input gradient receives the gradient
of the stage output from ``s + 1`` (``RECV_B``, unless ``s`` is last) and
sends the gradient of the stage input to ``s - 1`` (``SEND_B``, unless ``s``
is first). :mod:`keras_pipe.engine.executor` runs those lowered lists, and
:mod:`keras_pipe.schedules.simulator` runs them on an ideal clock (the
deadlock, message and completeness checks, the time it takes).

The kinds of action (:class:`~keras_pipe.schedules.actions.Kind`), as in the zero-bubble papers:

- ``F``: the forward of one micro-batch;
- ``B``: its whole backward, input gradient and weight gradients together;
- ``I``: only the gradient with respect to the stage input (what the
  previous stage waits for), keeping what the weight gradients need;
- ``W``: the weight gradients of one or more micro-batches, in one pass;
- ``FB`` and ``FI``: the last stage's forward, loss and ``B`` (or ``I``) of
  one micro-batch as one computation. The last stage needs nothing from
  another rank between its forward and its backward, so the schedule says so
  with one action instead of a rule the executor would have to remember;
- ``FL`` and ``FH``: the last stage's other forwards, for the same reason:
  with the loss in evaluation, and summing each loss term and its divisor
  where the loss is over the whole batch (a masked output's mean), whose
  backwards run once every forward counted the batch.

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

import dataclasses
from collections.abc import Callable

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules import virtual, zero_bubble
from keras_pipe.schedules.actions import Action, Holding, check_count, merge_weight_runs
from keras_pipe.schedules.one_chunk import gpipe, one_f_one_b
from keras_pipe.schedules.zero_bubble import zero_bubble_h1


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """What one schedule name means, everything the rest of keras_pipe asks of it (:data:`REGISTRY`).

    ``build(p, m, split_backward, hold, v)`` makes its actions; ``chunks`` is
    how many chunks a rank holds unless told (``None``: any number of two or
    more, two by default); ``v_placement`` says the chunks sit in a V (ZB-V)
    rather than a loop; ``splits_backward`` that it only exists with I and W;
    ``whole_rounds`` that it needs ``m`` a multiple of the stages (a shorter
    batch runs a chunked GPipe instead); ``bubble`` its bubble in theory,
    where a formula gives it (else the simulator's).
    """

    name: str
    build: Callable
    chunks: int | None = 1
    v_placement: bool = False
    splits_backward: bool = False
    whole_rounds: bool = False
    bubble: tuple[Callable, str] | None = None  # (its bubble in theory, (p, m, v) -> float, and the formula written)

    @property
    def chunked(self) -> bool:
        return self.chunks != 1


def _merged(schedule: list[list[Action]]) -> list[list[Action]]:
    # (the zero-bubble schedules place a W a micro-batch where it fills a wait; where several end up together,
    # as in ZB-V's tail, one W a chunk does their work: actions.merge_weight_runs)
    return [merge_weight_runs(row) for row in schedule]


# Every schedule keras_pipe runs, by the name PipelineModel(schedule=...) takes: no module outside schedules/
# compares schedule names, it asks this table.
REGISTRY = {
    kind.name: kind
    for kind in (
        ScheduleKind("1f1b", lambda p, m, split, hold, v: one_f_one_b(p, m, split, hold)),
        ScheduleKind("gpipe", lambda p, m, split, hold, v: gpipe(p, m, split, hold=hold)),
        ScheduleKind("zb-h1", lambda p, m, split, hold, v: _merged(zero_bubble_h1(p, m)), splits_backward=True),
        # Several model chunks a rank (virtual stages; :mod:`keras_pipe.schedules.virtual`): interleaved 1F1B over
        # the loop placement (``num_chunks`` of them), ZB-V over the V placement (two).
        ScheduleKind(
            "interleaved-1f1b",
            lambda p, m, split, hold, v: virtual.interleaved_one_f_one_b(p, m, v, split, hold),
            chunks=None,
            whole_rounds=True,
            bubble=(lambda p, m, v: (p - 1) / (v * m + p - 1), "(P - 1) / (v m + P - 1)"),
        ),
        ScheduleKind(
            "zb-v",
            lambda p, m, split, hold, v: _merged(zero_bubble.zero_bubble_v(p, m)),
            chunks=2,
            v_placement=True,
            splits_backward=True,
        ),
    )
}
AUTO = "auto"  # (not a schedule: PipelineModel(schedule="auto") times the schedules and runs the fastest, :mod:`.auto`)
# What a name outside the registry ("auto", until it picks) is asked as: one stage a rank, in a loop, unsplit
_ONE_STAGE_A_RANK = ScheduleKind(AUTO, build=None)
SCHEDULES = tuple(name for name, kind in REGISTRY.items() if not kind.chunked)
CHUNKED_SCHEDULES = tuple(name for name, kind in REGISTRY.items() if kind.chunked)


def _asked(name: str) -> ScheduleKind:
    return REGISTRY.get(name, _ONE_STAGE_A_RANK)


def kind_of(name: str) -> ScheduleKind:
    """The :class:`ScheduleKind` called ``name``; raises :class:`PipelineConfigError` naming the known ones."""
    check_name(name, auto=False)
    return REGISTRY[name]


def is_auto(name: str) -> bool:
    """Whether ``name`` asks for the schedule to be picked by timing (``"auto"``)."""
    return name == AUTO


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
    kind = kind_of(name)
    check_chunks(name, num_chunks)
    return kind.build(num_stages, num_microbatches, split_backward, hold, num_chunks)


def placement(name: str, num_stages: int, num_chunks: int = 1) -> list[list[int]]:
    """Which virtual stage each rank's chunk holds under schedule ``name``: ``placement[r][c]``.

    >>> placement("1f1b", 2), placement("interleaved-1f1b", 2, 2), placement("zb-v", 2, 2)
    ([[0], [1]], [[0, 2], [1, 3]], [[0, 3], [1, 2]])
    """
    check_chunks(name, num_chunks)
    if _asked(name).v_placement:
        return virtual.v_placement(num_stages)
    return virtual.loop_placement(num_stages, num_chunks)


def default_chunks(name: str) -> int:
    """The chunks a rank holds under schedule ``name`` unless told: two for a chunked schedule, else one."""
    return 2 if _asked(name).chunked else 1


def check_chunks(name: str, num_chunks) -> None:
    """Raises :class:`PipelineConfigError` unless schedule ``name`` runs ``num_chunks`` chunks a rank."""
    check_count("num_chunks", num_chunks, "one stage a rank")
    kind = _asked(name)  # ("auto": one chunk a rank; its candidates' chunks are their own)
    if kind.chunks == 2 and num_chunks != 2:
        raise PipelineConfigError(f"schedule={name!r} runs two chunks a rank (a V), not num_chunks={num_chunks}.")
    if kind.chunks is None and num_chunks < 2:
        raise PipelineConfigError(
            f"schedule={name!r} needs num_chunks of 2 or more (one chunk a rank is schedule='1f1b')."
        )
    if kind.chunks == 1 and num_chunks != 1:
        raise PipelineConfigError(
            f"schedule={name!r} runs one chunk a rank, not num_chunks={num_chunks}; several chunks a rank "
            f"run under {' or '.join(map(repr, CHUNKED_SCHEDULES))}."
        )


def needs_whole_rounds(name: str) -> bool:
    """Whether schedule ``name`` needs ``num_microbatches`` a multiple of the stages (interleaved 1F1B's rounds)."""
    return _asked(name).whole_rounds


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
    known = (*REGISTRY, AUTO) if auto else tuple(REGISTRY)
    if name not in known:
        raise PipelineConfigError(f"schedule={name!r} is not known; use one of {', '.join(map(repr, known))}.")


def needs_split_backward(name: str) -> bool:
    """Whether the schedule only exists with a split backward (I and W)."""
    return _asked(name).splits_backward
