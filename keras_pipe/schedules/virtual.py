"""Schedules with several model chunks per rank (virtual stages), as plain data.

With ``v`` chunks per rank the model is cut into ``P * v`` *virtual stages*
and each rank holds ``v`` of them; a placement (``placement[r][c]``, the
virtual stage of chunk ``c`` on rank ``r``) says which. Each chunk-sized
action takes ``1 / v`` of a whole stage's time, so the pipeline fills and
drains ``v`` times faster while a micro-batch crosses ranks ``v`` times:

- :func:`interleaved_one_f_one_b` (Narayanan et al., 2021: Megatron-LM's
  interleaved 1F1B, torch's ``ScheduleInterleaved1F1B``): chunks placed in a
  loop (:func:`loop_placement`: rank ``r`` holds ``r, r + P, r + 2P, ...``),
  the bubble ``(P - 1) / (v m)`` of the time instead of ``(P - 1) / m``, for
  a little more activation memory on the first ranks;
- :func:`keras_pipe.schedules.zero_bubble.zero_bubble_v` (Qi et al., *Pipeline
  Parallelism with Controllable Memory*, 2024; ZB-V): two chunks in a V
  (:func:`v_placement`: rank ``r`` holds ``r`` and ``2P - 1 - r``, so the
  first rank also holds the loss), the backward split into ``I`` and ``W``
  and the ``W`` filling the bubbles, at 1F1B's activation memory.

They are checked like the others by :func:`keras_pipe.schedules.simulator.simulate`
(given the placement), and are :data:`keras_pipe.schedules.schedule.CHUNKED_SCHEDULES`:
``PipelineModel(..., schedule="interleaved-1f1b", num_chunks=v)`` or
``schedule="zb-v"``. :func:`chunked_gpipe` and :func:`chunked_forward_only`
run any placement for any number of micro-batches: a batch whose count of
micro-batches interleaved 1F1B cannot take (the last, short one), a loss
over the whole batch (counted before any backward), evaluation and
prediction.
"""

from __future__ import annotations

from keras_pipe.errors import PipelineConfigError
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
    check_count,
    max_in_flight,
)
from keras_pipe.schedules.one_chunk import one_f_one_b


def loop_placement(num_ranks: int, num_chunks: int) -> list[list[int]]:
    """Chunk ``c`` of rank ``r`` holds virtual stage ``c * P + r`` (Megatron's interleaving).

    >>> loop_placement(2, 2)
    [[0, 2], [1, 3]]
    """
    return [[c * num_ranks + r for c in range(num_chunks)] for r in range(num_ranks)]


def v_placement(num_ranks: int) -> list[list[int]]:
    """Two chunks in a V: rank ``r`` holds virtual stages ``r`` and ``2P - 1 - r``.

    >>> v_placement(3)
    [[0, 5], [1, 4], [2, 3]]
    """
    return [[r, 2 * num_ranks - 1 - r] for r in range(num_ranks)]


def whole_rounds(num_ranks: int, num_microbatches: int) -> bool:
    """Whether interleaved 1F1B can run ``num_microbatches``: rounds of ``num_ranks``, every round whole.

    >>> whole_rounds(4, 8), whole_rounds(4, 6)
    (True, False)
    """
    return num_microbatches % num_ranks == 0


