"""The process-wide lifecycle: what keras_pipe sets up once, and when.

Importing keras_pipe communicates with no other rank. It sizes
TensorFlow's thread pools from the launcher's environment (see
:mod:`keras_pipe.threads`), as that must happen before TensorFlow's first
op. :func:`init` installs the failure hook that ends the whole job when any
rank raises; the first ``PipelineModel`` calls it, and a script may call it
first thing to cover its own first lines too.
"""

from __future__ import annotations

import atexit
import os
import sys

from mpi4py import MPI

from keras_pipe.errors import RankMismatchError
from keras_pipe.failure import install_excepthook
from keras_pipe.threads import configure_threads

_entries = None  # the communicator collective methods agree on, once a model exists


def init() -> None:
    """Prepares this process for keras_pipe (idempotent, no communication).

    Sizes TensorFlow's thread pools if the launcher says how many ranks
    share the host (and it was not done at import), and makes an uncaught
    exception on this rank abort every rank of the job, naming this one.

    Example:

    ```python
    import keras_pipe
    keras_pipe.init()      # first thing in the script: any later error ends the whole job
    ```
    """
    configure_threads(warn=False)
    install_excepthook()


def start_entry_agreement(world) -> None:
    """Makes collective methods agree on entry (collective: the first ``PipelineModel`` calls it).

    The agreement has a communicator of its own, so that a method called on
    one rank in the middle of another collective (a callback saving on rank
    0 during ``fit``) cannot be matched with a step's messages; and at the
    end of the script each rank says it has finished, so that a method
    still waiting for it learns why at once.
    """
    global _entries
    if _entries is not None or world.size == 1:
        return
    # a child of the world communicator: its stall reports ask every rank there
    from keras_pipe.comm import Communicator, created

    _entries = Communicator(created(world.comm.Dup()), world.stall_timeout, parent=world)
    atexit.register(_finished)


_entered = 0  # collective methods this rank has entered (outermost), for the mismatch's message


def agree_on_entry(what: str) -> None:
    """Every rank says which collective method it entered, and its count; raises on every rank unless all agree.

    One small all-gather per call of a collective method (not per step), on
    a communicator of its own: a rank still inside the previous call's
    messages (one rank raised early in it, the script caught it and went
    on) meets the others here, not in a step's messages, and both raise
    naming where each is ("ranks [0]: 'predict()'; ranks [1]: 'call()' (the call's number, ...: rank 0: 4,
    rank 1: 4)"): never a message of one collective read as another's.
    """
    global _entered
    if _entries is None:
        return
    _entered += 1
    _agree(what, _entered)


def _agree(what: str, count: int) -> None:
    _entries.doing = f"entering {what}" + (f" (collective call {count})" if count else "")
    called = _entries.allgather_json([what, count])
    if all(c == called[0] for c in called):
        return
    from keras_pipe.consistency import ranks_by_value

    places = ranks_by_value([w for w, _ in called])
    counts = ", ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(called) if n)
    raise RankMismatchError(
        f"the ranks called different collective methods: {places} (the call's number, counting each rank's "
        f"collective calls: {counts or 'none'}). The methods of a "
        "PipelineModel that communicate (fit, evaluate, predict, calling it, save, save_weights, load_weights, "
        "get_weights, set_weights, to_sequential, summary, count_params) must be called on every rank, in the "
        "same order: call them outside any `if rank == 0:` (rank 0 alone writes the files), and do not let one "
        "rank go on past an error the others did not raise (a try/except around a call on one rank)."
    )


def _finished() -> None:
    """At exit: tells any rank still waiting in a collective method that this one finished its script."""
    try:
        if _entries is not None:
            _agree("the end of the script", 0)
    except RankMismatchError as error:
        sys.stderr.write(f"[keras_pipe] rank {MPI.COMM_WORLD.Get_rank()} finished its script, but {error}\n")
        sys.stderr.flush()
        os._exit(1)
