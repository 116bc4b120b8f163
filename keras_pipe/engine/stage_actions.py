"""Internal: which actions this rank runs for a batch: its stage's (or chunks') schedule, resolved once a configuration.

A schedule (:mod:`keras_pipe.schedules.schedule`) is plain data for every stage; a
rank runs its own row, adjusted to what its stage can do: a stage that
cannot split its backward (a Keras mask crosses it, or it recomputes) runs
``B`` where the schedule says ``I`` and has no ``W``; a mean loss over a
masked output trains in GPipe's order (the last stage counts the whole
batch before its first backward: ``FH``); evaluation and prediction run
forwards only (the last stage's ``FL`` computes the loss too). The row is
then lowered (:func:`keras_pipe.schedules.lowering.lower_rank`): its sends
and receives become actions, and that list is what the executor runs. The
result is cached per phase, number of micro-batches and what holding a
micro-batch for its ``W`` costs.
"""

from __future__ import annotations

from keras_pipe.schedules import one_chunk, schedule
from keras_pipe.schedules.actions import Action, Holding, Kind
from keras_pipe.schedules.lowering import lower_rank


class StageActions:
    """Which actions this rank runs for a batch (an :class:`~keras_pipe.engine.engine.Engine` holds one).

    ``schedule`` is the schedule's name, ``picker`` what ``"auto"`` runs
    (``None`` otherwise), ``stage`` this rank's place in a pipeline of
    ``num_stages``, and ``placement`` which virtual stages each rank's
    ``num_chunks`` chunks hold.
    """

    def __init__(self, schedule: str, picker, num_stages: int, stage: int, num_chunks: int, placement: list):
        self.schedule = schedule
        self.picker = picker
        self.num_stages = num_stages
        self.stage = stage
        self.num_chunks = num_chunks
        self.placement = placement
        self._schedules: dict = {}

    def forget(self) -> None:
        """Drops the resolved actions (the stage was rebuilt, or what it can split changed)."""
        self._schedules.clear()

    def training_schedule(self) -> str:
        """The schedule the next training step runs: ``schedule``, or what ``"auto"`` runs or has picked."""
        return self.schedule if self.picker is None else self.picker.current()

    def for_batch(self, chunks: list, phase: str, num_microbatches: int, whole_batch_loss: bool = False) -> list:
        """This stage's actions, with its messages, for a batch of ``num_microbatches`` (resolved once a configuration).

        ``chunks``: the rank's :class:`~keras_pipe.engine.chunks.Chunk` list (one, but with a chunked schedule).

        ``whole_batch_loss`` (a mean loss over a masked output) trains in
        GPipe's order whatever the schedule: the last stage must count the
        whole batch's unmasked entries before its first backward.
        """
        if self.num_chunks > 1:
            return self._chunked_actions(chunks, phase, num_microbatches, whole_batch_loss)
        compute = chunks[0].compute
        # What holding a micro-batch for its W costs is estimated from the shapes, or measured on
        # the first step, which runs each W right after its I; then the schedule holds what fits
        # (schedule.hold_for). (In the key: compile() may change what is trainable.)
        sizes = None
        if phase == "train" and compute.split and compute.held_bytes is not None:
            sizes = (compute.weight_bytes, compute.held_bytes, compute.kept_bytes)
        key = (phase, num_microbatches, compute.split, whole_batch_loss, sizes, self.training_schedule())
        if key not in self._schedules:
            hold = None
            if phase == "train" and compute.split:
                if sizes is None:
                    hold = {self.stage: Holding(cost=float("inf"))}
                else:
                    hold = {self.stage: schedule.hold_for(*sizes, num_microbatches)}
            if phase != "train":
                plan = one_chunk.forward_only(self.num_stages, num_microbatches, _last_forward(phase, whole_batch_loss))
            elif whole_batch_loss:
                plan = one_chunk.gpipe(self.num_stages, num_microbatches, compute.split, whole_batch_loss=True)
            else:
                name = self.training_schedule()
                split = compute.split or schedule.needs_split_backward(name)
                plan = schedule.make_schedule(name, self.num_stages, num_microbatches, split, hold)
            actions = plan[self.stage]
            if phase == "train" and not compute.split:
                actions = _unsplit(actions)
            self._schedules[key] = self._lowered(actions)
        return self._schedules[key]

    def _chunked_actions(self, chunks: list, phase: str, num_microbatches: int, whole_batch_loss: bool) -> list:
        """:meth:`for_batch` with several chunks a rank: the chunked schedule, each ``W`` within its own bound.

        A batch that interleaved 1F1B cannot take (micro-batches not a multiple
        of the ranks: the last, short batch) and a loss over the whole batch
        run :func:`~keras_pipe.schedules.virtual.chunked_gpipe`: the same result, GPipe's
        memory. A chunk that cannot split its backward (a Keras mask crosses
        it, or it recomputes) runs ``B`` where the schedule says ``I``.
        """
        from keras_pipe.schedules import virtual

        split = [chunk.compute.split for chunk in chunks]
        key = (phase, num_microbatches, tuple(split), whole_batch_loss)
        if key not in self._schedules:
            p, m, v = self.num_stages, num_microbatches, self.num_chunks
            name = self.schedule
            any_split = any(split) or schedule.needs_split_backward(name)
            if phase != "train":
                plan = virtual.chunked_forward_only(self.placement, m, _last_forward(phase, whole_batch_loss))
            elif whole_batch_loss or (
                schedule.needs_whole_rounds(name) and not virtual.whole_rounds(p, m)
            ):  # (a short batch)
                plan = virtual.chunked_gpipe(self.placement, m, any_split, whole_batch_loss)
            else:
                plan = schedule.make_schedule(name, p, m, any_split, num_chunks=v)
            actions = plan[self.stage]
            if phase == "train":
                actions = _unsplit(actions, [c for c, s in enumerate(split) if not s])
            self._schedules[key] = self._lowered(actions)
        return self._schedules[key]

    def _lowered(self, actions: list) -> list:
        """This rank's ``actions`` with its sends and receives (see :mod:`keras_pipe.schedules.lowering`)."""
        return lower_rank(actions, self.placement[self.stage], sum(map(len, self.placement)))


def _last_forward(phase: str, whole_batch_loss: bool) -> Kind:
    """What the last stage's forwards are outside training: with the loss (evaluation), or not (prediction)."""
    if whole_batch_loss:
        return Kind.FORWARD_HEAD  # (each micro-batch's terms summed, divided once the whole batch is counted)
    return Kind.FORWARD_LOSS if phase == "test" else Kind.FORWARD


def _unsplit(actions: list, chunks=None) -> list:
    """A schedule with a split backward, for a stage that cannot split: I -> B, FI -> FB, no W.

    ``chunks``: only those chunks' actions (``None``: every action).
    """
    renamed = {
        Kind.BACKWARD_INPUT: Kind.BACKWARD,
        Kind.FORWARD_INPUT: Kind.FORWARD_BACKWARD,
    }
    result = []
    for a in actions:
        if chunks is not None and a.chunk not in chunks:
            result.append(a)
        elif a.kind is not Kind.BACKWARD_WEIGHT:
            result.append(Action(renamed.get(a.kind, a.kind), a.microbatches, a.chunk))
    return result
