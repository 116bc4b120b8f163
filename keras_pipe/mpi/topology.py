"""This rank's place in the job: the layout of stages and replicas, and the communicators it talks on.

Every rank takes part in three groups: the whole job (``world``: step
agreement, logs, checks), its pipeline (``pipeline``, rank = stage:
activations, their gradients, labels) and the ranks holding the same stage in
the other replicas (``replicas``, rank = replica: the gradient all-reduce,
gathering predictions; ``None`` with one replica). Splitting communicators
is collective, so the ranks first agree on ``num_stages``: a rank asking for
another one is an error on every rank, not a hang inside ``MPI_Comm_split``.

Example (on every rank):

>>> topology = connect(num_stages=2)          # doctest: +SKIP
>>> topology.stage, topology.replica          # doctest: +SKIP
(1, 0)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from keras_pipe.errors import RankMismatchError
from keras_pipe.mpi.agreement import ranks_by_value
from keras_pipe.mpi.comm import Communicator
from keras_pipe.mpi.layout import Layout, host_name
from keras_pipe.mpi.stall import PROCESS, start_timeout_from_env

_met = False  # whether this process's ranks have met once (the first rendezvous has its own timeout)


@dataclass(frozen=True)
class Topology:
    world: Communicator
    layout: Layout
    pipeline: Communicator
    replicas: Communicator | None
    stage: int
    replica: int


def connect(num_stages: int | None = None, stall_timeout: float | None = None) -> Topology:
    """Lays out ``MPI.COMM_WORLD`` as replicas of ``num_stages``-stage pipelines (collective)."""
    global _met
    world = Communicator(stall_timeout=stall_timeout)
    mine = [host_name(), num_stages, os.getpid()]
    timeout = None if _met else min(world.stall_timeout, start_timeout_from_env())
    everyone = world.allgather_json(mine, timeout=timeout) if world.size > 1 else [mine]
    _met = PROCESS.met = True
    world.reports.set_peers([(host, pid) for host, _, pid in everyone])
    check_same_num_stages([stages for _, stages, _ in everyone])
    layout = Layout.from_hosts([host for host, _, _ in everyone], num_stages)
    replica, stage = layout.replica_of(world.rank), layout.stage_of(world.rank)
    one_pipeline = layout.num_replicas == 1 and layout.pipelines[0] == list(range(world.size))
    return Topology(
        world=world,
        layout=layout,
        pipeline=world if one_pipeline else world.split(replica, stage),
        replicas=world.split(stage, replica) if layout.num_replicas > 1 else None,
        stage=stage,
        replica=replica,
    )


def check_same_num_stages(values: list) -> None:
    """Raises :class:`RankMismatchError` on every rank unless every rank passed the same ``num_stages``."""
    if all(v == values[0] for v in values):
        return
    shown = ranks_by_value(values)
    raise (
        RankMismatchError(f"the ranks disagree on num_stages: {shown}. Every rank must build the same PipelineModel.")
    )