def check_whole_rounds(num_ranks: int, num_microbatches: int) -> None:
    """Raises :class:`PipelineConfigError` unless :func:`whole_rounds`, naming the nearest count that is."""
    if not whole_rounds(num_ranks, num_microbatches):
        rounded = -(-num_microbatches // num_ranks) * num_ranks
        raise PipelineConfigError(
            f"schedule='interleaved-1f1b' runs micro-batches in rounds of the {num_ranks} ranks, but "
            f"num_microbatches={num_microbatches} is not a multiple of {num_ranks}: use "
            f"num_microbatches={rounded}."
        )


def interleaved_one_f_one_b(
    num_ranks: int, num_microbatches: int, num_chunks: int, split_backward: bool = False, hold: dict | None = None
) -> list[list[Action]]:
    """Interleaved 1F1B over :func:`loop_placement`: each rank's actions.

    Micro-batches go through in rounds of ``P``: a rank runs the forwards of
    a round on chunk 0, then on chunk 1, ..., and the backwards in the
    reverse order of chunks. Rank ``r`` warms up with
    ``2 (P - r - 1) + (v - 1) P`` forwards, then alternates one forward and
    one backward. ``num_microbatches`` must be a multiple of ``P``, as in
    Megatron-LM. The last virtual stage (chunk ``v - 1`` of the last rank)
    runs each backward with its forward (``FB``). With ``split_backward`` the
    ``W`` are batched within the schedule's own bound, as for ``"1f1b"``.

    ```
    # 2 ranks, 2 chunks, 4 micro-batches ("@1": chunk 1):
    # rank 0: F0 F1 F0@1 F1@1 F2 B0@1 F3 B1@1 F2@1 B0 F3@1 B1 B2@1 B3@1 B2 B3
    # rank 1: F0 F1 FB0@1 FB1@1 F2 B0 F3 B1 FB2@1 FB3@1 B2 B3
    ```

    >>> [str(a) for a in interleaved_one_f_one_b(2, 2, 2)[1]]
    ['F0', 'F1', 'FB0@1', 'FB1@1', 'B0', 'B1']
    """
    _check(num_ranks, num_microbatches)
    check_count("num_chunks", num_chunks, "1: one stage a rank")
    if num_chunks == 1:  # (Megatron's warm-up counts 2 (P - r - 1) there: one chunk is plain 1F1B)
        return one_f_one_b(num_ranks, num_microbatches, split_backward, hold)
    check_whole_rounds(num_ranks, num_microbatches)
    p, v, m = num_ranks, num_chunks, num_microbatches
    total = m * v

    def step(k: int, forward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) of a rank: (chunk, micro-batch)."""
        chunk = (k % (p * v)) // p
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    schedule = []
    for r in range(p):
        warmup = total if m == p else min(total, 2 * (p - r - 1) + (v - 1) * p)
        order = [(FORWARD, k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [(FORWARD, warmup + k), (BACKWARD, k)]
        order += [(BACKWARD, k) for k in range(total - warmup, total)]
        actions = []
        for kind, k in order:
            chunk, i = step(k, kind is FORWARD)
            actions.append(act(kind, i, chunk=chunk))
        schedule.append(_fuse_last(actions, v - 1) if r == p - 1 else actions)
    bounds = [max_in_flight(actions) for actions in schedule]
    return _split(schedule, split_backward, _holdings(hold, bounds))


def _fuse_last(actions: list[Action], chunk: int) -> list[Action]:
    """The last virtual stage's backward runs with its forward: ``F i@c ... B i@c`` -> ``FB i@c``."""
    fused = []
    for action in actions:
        if action.chunk == chunk and action.kind is BACKWARD:
            continue
        if action.chunk == chunk and action.kind is FORWARD:
            action = Action(FORWARD_BACKWARD, action.microbatches, chunk)
        fused.append(action)
    return fused


def chunked_gpipe(
    placement: list[list[int]], num_microbatches: int, split_backward: bool = False, whole_batch_loss: bool = False
) -> list[list[Action]]:
    """Every chunk's forwards, chunk after chunk, then the backwards in the reverse order (GPipe over chunks).

    Each rank runs its actions in the order of (chunk, micro-batch), and
    every action's input comes from an earlier (chunk, micro-batch), so any
    placement runs without deadlock, for any number of micro-batches, at
    GPipe's memory. The last virtual stage runs each backward with its
    forward, unless ``whole_batch_loss``: then it too runs every forward
    first (``FH``).

    ```
    # 2 ranks, loop placement, 2 micro-batches:
    # rank 0: F0 F1 F0@1 F1@1 B0@1 B1@1 B0 B1
    # rank 1: F0 F1 FB0@1 FB1@1 B0 B1
    ```

    >>> [str(a) for a in chunked_gpipe(loop_placement(2, 2), 2)[0]]
    ['F0', 'F1', 'F0@1', 'F1@1', 'B0@1', 'B1@1', 'B0', 'B1']
    """
    _check(len(placement), num_microbatches)
    last = sum(map(len, placement)) - 1
    m = num_microbatches
    schedule = []
    for stages in placement:
        chunks = range(len(stages))
        actions = [act(FORWARD, i, chunk=c) for c in chunks for i in range(m)]
        actions += [act(BACKWARD, i, chunk=c) for c in reversed(chunks) for i in range(m)]
        fused = [c for c in chunks if stages[c] == last and not whole_batch_loss]
        schedule.append(_fuse_last(actions, fused[0]) if fused else actions)
    # (holding every micro-batch for one W a chunk, as GPipe does)
    everything = Holding(float(m * max(map(len, placement))) + 1)
    schedule = _split(schedule, split_backward, [everything] * len(placement))
    return _last_chunk_forwards(schedule, placement, FORWARD_HEAD) if whole_batch_loss else schedule


def chunked_forward_only(placement: list[list[int]], num_microbatches: int, last: Kind = FORWARD) -> list[list[Action]]:
    """Forwards only, chunk after chunk (evaluation and prediction with several chunks a rank).

    ``last``: what the last virtual stage runs, as for :func:`~keras_pipe.schedules.one_chunk.forward_only`.

    >>> [str(a) for a in chunked_forward_only(loop_placement(2, 2), 2)[0]]
    ['F0', 'F1', 'F0@1', 'F1@1']
    >>> [str(a) for a in chunked_forward_only(v_placement(2), 2, Kind.FORWARD_LOSS)[0]]
    ['F0', 'F1', 'FL0@1', 'FL1@1']
    """
    _check(len(placement), num_microbatches)
    chunks = range(len(placement[0]))
    schedule = [[act(FORWARD, i, chunk=c) for c in chunks for i in range(num_microbatches)] for _ in placement]
    return _last_chunk_forwards(schedule, placement, last)


def _last_chunk_forwards(schedule: list[list[Action]], placement: list[list[int]], kind: Kind) -> list[list[Action]]:
    """The forwards of the last virtual stage (wherever the placement puts it) as ``kind``."""
    last = sum(map(len, placement)) - 1
    return [
        _last_forwards(actions, kind, stages.index(last)) if last in stages else actions
        for actions, stages in zip(schedule, placement)
    ]
