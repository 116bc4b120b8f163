"""Noticing a stuck or dead rank: what each process is doing, the answers other ranks ask for, the stall report.

Every wait of a :class:`~keras_pipe.mpi.comm.Communicator` polls; while it waits
it answers other ranks' questions (what it is doing, whether it went on
past a point where another rank raised) and looks for ranks of its host
whose process has gone. A rank that waits longer than the stall timeout
asks every other rank what it is doing and ends the job with one report,
one line per rank::

    rank 0: train step 3, stage 0: input gradient of micro-batch 2; waiting 600.0 s for a message
            (tag 12) from rank 1  <-- reporting
    rank 1: no answer within 5 s (pid 4242 on node7: dead, stuck outside keras_pipe, or failed
            before its first PipelineModel: see its own output)

>>> stall_timeout_from_env(environ={"KERAS_PIPE_STALL_TIMEOUT": "30"})
30.0
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from mpi4py import MPI

from keras_pipe.errors import PipelineStallError
from keras_pipe.mpi import start

TAG_STATUS_REQUEST = 21  # a stalled rank asks every other rank what it is doing
TAG_STATUS_REPLY = 22
TAG_FAILED = 23  # a rank that raised tells every other where (see failure.py)
TAG_ALIVE = 24  # and a rank already past that point answers that it did not raise there
_REPORT_GRACE_S = 5.0  # how long a stalled rank waits for the others' answers

DEFAULT_STALL_TIMEOUT = 600.0
# The ranks of a job start together and run the same script, so they reach
# their first PipelineModel within seconds of each other: the timer starts
# when a rank gets there, after its own imports, so only the difference
# between ranks counts (measured: under 3 s with 4 ranks importing
# TensorFlow on 2 busy cores). A rank that failed before (a typo in the
# first lines, a broken import) is then named within this long, not the
# stall timeout's ten minutes. Raise it (KERAS_PIPE_START_TIMEOUT) where
# ranks start far apart, e.g. from a slow shared filesystem.
DEFAULT_START_TIMEOUT = start.DEFAULT_START_TIMEOUT  # (also MPI_Init's deadline: keras_pipe.mpi.start)


def start_timeout_from_env(environ=os.environ) -> float:
    """``KERAS_PIPE_START_TIMEOUT`` in seconds (default :data:`DEFAULT_START_TIMEOUT`): the job's first rendezvous.

    >>> start_timeout_from_env(environ={})
    30.0
    """
    value = environ.get("KERAS_PIPE_START_TIMEOUT", "")
    if not value.strip():
        return DEFAULT_START_TIMEOUT
    return check_stall_timeout(value, "KERAS_PIPE_START_TIMEOUT")


def stall_timeout_from_env(default: float = DEFAULT_STALL_TIMEOUT, environ=os.environ) -> float:
    """``KERAS_PIPE_STALL_TIMEOUT`` in seconds, ``default`` when unset; a clear error naming it when invalid.

    >>> stall_timeout_from_env(environ={"KERAS_PIPE_STALL_TIMEOUT": "30"})
    30.0
    """
    value = environ.get("KERAS_PIPE_STALL_TIMEOUT", "")
    if not value.strip():
        return default
    return check_stall_timeout(value, "KERAS_PIPE_STALL_TIMEOUT")


def check_stall_timeout(value, name: str = "stall_timeout") -> float:
    """A stall timeout as a positive number of seconds; a ``PipelineConfigError`` naming ``name`` otherwise."""
    from keras_pipe.errors import PipelineConfigError

    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:  # also refuses NaN
        raise PipelineConfigError(
            f"{name}={value!r}: give the seconds a rank may wait for another before the job is ended as stuck, "
            f"a positive number (default {DEFAULT_STALL_TIMEOUT:g}; 'inf' never ends it)"
        )
    return seconds


class StallReports:
    """What a rank answers and asks, over one communicator, when a rank stalls or dies.

    Every :class:`~keras_pipe.mpi.comm.Communicator` holds one (``reports``);
    its waits use their root's, so that the questions and answers go over
    the communicator of every rank of the job, whichever one a rank waits on.

    Args:
        comm: the ``mpi4py`` communicator they travel on.
        shared: this process's record of what it is doing (:data:`PROCESS`), one
            for all its communicators.
        names_processes: whether a silent rank is named with its pid and host
            (on the job's root communicator, whose ranks ``shared.peers`` lists).
    """

    def __init__(self, comm, shared, names_processes: bool = True):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._shared = shared
        self._names_processes = names_processes

    def _status(self) -> dict:
        shared = self._shared
        status = {"rank": self.rank, "doing": shared.doing}
        if shared.waiting_for:
            status["waiting_for"] = shared.waiting_for
            status["waited_s"] = round(time.monotonic() - shared.wait_started, 1)
        return status

    def answer_status_requests(self) -> None:
        """Tells any stalled rank that asks what this rank is doing (JSON, no pickling)."""
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STATUS_REQUEST, status=status):
            source = status.Get_source()
            self.comm.Recv(np.empty(1, np.int64), source=source, tag=TAG_STATUS_REQUEST)
            reply = np.frombuffer(json.dumps(self._status()).encode(), np.uint8).copy()
            self._shared.replies.append((self.comm.Isend(reply, dest=source, tag=TAG_STATUS_REPLY), reply))
            self._shared.last_asked = time.monotonic()
            self._shared.asked_by.add(source)
        self._shared.replies = [(r, a) for r, a in self._shared.replies if not r.Test()]

    def set_peers(self, peers: list[tuple[str, int]]) -> None:
        """Every rank's (host, pid), so that a wait notices a rank of this host whose process has gone."""
        self._shared.peers = list(peers)

    def dead_peers(self) -> list[int]:
        """The ranks of this host whose process no longer exists (ranks elsewhere cannot be checked by pid)."""
        peers = self._shared.peers
        if not peers:
            return []
        host = peers[self.rank][0]
        return [r for r, (h, pid) in enumerate(peers) if h == host and r != self.rank and not _alive(pid)]

    def report_dead_peers(self, dead: list[int], what: str) -> None:
        """Raises :class:`PipelineStallError` naming the ranks of this host whose process has gone.

        A rank elsewhere that dies is found by the stall timeout. Every
        survivor of the host notices; the lowest reports first, and the
        others, asked by it for their status, leave the report to it.
        """
        shared = self._shared
        now = time.monotonic()
        shared.dead_since = shared.dead_since or now
        if now - shared.dead_since < 0.2 * self.rank or shared.someone_reporting(now):
            return
        names = ", ".join(f"rank {r} (pid {shared.peers[r][1]} on {shared.peers[r][0]})" for r in dead)
        report = self.stall_report(dead=dead)
        if report is None:
            return
        raise PipelineStallError(
            f"{names} stopped: its process no longer exists (killed by a signal, by the out-of-memory killer, or "
            f"it exited without keras_pipe noticing). Rank {self.rank} was waiting for {what} while {shared.doing}. "
            "What each rank was doing:\n" + report
        )

    def stall_report(self, dead: list[int] = ()) -> str | None:
        """Asks every other rank what it is doing; one line per rank (silent ranks marked).

        ``None`` when a lower rank asked this one meanwhile: it reports, once, for every rank.
        """
        asks = [np.zeros(1, np.int64) for _ in range(self.size)]
        requests = [
            self.comm.Isend(asks[r], dest=r, tag=TAG_STATUS_REQUEST)
            for r in range(self.size)
            if r != self.rank and r not in dead
        ]
        answers = {self.rank: self._status()}
        answers.update({r: {"rank": r, "doing": "dead: its process no longer exists"} for r in dead})
        deadline = time.monotonic() + _REPORT_GRACE_S
        status = MPI.Status()
        self._shared.asked_by.clear()
        while len(answers) < self.size and time.monotonic() < deadline:
            self.answer_status_requests()  # another stalled rank may be asking us
            if any(r < self.rank for r in self._shared.asked_by):
                for request in requests:  # a lower rank reports (one report, not one per rank)
                    if not request.Test():
                        request.Cancel()
                return None
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STATUS_REPLY, status=status):
                payload = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                self.comm.Recv(payload, source=status.Get_source(), tag=TAG_STATUS_REPLY)
                answer = json.loads(bytes(payload))
                answers[int(answer["rank"])] = answer
            else:
                time.sleep(0.01)
        for request in requests:
            if not request.Test():
                request.Cancel()
        lines = []
        for rank in range(self.size):
            answer = answers.get(rank)
            if answer is None:
                lines.append(
                    f"  rank {rank}: no answer within {_REPORT_GRACE_S:g} s ({self._where(rank)}dead, stuck "
                    "outside keras_pipe, or failed before its first PipelineModel: see its own output)"
                )
                continue
            line = f"  rank {rank}: {answer['doing']}"
            if "waiting_for" in answer:
                line += f"; waiting {answer['waited_s']} s for {answer['waiting_for']}"
            lines.append(line + ("  <-- reporting" if rank == self.rank else ""))
        return "\n".join(lines)

    def _where(self, rank: int) -> str:
        peers = self._shared.peers
        return f"pid {peers[rank][1]} on {peers[rank][0]}: " if peers and self._names_processes else ""


