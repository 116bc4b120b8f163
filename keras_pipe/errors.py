"""The exceptions keras_pipe raises, one per family of mistakes.

A :class:`CollectiveError` is raised alike on every rank (a bad option, a
disagreement every rank has found, a file rank 0 could not read): each rank
reports it and exits normally. Any other exception on one rank ends the
whole job (see :mod:`keras_pipe.mpi.failure`).
"""


class CollectiveError(Exception):
    """Raised identically on every rank, so no rank is left waiting: no abort is needed."""


class PipelineConfigError(CollectiveError, ValueError):
    """The model, its split or its options cannot form a pipeline.

    Raised on every rank, before any communication starts, with the values
    that do not fit and how to fix them.
    """


class RankMismatchError(CollectiveError, ValueError):
    """The ranks disagree on something they must share (model, split, data)."""


class PipelineIOError(CollectiveError, OSError):
    """Rank 0 could not read or write a file; every rank raises it."""


class PipelineDataError(CollectiveError, ValueError):
    """A first stage could not read its next batch (the user's dataset or generator raised); every rank raises it.

    Only the first stage of each pipeline reads the data; the others learn
    of the failure at the step's agreement and raise it too, naming the rank
    and the error.
    """


class PipelineStallError(RuntimeError):
    """A rank waited longer than the stall timeout for a neighbour."""
