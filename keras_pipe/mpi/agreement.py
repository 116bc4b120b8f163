"""The ranks agreeing: on entry to each collective method, on values; and saying how they differ.

Every collective method of a ``PipelineModel`` first has the ranks say which
method they entered (:func:`agree_on_entry`, from
:func:`keras_pipe.mpi.failure.collective`), so that one rank calling a
method the others did not raises on every rank instead of waiting forever;
:func:`check_same_everywhere` compares any values the ranks passed and
:func:`ranks_by_value` says which ranks passed which.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

from mpi4py import MPI

from keras_pipe.errors import RankMismatchError
from keras_pipe.mpi.comm import Communicator, created

_entries = None  # the communicator collective methods agree on, once a model exists


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


def check_same_everywhere(comm: Communicator, what: str, values: dict) -> None:
    """Raises :class:`RankMismatchError` on every rank unless all ranks passed equal ``values``."""
    everyone = comm.allgather_json(values)
    differences = []
    for key in sorted(set().union(*everyone)):
        seen = [ranked.get(key) for ranked in everyone]
        if any(v != seen[0] for v in seen):
            if all(isinstance(v, list) for v in seen):
                seen = _first_difference(seen)
            differences.append(f"  {key}: {ranks_by_value(seen, json_values=True)}")
    if differences:
        raise (
            RankMismatchError(
                f"the ranks disagree on {what}:\n" + "\n".join(differences) + "\nEvery rank must run the same "
                "script with the same model, compile() and fit()/evaluate()/predict() arguments."
            )
        )


def ranks_by_value(values: list, json_values: bool = False) -> str:
    """``'ranks [0, 1, 2]: 4; ranks [3]: 1'``: which ranks passed which value.

    >>> ranks_by_value([4, 4, 4, 1])
    'ranks [0, 1, 2]: 4; ranks [3]: 1'
    """
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(json.dumps(value, sort_keys=True) if json_values else repr(value), []).append(rank)
    return "; ".join(f"ranks {ranks}: {_short(value)}" for value, ranks in groups.items())


def _first_difference(lists: list[list]) -> list:
    """Each rank's entry at the first index where the ranks' lists differ (or their lengths)."""
    length = max(len(values) for values in lists)
    for index in range(length):
        entries = [values[index] if index < len(values) else None for values in lists]
        if any(e != entries[0] for e in entries):
            return [
                e if e is not None else f"nothing at position {index} ({len(v)} entries)"
                for e, v in zip(entries, lists)
            ]
    return lists


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