class _SharedState:
    """What this process is doing, shared by all of its communicators (one per process: :data:`PROCESS`)."""

    def __init__(self):
        self.collectives = 0  # collectives of every rank of the job completed here (see failure.verify)
        self.in_step = False  # inside a step's actions (messages in flight)
        self.met = False  # whether the ranks have met once (topology.connect's first rendezvous)
        # rank -> its announcements not yet answered, oldest first: [collectives, in step, error digest] each.
        # A queue, not the latest: a rank whose collective error is caught and raised anew (a callback
        # wrapping load_weights' error) announces twice, and its second may arrive while this rank still
        # hears the first; each round of failure.verify takes one announcement a rank.
        self.failures: dict[int, list[list]] = {}
        self.answered: set[int] = set()  # failed ranks told that this one went on past their point
        self.failing = False  # this rank is finding out whether the others raised too
        self.asked_by: set[int] = set()  # ranks that asked for this one's status (during a report)
        self.doing = "idle"
        self.waiting_for = ""
        self.wait_started = 0.0
        self.replies: list = []
        self.peers: list[tuple[str, int]] = []  # every world rank's (host, pid)
        self.last_asked = -float("inf")  # when another rank last asked for this one's status
        self.dead_since = 0.0

    def someone_reporting(self, now: float) -> bool:
        """Whether another rank is writing a stall report (it asked this one lately): one report, not one per rank."""
        return now - self.last_asked < _REPORT_GRACE_S + 5.0


