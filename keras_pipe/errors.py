"""The exceptions keras_pipe raises, one per family of mistakes."""


class PipelineConfigError(ValueError):
    """The model, its split or its options cannot form a pipeline.

    Raised on every rank, before any communication starts, with the values
    that do not fit and how to fix them.
    """


class RankMismatchError(ValueError):
    """The ranks disagree on something they must share (model, split, data)."""


class PipelineStallError(RuntimeError):
    """A rank waited longer than the stall timeout for a neighbour."""


class RemoteRankError(RuntimeError):
    """Another rank of the pipeline failed; this rank stops too."""
