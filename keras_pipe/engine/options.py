"""Internal: the pipeline's options — one frozen dataclass, its defaults written once, resolved and checked once.

``PipelineModel(...)`` makes a :class:`PipelineOptions` of the options as
given (``get_config`` writes those that differ from the defaults:
:meth:`PipelineOptions.given`) and hands it to its
:class:`~keras_pipe.engine.engine.Engine`. The engine joins the job, then
:meth:`PipelineOptions.resolve` fills in what depends on the world (``2 * P``
micro-batches, the schedule's chunks, the stages per pipeline) and checks
every rule an option must keep, in this one function; the engine, its stages
and the schedule read the resolved options only, and nothing is read back.

One rule is checked where it applies rather than here: ``balance="time"``
with several chunks a rank is refused when the model is built (it times one
stage a rank, and its message names the virtual stages of the cut).
``stall_timeout``'s default (``KERAS_PIPE_STALL_TIMEOUT``, else 600 seconds)
is the communicator's (:mod:`keras_pipe.mpi.topology`), as is the check that
``num_stages`` divides the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from keras_pipe.errors import PipelineConfigError
from keras_pipe.schedules import schedule, virtual
from keras_pipe.schedules.actions import check_microbatches

RECOMPUTE = ("never", "except_last", "always")
AUTO = "auto"  # num_microbatches="auto": timed in the first training steps, as schedule="auto"


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """The options of a pipeline, as ``PipelineModel`` takes them (see its docstring for each).

    As given, ``None`` means "the default for this world"; :meth:`resolve`
    returns the options with every such default filled in.
    """

    num_microbatches: int | str | None = None
    balance: Sequence[int] | str | None = None
    split_before: Sequence[str] | None = None
    schedule: str = "1f1b"
    num_chunks: int | None = None
    num_stages: int | None = None
    stall_timeout: float | None = None
    recompute: str = "never"

    @property
    def auto_microbatches(self) -> bool:
        """Whether ``num_microbatches="auto"``: the engine's picker times several numbers of micro-batches."""
        return self.num_microbatches == AUTO

    @classmethod
    def defaults(cls) -> dict:
        """``{name: default}`` of every option."""
        return {field.name: field.default for field in dataclasses.fields(cls)}

    def given(self) -> dict:
        """``{name: value}`` of the options that differ from their defaults (what ``get_config`` writes)."""
        defaults = self.defaults()
        return {name: value for name, value in self._items() if value != defaults[name]}

    def _items(self):
        return ((field.name, getattr(self, field.name)) for field in dataclasses.fields(self))

    def resolve(self, num_stages: int) -> PipelineOptions:
        """These options for a pipeline of ``num_stages`` ranks: every default filled in, every rule checked.

        ``num_microbatches=None`` is ``2 * num_stages`` (1 on one stage;
        ``"auto"`` stays: the engine's picker times the candidates);
        ``num_chunks=None`` is the schedule's (two for a chunked schedule).
        Raises :class:`~keras_pipe.errors.PipelineConfigError` naming the
        option (the same on every rank: every rank gives the same options).
        """
        num_microbatches = self.num_microbatches
        if num_microbatches is None:
            num_microbatches = 1 if num_stages == 1 else 2 * num_stages
        if not self.auto_microbatches:  # ("auto": the candidates of keras_pipe.schedules.auto, each a multiple of P)
            check_microbatches(num_microbatches)
        schedule.check_name(self.schedule)
        num_chunks = schedule.default_chunks(self.schedule) if self.num_chunks is None else self.num_chunks
        schedule.check_chunks(self.schedule, num_chunks)
        check_recompute(self.recompute)
        if self.split_before is not None and self.balance is not None:
            raise PipelineConfigError("give balance or split_before, not both: each says where the stages begin.")
        if schedule.needs_whole_rounds(self.schedule) and not self.auto_microbatches:
            virtual.check_whole_rounds(num_stages, num_microbatches)
        return dataclasses.replace(
            self, num_microbatches=num_microbatches, num_chunks=num_chunks, num_stages=num_stages
        )


def check_recompute(value) -> None:
    """Refuses an unknown ``recompute`` option, naming the accepted ones."""
    if value not in RECOMPUTE:
        raise PipelineConfigError(
            f"recompute={value!r}: give one of {', '.join(map(repr, RECOMPUTE))} (as torchgpipe's checkpoint: "
            "'always' keeps only each micro-batch's input and reruns its forward during the backward)."
        )