PROCESS = _SharedState()


def note_failures() -> None:
    """Takes in other ranks' failure announcements; tells each whose point this rank has passed that it went on.

    A rank that raised announces how many job-wide collectives it had
    completed (:func:`keras_pipe.mpi.failure.verify`). This rank, while waiting,
    answers "alive" once it has completed at least as many: it is past the
    point where the other raised and did not raise there, so the failure is
    that rank's alone and it ends the job. A rank still behind stays silent:
    it may yet raise the same error at the same point.
    """
    world = MPI.COMM_WORLD
    status = MPI.Status()
    while world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_FAILED, status=status):
        source = status.Get_source()
        announced = np.empty(3, np.int64)
        world.Recv(announced, source=source, tag=TAG_FAILED)
        PROCESS.failures.setdefault(source, []).append(announced.tolist())
    if PROCESS.failing:
        return  # this rank raised too: its own announcement answers
    for rank, announcements in list(PROCESS.failures.items()):
        if announcements and rank not in PROCESS.answered and PROCESS.collectives >= announcements[0][0]:
            reply = np.array([PROCESS.collectives], np.int64)
            PROCESS.replies.append((world.Isend(reply, dest=rank, tag=TAG_ALIVE), reply))
            PROCESS.answered.add(rank)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (of this host) exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): it exists
