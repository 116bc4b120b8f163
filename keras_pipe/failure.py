"""Failing fast: one rank's exception ends every rank, with a message naming it.

A pipeline rank that raises leaves its neighbours waiting for messages that
never come. Inside ``fit``/``evaluate``/``predict`` (and, through
``sys.excepthook``, anywhere else in the script) keras_pipe prints the error
prefixed with the failing rank and calls ``MPI_Abort``, which makes the MPI
launcher end every process with a non-zero exit code.

Errors that every rank raises alike before any communication (a bad
``balance``, say) are marked *collective*: each rank prints its own message
and exits normally with status 1, so the message appears once per rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

from mpi4py import MPI

_installed = False


def mark_collective(error: BaseException) -> BaseException:
    """Marks ``error`` as raised identically on every rank (no abort needed)."""
    error._keras_pipe_collective = True  # type: ignore[attr-defined]
    return error


def is_collective(error: BaseException) -> bool:
    return bool(getattr(error, "_keras_pipe_collective", False))


def describe_failure(error: BaseException, where: str) -> str:
    comm = MPI.COMM_WORLD
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return (
        f"[keras_pipe] rank {comm.Get_rank()} of {comm.Get_size()} (pid {os.getpid()}) failed in {where}: "
        f"{type(error).__name__}: {error}\n{text}"
    )


def abort(error: BaseException, where: str) -> None:
    """Prints ``error`` naming this rank, then aborts the whole MPI job."""
    comm = MPI.COMM_WORLD
    sys.stderr.write(describe_failure(error, where))
    sys.stderr.write(f"[keras_pipe] rank {comm.Get_rank()} is aborting all {comm.Get_size()} ranks.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    comm.Abort(1)
    os._exit(1)  # MPI_Abort may return before the launcher kills this process


@contextlib.contextmanager
def fail_fast(where: str):
    """Aborts the job when the block raises on this rank (when there are several ranks)."""
    try:
        yield
    except BaseException as error:
        if MPI.COMM_WORLD.Get_size() > 1 and not is_collective(error):
            abort(error, where)
        raise


def install_excepthook() -> None:
    """Makes an uncaught exception on any rank end the whole job (as ``python -m mpi4py`` does)."""
    global _installed
    if _installed or MPI.COMM_WORLD.Get_size() == 1:
        return
    previous = sys.excepthook

    def hook(kind, error, tb):
        if is_collective(error):
            sys.stderr.write(f"[keras_pipe] rank {MPI.COMM_WORLD.Get_rank()}: ")
            previous(kind, error, tb)
            sys.stderr.flush()
            return
        abort(error, "the script")

    sys.excepthook = hook
    _installed = True
