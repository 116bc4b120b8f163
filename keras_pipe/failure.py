"""Failing fast: one rank's exception ends every rank, with a message naming it.

A pipeline rank that raises leaves its neighbours waiting for messages that
never come. Inside ``fit``/``evaluate``/``predict`` and the other collective
methods (the :func:`collective` decorator) and, through ``sys.excepthook``
once :func:`keras_pipe.init` has run, anywhere else in the script,
keras_pipe prints the error prefixed with the failing rank and calls
``MPI_Abort``, which makes the MPI launcher end every process with a
non-zero exit code.

A :class:`~keras_pipe.errors.CollectiveError` is raised alike on every rank
(a bad ``balance``, say): rank 0 prints it, once, and every rank exits
normally with status 1, no abort needed.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback

from mpi4py import MPI

from keras_pipe.errors import CollectiveError

_installed = False
# MPI_Abort makes the launcher kill every process at once, and Hydra may
# exit before it has forwarded what the aborting rank just wrote: the one
# message that says why the job died. A short, bounded pause lets it arrive.
FORWARD_GRACE_S = 1.0


def describe_failure(error: BaseException, where: str) -> str:
    comm = MPI.COMM_WORLD
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return f"[keras_pipe] rank {comm.Get_rank()} of {comm.Get_size()} (pid {os.getpid()}) failed in {where}:\n{text}"


def abort(error: BaseException, where: str) -> None:
    """Prints ``error`` naming this rank, then aborts the whole MPI job."""
    comm = MPI.COMM_WORLD
    sys.stderr.write(describe_failure(error, where))
    sys.stderr.write(f"[keras_pipe] rank {comm.Get_rank()} is aborting all {comm.Get_size()} ranks.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(FORWARD_GRACE_S)
    comm.Abort(1)
    os._exit(1)  # MPI_Abort may return before the launcher kills this process


_depth = 0  # collective methods running on this rank (fit() runs evaluate() inside)


def collective(method):
    """Decorates a method every rank calls together: agreed on entry; an error on one rank aborts the job.

    On entry to the outermost collective method, the ranks compare which
    method each called (:func:`keras_pipe.runtime.agree_on_entry`): a method
    called on some ranks only (``if rank == 0: model.save(...)``) is an error
    at once, not a wait for the stall timeout. A :class:`CollectiveError`
    (raised alike everywhere) propagates normally; anything else, with more
    than one rank, is printed naming this rank and the method, and the job
    is aborted, as the other ranks would otherwise wait for this one forever.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        global _depth
        from keras_pipe.runtime import agree_on_entry

        _depth += 1
        try:
            if _depth == 1:
                agree_on_entry(f"{method.__name__}()")
            return method(self, *args, **kwargs)
        except BaseException as error:
            if MPI.COMM_WORLD.Get_size() > 1 and not isinstance(error, CollectiveError):
                abort(error, f"{method.__name__}()")
            raise
        finally:
            _depth -= 1

    return wrapper


def install_excepthook() -> None:
    """Makes an uncaught exception on any rank end the whole job (as ``python -m mpi4py`` does)."""
    global _installed
    if _installed or MPI.COMM_WORLD.Get_size() == 1:
        return
    previous = sys.excepthook

    def hook(kind, error, tb):
        if isinstance(error, CollectiveError):
            # raised alike on every rank: said once, by rank 0, not interleaved once per rank
            if MPI.COMM_WORLD.Get_rank() == 0:
                sys.stderr.write(f"[keras_pipe] every rank of {MPI.COMM_WORLD.Get_size()} raised this error:\n")
                previous(kind, error, tb)
                sys.stderr.flush()
            return
        abort(error, "the script")

    sys.excepthook = hook
    _installed = True
