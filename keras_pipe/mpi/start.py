"""Starting MPI with a deadline: a rank that waits in ``MPI_Init`` for a rank that will never come ends itself.

Under MPICH, a rank that exits before it starts MPI (an error in a
script's first lines, before ``import keras_pipe``) leaves every other rank
inside ``MPI_Init``, waiting for it, and Hydra does not end the job: it
waits forever. ``MPI_Init`` holds Python's lock, so no Python code can
run until it returns; :mod:`faulthandler`'s watchdog is a C thread that
needs no lock. Armed for the start timeout (``KERAS_PIPE_START_TIMEOUT``,
30 s by default, counted from this rank's own ``MPI_Init``: ranks that
start together arrive within seconds of each other) around the import
that starts MPI, it prints where the rank waits (the function below,
whose name says why) and exits with status 1. The timer is cancelled
once MPI has started. It works where ``keras_pipe`` is imported before
``mpi4py`` (``python -m keras_pipe`` does so before the script's first
line); a script that imports ``mpi4py`` first has started MPI itself.

Imports nothing of MPI at module level: it runs before MPI exists.
"""

from __future__ import annotations

import faulthandler
import os
import sys

DEFAULT_START_TIMEOUT = 30.0


def start_timeout(environ=os.environ) -> float:
    """``KERAS_PIPE_START_TIMEOUT`` in seconds, the default where unset or unreadable (``stall`` says why later).

    >>> start_timeout({"KERAS_PIPE_START_TIMEOUT": "15"}), start_timeout({})
    (15.0, 30.0)
    """
    try:
        value = float(environ.get("KERAS_PIPE_START_TIMEOUT", "") or DEFAULT_START_TIMEOUT)
    except ValueError:
        return DEFAULT_START_TIMEOUT
    return value if value > 0 else DEFAULT_START_TIMEOUT


def start_mpi() -> None:
    """Imports ``mpi4py.MPI`` (which starts MPI) under a deadline of :func:`start_timeout` seconds."""
    if "mpi4py.MPI" in sys.modules:
        return
    stream = sys.__stderr__
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # (no real stderr: MPI is started without a deadline)
        stream = None
    if stream is not None:
        faulthandler.dump_traceback_later(start_timeout(), exit=True, file=stream)
    try:
        keras_pipe_waits_in_MPI_Init_for_the_other_ranks__one_probably_failed_before_starting_MPI__see_its_error()
    finally:
        if stream is not None:
            faulthandler.cancel_dump_traceback_later()


def keras_pipe_waits_in_MPI_Init_for_the_other_ranks__one_probably_failed_before_starting_MPI__see_its_error():  # noqa: N802
    """(Named for the traceback :func:`start_mpi`'s deadline prints: the one line a user reads.)"""
    from mpi4py import MPI  # noqa: F401
