"""The peer in the throughput table: torch's own pipelining of the balanced chain, on the same two ranks.

    mpirun -n 2 /path/to/torch-venv/bin/python benchmarks/torch_pipelining.py --workload balanced-b64 \
        --microbatches 4 --schedule 1f1b

``benchmarks/throughput.py --torch-python /path/to/torch-venv/bin/python``
runs it beside the Keras rows, alternated in the same run, so that "times
torch" is a ratio of one run. torch is not a dependency of keras_pipe: give
the interpreter of any environment that has it (``pip install torch``, the
CPU build is enough: ``pip install torch==2.13.0`` here). The model is the
chain of ``throughput.py``'s workload (Dense = ``nn.Linear`` + ReLU, a softmax
head trained by cross-entropy), split as ``PipelineModel`` splits it: on two
ranks, the first half of the hidden layers on rank 0 and the rest and the head
on rank 1; for the schedules of two stages a rank, four equal virtual stages,
held round robin (interleaved 1F1B, interleaved zero bubble) or as a V (ZB-V:
rank 0 the first and the last), as ``PipelineModel``'s ``zb-v`` and
``interleaved-1f1b`` hold them. Adam; one thread a rank; gloo over the
loopback. The ``torch.distributed.pipelining`` schedule of ``SCHEDULES`` runs
each step; the figure is the median of the timed epochs after a warm-up
epoch, as for every other row.

Rank and size come from the MPI launcher's environment (``PMI_RANK``,
``PMI_SIZE``, or Open MPI's ``OMPI_COMM_WORLD_*``); no mpi4py is needed.
Rank 0 prints ``RESULT {"samples_per_s": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from throughput import WORKLOADS  # (only the standard library at import: torch's interpreter runs it)

# The workloads of throughput.py this script can run: the chain it splits into two equal stages.
CHAINS = {name: spec for name, spec in WORKLOADS.items() if name.startswith("balanced")}
# torch.distributed.pipelining's schedule for each of our schedule names (the last three: two stages a rank)
SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}


def launcher_rank_and_size() -> tuple[int, int]:
    """This process's rank and the job's size, as the MPI launcher's environment gives them."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def stage_module(spec: dict, stage: int, num_stages: int = 2):
    """Virtual stage ``stage`` of ``num_stages`` equal parts of the chain; the last one ends with the head."""
    from torch import nn

    depth, width = spec["depth"], spec["width"]
    per_stage = depth // num_stages
    layers = []
    for k in range(stage * per_stage, (stage + 1) * per_stage):
        layers += [nn.Linear(spec["features"] if k == 0 else width, width), nn.ReLU()]
    if stage == num_stages - 1:
        layers.append(nn.Linear(width, 10))  # (the softmax is in the loss)
    return nn.Sequential(*layers)


def stages_of(schedule: str, rank: int, size: int) -> list[int]:
    """The virtual stages rank ``rank`` holds: one, or two for the chunked schedules (a V for ZB-V)."""
    if schedule in ("1f1b", "gpipe"):
        return [rank]
    if schedule == "zb-v":
        return [rank, 2 * size - 1 - rank]
    return [rank, rank + size]  # (interleaved 1F1B and interleaved zero bubble: round robin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="balanced-b64", choices=list(CHAINS))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=tuple(SCHEDULES))
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up epoch)")
    args, _ = parser.parse_known_args()  # (throughput.py passes its common options too)

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)  # one core a rank, as each PipelineModel rank on two cores
    torch.set_num_interop_threads(1)
    rank, size = launcher_rank_and_size()
    if size != 2:
        raise SystemExit(f"run on 2 ranks (mpirun -n 2), not {size}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    spec = CHAINS[args.workload]
    torch.manual_seed(0)
    held = stages_of(args.schedule, rank, size)
    num_stages = size * len(held)
    modules = [stage_module(spec, index, num_stages) for index in held]
    batch, steps = spec["batch"], spec["steps"]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, spec["features"], generator=generator)
    y = torch.randint(0, 10, (batch * steps,), generator=generator)
    stages = [pipelining.PipelineStage(m, i, num_stages, torch.device("cpu")) for m, i in zip(modules, held)]
    loss = torch.nn.CrossEntropyLoss()
    kind = getattr(pipelining, SCHEDULES[args.schedule])
    if len(stages) == 1:
        schedule = kind(stages[0], n_microbatches=args.microbatches, loss_fn=loss)
    else:
        schedule = kind(stages, n_microbatches=args.microbatches, loss_fn=loss)
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=1e-3)
    first, last = 0 in held, num_stages - 1 in held  # (the inputs go to the first stage, the targets to the last)
    speeds = []
    for epoch in range(1 + args.epochs):
        dist.barrier()
        began = time.perf_counter()
        for step in range(steps):
            rows = slice(step * batch, (step + 1) * batch)
            optimizer.zero_grad()
            if first and last:  # (ZB-V: rank 0 holds the first and the last stage)
                schedule.step(x[rows], target=y[rows], losses=[])
            elif first:
                schedule.step(x[rows])
            else:
                schedule.step(target=y[rows], losses=[])
            optimizer.step()
        dist.barrier()
        if epoch:
            speeds.append(batch * steps / (time.perf_counter() - began))
    if rank == 0:
        print("RESULT " + json.dumps({"samples_per_s": statistics.median(speeds), "all": speeds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
