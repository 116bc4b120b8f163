"""Internal: one placement of the model on the ranks, as a value the engine holds whole.

A schedule places ``num_stages * num_chunks`` virtual stages on the pipeline's
ranks (:func:`keras_pipe.schedules.schedule.placement`); what follows from
that placement is this module's :class:`Placement`: which rank computes the
loss, this rank's actions and the exchange of targets, and once the model is
cut, the cut, this rank's chunks (compute, links) and the executor that runs
them. ``schedule="auto"`` builds a second placement while it times ZB-V against
the one-stage-a-rank schedules, and keeps the one it picks:
:class:`keras_pipe.engine.picking.SchedulePicking` swaps the engine's
``placed`` whole, never attribute by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keras_pipe.engine.chunks import ranks_of_virtual_stages
from keras_pipe.engine.predictions import PredictionExchange
from keras_pipe.engine.stage_actions import StageActions
from keras_pipe.schedules import schedule


@dataclass(eq=False)
class Placement:
    """Schedule ``name``'s ``num_chunks`` chunks a rank on the pipeline, as this rank sees them.

    ``ranks[r]``: the virtual stages rank ``r`` holds; ``virtual_ranks[k]``:
    the rank of virtual stage ``k``; ``last_rank``: the rank that computes the
    loss. Set when the model is cut and built on it (:meth:`Engine.build`):
    ``cut``, ``balance``, ``chunks`` (this rank's virtual stages), ``compute``
    and ``links`` (its first chunk's), ``executor``, and ``masks`` once
    measured on the first batch.
    """

    schedule: str
    num_chunks: int
    ranks: list
    virtual_ranks: list
    last_rank: int
    is_last: bool
    actions: StageActions
    predictions: PredictionExchange
    cut: object = None
    balance: list | None = None
    chunks: list = field(default_factory=list)
    compute: object = None
    links: object = None
    executor: object = None
    masks: dict | None = None

    @classmethod
    def of(
        cls, name: str, num_chunks: int, *, picker, pipeline, replicas, num_replicas: int, num_stages: int, stage: int
    ) -> Placement:
        ranks = schedule.placement(name, num_stages, num_chunks)
        virtual_ranks = ranks_of_virtual_stages(ranks)
        last_rank = virtual_ranks[-1]
        is_last = stage == last_rank
        return cls(
            schedule=name,
            num_chunks=num_chunks,
            ranks=ranks,
            virtual_ranks=virtual_ranks,
            last_rank=last_rank,
            is_last=is_last,
            actions=StageActions(name, picker, num_stages, stage, num_chunks, ranks),
            predictions=PredictionExchange(
                pipeline,
                replicas,
                num_replicas=num_replicas,
                num_stages=num_stages,
                last_rank=last_rank,
                is_first=stage == 0,
                is_last=is_last,
            ),
        )

    @property
    def key(self) -> tuple:
        """The placement as a dictionary key (two schedules may place alike: 1F1B and ZB-H1)."""
        return key_of(self.ranks)

    def units_of(self, stage: int) -> list[str]:
        """The units whose weights ``stage`` (a pipeline rank) holds under this placement: its chunks', each once."""
        return list(dict.fromkeys(u for k in self.ranks[stage] for u in self.cut.stages[k].units))

    def forget(self) -> None:
        """Forgets the cut and what was built on it (the placement itself stays)."""
        self.cut = self.balance = self.compute = self.links = self.executor = self.masks = None
        self.chunks = []
        self.actions.forget()


def key_of(ranks: list) -> tuple:
    """A placement (``ranks[r]``: the virtual stages rank ``r`` holds) as a dictionary key."""
    return tuple(tuple(stages) for stages in ranks)
