"""Internal: several model chunks on one rank (virtual stages) — where each lives and how they talk.

With ``num_chunks = v`` the model is cut into ``V = P * v`` virtual stages
and rank ``r`` holds ``v`` of them (its *chunks*), as the schedule's
placement says (:mod:`keras_pipe.schedules.virtual`)::

    # interleaved 1F1B, 2 ranks, 2 chunks (loop placement):  rank 0: 0, 2   rank 1: 1, 3
    # ZB-V, 2 ranks (V placement, the loss on rank 0):       rank 0: 0, 3   rank 1: 1, 2

Each chunk has its own compute and its own links; the links address
virtual stages, and :class:`ChunkComm` turns a virtual stage into the rank
that holds it. Two virtual stages may talk over the same pair of ranks (0 -> 1
and 2 -> 3 above), and the schedule interleaves their messages, so each
ordered pair of virtual stages has tags of its own: MPI then keeps each
pair's messages in order, as it keeps a stage's with one chunk a rank. A
chunk that sends to a chunk on its own rank (ZB-V's turn at the last rank)
hands the tensor over in a :class:`Mailbox` the rank's chunks share, in the
same order MPI would keep: no copy to the host and back (on a GPU, two
transfers over the bus a message), and a receive with nothing handed over
is a clear error at once instead of a wait.

Example:

>>> ranks = ranks_of_virtual_stages([[0, 3], [1, 2]])
>>> ranks
[0, 1, 1, 0]
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import numpy as np

from keras_pipe.errors import PipelineConfigError

TAG_SPAN = 16  # the base tags of comm.py (activations, gradients, targets, probe) are all below it


class Chunk(NamedTuple):
    """One virtual stage a rank holds: its compute, its links and its place in the whole pipeline."""

    compute: Any
    links: Any
    is_first: bool  # reads the model inputs
    is_last: bool  # computes the outputs and the loss


def ranks_of_virtual_stages(placement: list[list[int]]) -> list[int]:
    """``placement[r][c]`` (the virtual stage of rank ``r``'s chunk ``c``) turned around: each virtual stage's rank."""
    ranks = {k: r for r, stages in enumerate(placement) for k in stages}
    if sorted(ranks) != list(range(len(ranks))):
        raise PipelineConfigError(f"the placement {placement} does not hold each virtual stage once")
    return [ranks[k] for k in range(len(ranks))]


class Mailbox:
    """What a rank's chunks hand each other: per tag (one per kind and ordered pair of virtual stages), in order."""

    def __init__(self):
        self._queues: dict[int, deque] = {}

    def post(self, tag: int, value) -> None:
        self._queues.setdefault(tag, deque()).append(value)

    def take(self, tag: int, source: int, me: int):
        queue = self._queues.get(tag)
        if not queue:
            raise RuntimeError(
                f"internal error: virtual stage {me} reads a message of virtual stage {source}, on the same rank, "
                "before it was sent (the schedule orders a receive before its send); please report it"
            )
        return queue.popleft()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())


class ChunkComm:
    """The pipeline's communicator as one virtual stage's links see it: a rank is a virtual stage.

    Args:
        comm: the pipeline's :class:`~keras_pipe.mpi.comm.Communicator`.
        ranks: each virtual stage's rank in ``comm``.
        me: this chunk's virtual stage.
        mailbox: the :class:`Mailbox` of this rank's chunks (``None``: every message through ``comm``).
    """

    def __init__(self, comm, ranks: list[int], me: int, mailbox: Mailbox | None = None):
        self.comm = comm
        self.ranks = list(ranks)
        self.me = me
        self.size = len(ranks)
        self.mailbox = mailbox
        highest = self._tag(TAG_SPAN - 1, self.size - 1, self.size - 1)
        bound = comm.tag_upper_bound() if hasattr(comm, "tag_upper_bound") else None
        if bound is not None and highest > bound:
            raise PipelineConfigError(
                f"{self.size} virtual stages need message tags up to {highest}, but this MPI allows {bound}: "
                "use fewer chunks a rank (num_chunks) or fewer ranks a pipeline (num_stages)."
            )

    @property
    def world_rank(self) -> int:
        return self.comm.world_rank

    def world_rank_of(self, stage: int) -> int:
        return self.comm.world_rank_of(self.ranks[stage])

    def is_local(self, stage: int) -> bool:
        """Whether virtual stage ``stage`` is held by this rank too (its messages go through the mailbox)."""
        return self.mailbox is not None and self.ranks[stage] == self.ranks[self.me]

    def hand_over(self, value, dest: int, tag: int) -> None:
        """Gives ``value`` (a tensor, as it is) to virtual stage ``dest`` of this rank."""
        self.mailbox.post(self._tag(tag, self.me, dest), value)

    def take(self, source: int, tag: int):
        """The next value virtual stage ``source`` of this rank handed over with ``tag``."""
        return self.mailbox.take(self._tag(tag, source, self.me), source, self.me)

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        self.comm.send(array, self.ranks[dest], self._tag(tag, self.me, dest))

    def recv(self, source: int, tag: int, trailing_shape: tuple, dtype) -> np.ndarray:
        return self.comm.recv(self.ranks[source], self._tag(tag, source, self.me), trailing_shape, dtype)

    def recv_exact(self, source: int, tag: int, shape: tuple, dtype) -> np.ndarray:
        return self.comm.recv_exact(self.ranks[source], self._tag(tag, source, self.me), shape, dtype)

    def progress(self) -> None:
        self.comm.progress()

    def flush(self) -> None:
        self.comm.flush()

    def _tag(self, tag: int, source: int, destination: int) -> int:
        """A tag of its own for each (kind, source virtual stage, destination virtual stage)."""
        return tag + TAG_SPAN * (1 + source * self.size + destination)
