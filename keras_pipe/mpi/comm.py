"""Point-to-point and collective communication between stages, over mpi4py.

Tensors cross ranks as raw bytes of a shape and dtype the receiver already
knows (only the batch dimension is read from the message size); nothing a
peer sends is ever unpickled. Sends are non-blocking and overlap the next
computation. A rank that waits polls with a growing sleep instead of calling
a blocking ``Recv``, which in MPICH spins a whole core, and gives up with a
:class:`PipelineStallError` after ``stall_timeout`` seconds (what it answers
and reports meanwhile: :mod:`keras_pipe.mpi.stall`).

Set ``KERAS_PIPE_DEBUG=1`` to print every send and receive, prefixed with the rank.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
import weakref

import numpy as np
from mpi4py import MPI

from keras_pipe.errors import PipelineStallError
from keras_pipe.mpi import stall
from keras_pipe.mpi.stall import PROCESS, StallReports, check_stall_timeout, stall_timeout_from_env

# Message tags. MPI keeps messages of one (source, tag) pair in order, so
# micro-batches need no tag of their own.
TAG_ACTIVATION = 11
TAG_GRADIENT = 12
TAG_TARGETS = 13
TAG_STATE = 14  # weights and optimizer state on their way to or from rank 0
TAG_PROBE = 15  # the first batch's real forward, every message describing itself (see probe.py)
TAG_GENERATION = 16  # generate(): a group's hidden states to the next rank (none: the group is done)
TAG_TOKENS = 17  # generate(): a group's next tokens, and whether it stops, back to the first rank
# (tags 21-24, the stall reports' and the failure checks': keras_pipe.mpi.stall)

# Poll without sleeping this long before backing off: 2 ms where every rank
# of the host has a core of its own (a sleep costs ~60-80 us of wake-up
# latency on every message, and spinning takes no core another rank needs;
# small model of benchmarks/throughput.py, 2 ranks, m = 4: 7.4 -> 5.8 ms a step), 50 us
# where ranks share cores.
_SPIN_S = None
# A gradient all-reduce moves data in rounds, each needing a poll on both
# sides (MPI progresses only inside MPI calls): sleeping between polls
# multiplies its time (17 MB in 34 weights: 46 ms sleeping, 12 ms with this
# spin; benchmarks/step_spans.py --collective-spin). The replicas of a stage reach it at about the
# same time, so it polls without sleeping for this long before backing off.
COLLECTIVE_SPIN_S = 0.02
# The longest sleep between polls grows with the time already waited: a
# neighbour's micro-batch takes milliseconds, so early on the added latency
# must stay small; after a second, a few ms more no longer matter and the
# CPU a waiting rank burns does (10 s of waiting costs < 0.1 s of CPU).
_SLEEP_CEILINGS = ((0.05, 200e-6), (1.0, 1e-3), (float("inf"), 10e-3))  # (waited below, longest sleep)


def debug_enabled() -> bool:
    return os.environ.get("KERAS_PIPE_DEBUG", "") not in ("", "0")


class Communicator:
    """The pipeline's view of an MPI communicator.

    Its waits poll, and meanwhile answer other ranks' questions and notice a
    stalled or dead rank through ``reports``, the
    :class:`~keras_pipe.mpi.stall.StallReports` of the job's root communicator.

    Example:

    >>> comm = Communicator()          # doctest: +SKIP
    >>> comm.send(np.ones((4, 8), "float32"), dest=1, tag=TAG_ACTIVATION)  # doctest: +SKIP
    """

    def __init__(self, comm: MPI.Comm | None = None, stall_timeout: float | None = None, parent=None):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.stall_timeout = stall_timeout_from_env() if stall_timeout is None else check_stall_timeout(stall_timeout)
        self._pending: list[tuple[MPI.Request, np.ndarray]] = []
        # Stall reports always go over the parent (world) communicator, and
        # what this rank is doing is one shared record, whichever of its
        # communicators it is waiting on.
        self._parent = parent
        self._shared = PROCESS
        self.reports = StallReports(self.comm, PROCESS, names_processes=parent is None)
        self._world_spanning = self.size == MPI.COMM_WORLD.Get_size()
        _OPEN.add(self)
        self._world_ranks = None
        if parent is not None:
            group, parent_group = self.comm.Get_group(), parent.comm.Get_group()
            self._world_ranks = list(MPI.Group.Translate_ranks(group, list(range(self.size)), parent_group))
            group.Free()
            parent_group.Free()
        self._debug = debug_enabled()

    def split(self, color: int, key: int) -> Communicator:
        """A communicator over the ranks passing the same ``color``, ordered by ``key`` (collective).

        Its waits answer and send stall reports over this communicator, so a
        rank stuck on any of them is reported with every rank of the job.
        """
        root = self._parent or self
        return Communicator(created(self.comm.Split(color, key)), self.stall_timeout, parent=root)

    @property
    def doing(self) -> str:
        """What this rank is doing, for stall reports."""
        return self._shared.doing

    @doing.setter
    def doing(self, text: str) -> None:
        self._shared.doing = text

    @property
    def in_step(self) -> bool:
        """Whether this rank is inside a step's actions (with messages in flight), for failure checks."""
        return self._shared.in_step

    @in_step.setter
    def in_step(self, value: bool) -> None:
        self._shared.in_step = value

    @property
    def world_rank(self) -> int:
        return (self._parent or self).rank

    def world_rank_of(self, rank: int) -> int:
        """The world rank of this communicator's ``rank`` (for messages users read)."""
        return rank if self._world_ranks is None else self._world_ranks[rank]

    # -- point to point -------------------------------------------------

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        """Starts sending ``array`` to ``dest``; returns at once."""
        array = np.ascontiguousarray(array)
        self._log(f"send {_shape_text(array)} tag {tag} -> rank {self.world_rank_of(dest)}")
        request = self.comm.Isend([array.reshape(-1).view(np.uint8), MPI.BYTE], dest=dest, tag=tag)
        self._pending.append((request, array))
        self.progress()

    def recv(self, source: int, tag: int, trailing_shape: tuple, dtype) -> np.ndarray:
        """Receives an array of shape ``(n,) + trailing_shape``; ``n`` comes from the message size."""
        dtype = np.dtype(dtype)
        status = MPI.Status()
        message = self._wait_for(
            lambda: self.comm.Improbe(source=source, tag=tag, status=status),
            f"a message (tag {tag}) from rank {self.world_rank_of(source)}",
        )
        nbytes = status.Get_count(MPI.BYTE)
        row = dtype.itemsize * int(np.prod(trailing_shape, dtype=np.int64))
        if row == 0 or nbytes % row:
            raise ValueError(
                f"rank {self.world_rank} received {nbytes} bytes from rank {self.world_rank_of(source)} (tag {tag}), "
                f"which is not a whole "
                f"number of rows of shape {tuple(trailing_shape)} and dtype {dtype.name}: the ranks disagree "
                "on the model or the data."
            )
        array = aligned_empty((nbytes // row,) + tuple(trailing_shape), dtype)  # (wrapped without a copy)
        request = message.Irecv([array.reshape(-1).view(np.uint8), MPI.BYTE])
        sender = self.world_rank_of(source)
        self._wait_for(lambda: request.Test(), f"the rest of a message (tag {tag}) from rank {sender}")
        self._log(f"recv {_shape_text(array)} tag {tag} <- rank {sender}")
        return array

    def recv_exact(self, source: int, tag: int, shape: tuple, dtype) -> np.ndarray:
        """Receives an array whose whole shape is known (scalars included)."""
        flat = self.recv(source, tag, (), dtype)
        if flat.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(
                f"rank {self.world_rank} expected {shape} from rank {self.world_rank_of(source)}"
                f", got {flat.size} values"
            )
        return flat.reshape(shape)

    def tag_upper_bound(self) -> int:
        """The largest message tag this MPI allows (at least 32767, as the standard says)."""
        bound = self.comm.Get_attr(MPI.TAG_UB)
        return 32767 if bound is None else int(bound)

    def progress(self) -> None:
        """Lets MPI progress pending sends and frees the finished ones."""
        if self._pending:
            self._pending = [(r, a) for r, a in self._pending if not r.Test()]

    def flush(self) -> None:
        """Waits until every pending send has completed."""
        while self._pending:
            request = self._pending[0][0]
            self._wait_for(request.Test, "a send to complete")
            self._pending.pop(0)

    # -- collectives ----------------------------------------------------

    def allreduce_sum(self, values: np.ndarray, what: str = "the other ranks to finish the step (allreduce)"):
        """Element-wise sum of a float64 vector over all ranks; ``what`` names the wait in stall reports."""
        send = np.ascontiguousarray(values, dtype=np.float64)
        recv = np.empty_like(send)
        request = self.comm.Iallreduce(send, recv, op=MPI.SUM)
        self._wait_collective(lambda: request.Test(), what)
        return recv

    def start_allreduce_sum(self, arrays: list[np.ndarray], results: list[np.ndarray] | None = None) -> list:
        """Starts summing each array over all ranks; :meth:`wait_all` finishes.

        The sums go into ``results`` (same shapes), or in place when it is
        ``None``. One non-blocking all-reduce per array, started in the given
        order; MPI only reads ``arrays`` when ``results`` are given, so they
        may be read-only views (of a TensorFlow tensor, say), kept alive by
        the caller until the requests complete.
        """
        requests = []
        for index, array in enumerate(arrays):
            if results is None:
                if not array.flags.c_contiguous or not array.flags.writeable:
                    raise ValueError("an in-place all-reduce needs writable contiguous arrays")
                requests.append(self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM))
            else:
                requests.append(self.comm.Iallreduce(np.ascontiguousarray(array), results[index], op=MPI.SUM))
        return requests

    def wait_all(self, requests: list, what: str, spin_s: float | None = None) -> None:
        """Waits until every request has completed: polling for ``spin_s``, then sleeping, with stall reports.

        ``spin_s`` defaults to the module's ``COLLECTIVE_SPIN_S``, read at each call.
        """
        spin_s = COLLECTIVE_SPIN_S if spin_s is None else spin_s
        self._wait_collective(lambda: MPI.Request.Testall(requests), what, spin_s)

    def allgather_rows(self, array: np.ndarray, counts: list[int]) -> np.ndarray:
        """Concatenates each rank's ``array`` (``counts[rank]`` rows, the same trailing shape) in rank order."""
        array = np.ascontiguousarray(array)
        row = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
        gathered = np.empty((sum(counts),) + array.shape[1:], array.dtype)
        sizes = np.asarray(counts, np.int64) * row
        displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        request = self.comm.Iallgatherv(
            [array.reshape(-1).view(np.uint8), MPI.BYTE],
            [gathered.reshape(-1).view(np.uint8), (sizes, displacements), MPI.BYTE],
        )
        self._wait_collective(request.Test, "the other replicas (allgather)")
        return gathered

    def allgather_json(self, obj, timeout: float | None = None) -> list:
        """Every rank's JSON-serialisable ``obj``, in rank order (no pickling).

        ``timeout``: the stall timeout of this one call (the job's first rendezvous has its own).
        """
        payload = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
        sizes = np.empty(self.size, np.int64)
        request = self.comm.Iallgather(np.array([payload.size], np.int64), sizes)
        self._wait_collective(lambda: request.Test(), "the other ranks (allgather)", timeout=timeout)
        gathered = np.empty(int(sizes.sum()), np.uint8)
        displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        request = self.comm.Iallgatherv(payload, [gathered, (sizes, displacements), MPI.BYTE])
        self._wait_collective(lambda: request.Test(), "the other ranks (allgather)")
        return [json.loads(bytes(gathered[o : o + n])) for o, n in zip(displacements, sizes)]

    def allgather_array(self, array: np.ndarray) -> np.ndarray:
        """Every rank's equally shaped ``array``, stacked in rank order."""
        array = np.ascontiguousarray(array)
        gathered = np.empty((self.size,) + array.shape, array.dtype)
        request = self.comm.Iallgather(array, gathered)
        self._wait_collective(request.Test, "the other ranks (allgather)")
        return gathered

    def bcast_json(self, obj, root: int):
        """``obj`` from ``root``, on every rank (JSON, no pickling)."""
        return self.allgather_json(obj if self.rank == root else None)[root]

    def bcast_array(self, array: np.ndarray, root: int) -> np.ndarray:
        """Broadcasts an array whose shape and dtype every rank already knows."""
        array = np.ascontiguousarray(array).reshape(np.shape(array))  # (ascontiguousarray makes 0-d arrays 1-d)
        request = self.comm.Ibcast([array.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
        self._wait_collective(lambda: request.Test(), f"a broadcast from rank {root}")
        return array

    def barrier(self) -> None:
        request = self.comm.Ibarrier()
        self._wait_collective(lambda: request.Test(), "the other ranks (barrier)")

    # -- waiting --------------------------------------------------------

    def _wait_collective(self, poll, what: str, spin_s: float | None = None, timeout: float | None = None):
        """``_wait_for`` a collective; counts it if every rank of the job takes part (see ``failure.verify``)."""
        result = self._wait_for(poll, what, spin_s, timeout)
        if self._world_spanning:
            self._shared.collectives += 1
        return result

    def _wait_for(self, poll, what: str, spin_s: float | None = None, timeout: float | None = None):
        """Calls ``poll`` until it returns something truthy, sleeping more and more between calls after ``spin_s``.

        Every 0.1 s it answers other ranks' questions (a stall report, a
        failure's check) and looks for dead peers; after ``timeout`` (default
        the stall timeout) it ends the job with a report.
        """
        timeout = self.stall_timeout if timeout is None else timeout
        if spin_s is None:
            spin_s = point_to_point_spin()
        result = poll()
        if result:
            return result
        start = time.monotonic()
        sleep = 0.0
        shared = self._shared
        shared.waiting_for = what
        shared.wait_started = start
        reports = (self._parent or self).reports
        next_status_check = start + 0.1
        while True:
            result = poll()
            if result:
                shared.waiting_for = ""
                return result
            now = time.monotonic()
            waited = now - start
            if now > next_status_check:
                reports.answer_status_requests()
                stall.note_failures()
                dead = reports.dead_peers()
                if dead and not poll():  # (a peer that finished may have sent what we wait for)
                    reports.report_dead_peers(dead, what)
                next_status_check = now + 0.1
            if waited > timeout and not shared.someone_reporting(now):
                report = reports.stall_report()
                if report is not None:  # (else a lower rank is reporting, and ends the job)
                    raise PipelineStallError(
                        f"rank {reports.rank} waited {waited:.0f} s for {what} while {self.doing}; the "
                        + (
                            f"stall timeout is {timeout:g} s (KERAS_PIPE_STALL_TIMEOUT or PipelineModel("
                            "stall_timeout=...))"
                            if timeout == self.stall_timeout
                            else f"ranks of a job reach their first PipelineModel within {timeout:g} s of each "
                            "other (KERAS_PIPE_START_TIMEOUT)"
                        )
                        + ". A rank is stuck or has died. What each rank was doing:\n"
                        + report
                    )
            if waited > spin_s:
                ceiling = next(longest for below, longest in _SLEEP_CEILINGS if waited < below)
                sleep = min(ceiling, max(sleep * 2, 20e-6))
                time.sleep(sleep)

    def _log(self, text: str) -> None:
        if self._debug:
            print(f"[keras_pipe rank {self.world_rank}] {text} ({self.doing})", file=sys.stderr, flush=True)


def point_to_point_spin() -> float:
    """Seconds a wait polls before it sleeps (see ``_SPIN_S``)."""
    global _SPIN_S
    if _SPIN_S is None:
        from keras_pipe.mpi.threads import cores_to_spare

        _SPIN_S = 2e-3 if cores_to_spare() else 50e-6
    return _SPIN_S


_CREATED: list = []  # the MPI communicators keras_pipe made (split, duplicated), freed at exit


def created(comm):
    """Registers a communicator keras_pipe made, so that it is freed before MPI finalizes (MPICH warns otherwise)."""
    _CREATED.append(comm)
    return comm


_OPEN: weakref.WeakSet = weakref.WeakSet()  # every Communicator, whose sends' requests are released at exit


@atexit.register
def _free_created() -> None:
    # (registered when this module is imported, after mpi4py's own exit hook: it runs before MPI finalizes)
    for communicator in list(_OPEN):
        communicator.progress()  # completed sends still hold their requests until tested
    while _CREATED:
        comm = _CREATED.pop()
        try:
            if comm != MPI.COMM_NULL:
                comm.Free()
        except MPI.Exception:
            pass


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary.

    TensorFlow can wrap such a buffer without copying it (DLPack), which it
    refuses for numpy's default 16-byte alignment.
    """
    dtype = np.dtype(dtype)
    raw = np.empty(math.prod(shape) * dtype.itemsize + alignment, np.uint8)
    offset = (-raw.__array_interface__["data"][0]) % alignment
    return np.ndarray(shape, dtype, buffer=raw, offset=offset)


def _shape_text(array: np.ndarray) -> str:
    return f"{array.dtype.name}{list(array.shape)}"
