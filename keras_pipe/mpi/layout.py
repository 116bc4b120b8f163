"""Which rank is which stage of which replica: plain data, tested without MPI.

With ``W`` ranks and ``num_stages=S`` there are ``R = W / S`` replicas of an
``S``-stage pipeline (the pipeline x data layout of DeepSpeed and Megatron).
A pipeline's neighbours exchange activations and gradients for every
micro-batch, while the replicas of one stage exchange gradients once per
batch, so the layout keeps each pipeline's ranks on one host where it can:
ranks are ordered by host (hosts in the order their first rank appears, ranks
in order within a host) and consecutive runs of ``S`` ranks form the
pipelines. With the usual block placement (``mpirun`` fills a host's slots
before the next host) this is simply ``rank = replica * S + stage``; with
round-robin placement it still groups each pipeline on one host. A pipeline
spans hosts only where a host's rank count is not a multiple of ``S``.

Example:

>>> layout = Layout.from_hosts(["a", "b", "a", "b"], num_stages=2)
>>> layout.pipelines
[[0, 2], [1, 3]]
>>> layout.stage_of(3), layout.replica_of(3)
(1, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from keras_pipe.errors import PipelineConfigError


@dataclass(frozen=True)
class Layout:
    """``pipelines[r][s]`` is the world rank of stage ``s`` of replica ``r``; ``hosts[rank]`` its host."""

    pipelines: list[list[int]]
    hosts: list[str]

    @classmethod
    def from_hosts(cls, hosts: Sequence[str], num_stages: int | None) -> Layout:
        """The layout of ``len(hosts)`` ranks, ``hosts[rank]`` naming each rank's host.

        ``num_stages=None`` means one pipeline over every rank.
        """
        world = len(hosts)
        stages = world if num_stages is None else num_stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise PipelineConfigError(f"num_stages={num_stages!r}: it must be a positive integer or None.")
        if world % stages:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise PipelineConfigError(
                f"num_stages={stages} does not divide the {world} ranks of the job into whole pipelines; "
                f"use a num_stages in {divisors}, or launch a multiple of {stages} ranks (mpirun -n)."
            )
        first_seen: dict[str, int] = {}
        for rank, host in enumerate(hosts):
            first_seen.setdefault(host, rank)
        order = sorted(range(world), key=lambda rank: (first_seen[hosts[rank]], rank))
        pipelines = [order[start : start + stages] for start in range(0, world, stages)]
        return cls(pipelines=pipelines, hosts=list(hosts))

    @property
    def num_stages(self) -> int:
        return len(self.pipelines[0])

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    def stage_of(self, rank: int) -> int:
        return self._position(rank)[1]

    def replica_of(self, rank: int) -> int:
        return self._position(rank)[0]

    def rank_of(self, replica: int, stage: int) -> int:
        return self.pipelines[replica][stage]

    def replicas_of_stage(self, stage: int) -> list[int]:
        """The world ranks holding stage ``stage``, one per replica, in replica order."""
        return [pipeline[stage] for pipeline in self.pipelines]

    def _position(self, rank: int) -> tuple[int, int]:
        for replica, pipeline in enumerate(self.pipelines):
            if rank in pipeline:
                return replica, pipeline.index(rank)
        raise ValueError(f"rank {rank} is not in the layout")

    def cross_host_links(self) -> int:
        """How many neighbouring pairs of a pipeline sit on different hosts."""
        return sum(
            self.hosts[a] != self.hosts[b] for pipeline in self.pipelines for a, b in zip(pipeline, pipeline[1:])
        )

    def describe(self) -> list[str]:
        """One line per replica: its ranks stage by stage, with their hosts."""
        lines = []
        for replica, pipeline in enumerate(self.pipelines):
            cells = [f"stage {s}: rank {rank} ({self.hosts[rank]})" for s, rank in enumerate(pipeline)]
            lines.append(f"replica {replica}: " + ", ".join(cells))
        return lines


def host_name() -> str:
    """This rank's host, for placement: ``KERAS_PIPE_HOST`` if set, else MPI's processor name.

    Set ``KERAS_PIPE_HOST`` where MPI's name does not tell hosts apart (some
    containers give every node the same name).
    """
    import os

    override = os.environ.get("KERAS_PIPE_HOST")
    if override:
        return override
    from mpi4py import MPI

    return MPI.Get_processor_name()
