"""A cost model of one training step: pick ``num_stages`` for a model on a cluster.

Plain arithmetic, no MPI; ``docs/scaling.md`` derives it and
``benchmarks/scaling.py`` fits its machine constants on this machine and
compares its predictions with measured steps.

With ``W = S x R`` ranks (``S`` stages, ``R`` replicas), a global batch of
``B`` samples cut into ``m`` micro-batches per replica, a step takes

    T = (m + S - 1) * t_slot  +  T_allreduce  +  T_update  +  h

* ``t_slot``, one micro-batch on one stage, its forward and input gradient:
  ``b * c / S`` compute (``b = B / (R m)`` samples, ``c`` seconds per sample
  for the whole model on one rank) ``+ o + g * P / S`` (a fixed cost per
  micro-batch, and the work proportional to the stage's ``P / S`` weights
  that each micro-batch pays again: its thin matrix products read every
  weight for ``b`` rows) ``+ 2 (a + b * A / bw_p2p)``
  when ``S > 1`` (activation forward and gradient back, ``A`` bytes per
  sample at a stage boundary). The ``m + S - 1`` slots are the pipeline's
  fill, steady state and drain: the bubble is ``(S - 1) / (m + S - 1)``.
* ``T_allreduce``, summing a stage's gradients over its replicas (ring):
  ``2 (R - 1) / R * 4 P / S / bw_ar + 2 (R - 1) a_ar``; it overlaps the
  backward of earlier stages except on the first stage, which finishes
  last, so it counts once.
* ``T_update``, once a step: the stage's weight gradients over the batch
  (the split backward's batched ``W``) and the optimizer update, one
  program: ``u * P / S``.
* ``h``, per step outside the micro-batches: the step agreement, sharing
  the logs, metrics, reading the batch.

Throughput is ``B / T``. Memory per rank is about ``k * 4 P / S`` (weights,
gradient accumulator, optimizer slots: ``k`` = 4 for Adam with float32; one
more copy with replicas, the all-reduce's receive buffers) plus the
activations of at most ``S`` micro-batches in flight (1F1B).

Example: 8 ranks, an 8M-parameter model, batch 256. On one host (5 GB/s
links) 2 stages x 4 replicas wins; on two hosts of 4 ranks joined by 1 GB/s,
the all-reduce across hosts costs more, and 4 x 2 wins.

>>> machine = Machine(compute_s_per_sample=2e-4, microbatch_overhead_s=1e-3)
>>> work = Workload(params=8e6, activation_bytes=2048, batch=256)
>>> [(s, r, round(estimate(work, machine, s, r).step_s * 1e3, 1)) for s, r in layouts(8)]
[(1, 8, 18.9), (2, 4, 18.2), (4, 2, 22.0), (8, 1, 33.4)]
>>> best = choose_num_stages(work, machine, ranks=8)
>>> best.num_stages, best.num_replicas
(2, 4)
>>> slow = Machine(compute_s_per_sample=0, allreduce_bytes_per_s=1e9, p2p_bytes_per_s=1e9)
>>> best = choose_num_stages(work, machine, ranks=8, ranks_per_host=4, network=slow)
>>> best.num_stages, best.num_replicas
(4, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Machine:
    """Constants of one rank and its links (seconds, bytes per second)."""

    compute_s_per_sample: float  # c: forward + backward of the whole model, one sample, one rank
    microbatch_overhead_s: float = 0.0  # o: launching one micro-batch's compiled calls
    grad_s_per_param: float = 0.0  # g: one weight read by a micro-batch's forward and input gradient
    update_s_per_param: float = 0.0  # u: one weight's batched gradient and optimizer update, per step
    step_overhead_s: float = 0.0  # h: per step, outside the micro-batches (logs, agreement, data)
    p2p_latency_s: float = 20e-6  # a
    p2p_bytes_per_s: float = 5e9  # bw_p2p between a pipeline's neighbours
    allreduce_latency_s: float = 20e-6  # a_ar
    allreduce_bytes_per_s: float = 5e9  # bw_ar between a stage's replicas
    memory_bytes: float = float("inf")  # per rank


@dataclass(frozen=True)
class Workload:
    """The model and batch: parameter count, bytes per sample crossing a stage boundary, global batch."""

    params: float
    activation_bytes: float  # A: per sample at a stage boundary (float32: 4 x width)
    batch: int  # B, the global batch
    num_microbatches: int | None = None  # m per replica; None: 2 S (1 for S = 1), as PipelineModel
    state_factor: float = 4.0  # k: weights + accumulator + 2 Adam slots
    activation_bytes_per_sample: float = 0.0  # stored activations, whole model, per sample


@dataclass(frozen=True)
class Estimate:
    num_stages: int
    num_replicas: int
    num_microbatches: int
    step_s: float
    samples_per_s: float
    bubble: float
    slot_s: float
    p2p_s: float  # per slot
    allreduce_s: float
    update_s: float
    memory_bytes: float
    fits: bool


def estimate(workload: Workload, machine: Machine, num_stages: int, num_replicas: int) -> Estimate:
    """The predicted step of ``num_stages`` x ``num_replicas`` ranks."""
    s, r = num_stages, num_replicas
    m = workload.num_microbatches or (1 if s == 1 else 2 * s)
    b = workload.batch / (r * m)
    stage_params = workload.params / s
    p2p = 2 * (machine.p2p_latency_s + b * workload.activation_bytes / machine.p2p_bytes_per_s) if s > 1 else 0.0
    slot = (
        b * machine.compute_s_per_sample / s
        + machine.microbatch_overhead_s
        + machine.grad_s_per_param * stage_params
        + p2p
    )
    allreduce = (
        2 * (r - 1) / r * 4 * stage_params / machine.allreduce_bytes_per_s + 2 * (r - 1) * machine.allreduce_latency_s
        if r > 1
        else 0.0
    )
    update = machine.update_s_per_param * stage_params
    step = (m + s - 1) * slot + allreduce + update + machine.step_overhead_s
    in_flight = min(m, s) * b * workload.activation_bytes_per_sample / s
    # With replicas, the all-reduce's receive buffers are one more copy of the stage's gradients.
    memory = (workload.state_factor + (1 if r > 1 else 0)) * 4 * stage_params + in_flight
    return Estimate(
        num_stages=s,
        num_replicas=r,
        num_microbatches=m,
        step_s=step,
        samples_per_s=workload.batch / step,
        bubble=(s - 1) / (m + s - 1),
        slot_s=slot,
        p2p_s=p2p,
        allreduce_s=allreduce,
        update_s=update,
        memory_bytes=memory,
        fits=memory <= machine.memory_bytes,
    )


def layouts(ranks: int) -> list[tuple[int, int]]:
    """Every ``(stages, replicas)`` with ``stages x replicas = ranks``."""
    return [(s, ranks // s) for s in range(1, ranks + 1) if ranks % s == 0]


def choose_num_stages(
    workload: Workload,
    machine: Machine,
    ranks: int,
    ranks_per_host: int | None = None,
    network: Machine | None = None,
) -> Estimate:
    """The fastest layout of ``ranks`` ranks whose stage fits in memory.

    With ``ranks_per_host``, pipelines of at most that many stages stay on
    one host (see :mod:`keras_pipe.mpi.layout`) and use ``machine``'s links;
    longer pipelines use ``network``'s point-to-point figures, and replicas
    on different hosts (``R > 1`` with more than one host) use ``network``'s
    all-reduce figures.
    """
    options = []
    hosts = 1 if ranks_per_host is None else -(-ranks // ranks_per_host)
    for s, r in layouts(ranks):
        links = machine
        if network is not None and ranks_per_host is not None:
            if s > ranks_per_host:
                links = replace(links, p2p_latency_s=network.p2p_latency_s, p2p_bytes_per_s=network.p2p_bytes_per_s)
            if r > 1 and hosts > 1:
                links = replace(
                    links,
                    allreduce_latency_s=network.allreduce_latency_s,
                    allreduce_bytes_per_s=network.allreduce_bytes_per_s,
                )
        options.append(estimate(workload, links, s, r))
    fitting = [e for e in options if e.fits] or options
    return min(fitting, key=lambda e: (e.step_s, e.num_stages))
