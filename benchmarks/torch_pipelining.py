"""The peer in the throughput table: torch's own pipelining of the balanced chain, on the same two ranks.

    mpirun -n 2 /path/to/torch-venv/bin/python benchmarks/torch_pipelining.py --workload balanced-b64 \
        --microbatches 4 --schedule 1f1b

``benchmarks/throughput.py --torch-python /path/to/torch-venv/bin/python``
runs it beside the Keras rows, alternated in the same run, so that "times
torch" is a ratio of one run. torch is not a dependency of keras_pipe: give
the interpreter of any environment that has it (``pip install torch``, the
CPU build is enough). The model is the chain of ``throughput.py``'s workload
(Dense = ``nn.Linear`` + ReLU, a softmax head trained by cross-entropy),
split as ``PipelineModel`` splits it on two ranks (its first half of the
hidden layers on rank 0, the rest and the head on rank 1); Adam; one thread
a rank; gloo over the loopback. ``torch.distributed.pipelining``'s
``ScheduleGPipe`` or ``Schedule1F1B`` runs each step; the figure is the
median of the timed epochs after a warm-up epoch, as for every other row.

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


def launcher_rank_and_size() -> tuple[int, int]:
    """This process's rank and the job's size, as the MPI launcher's environment gives them."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def stage_module(spec: dict, rank: int):
    """Rank ``rank``'s half of the chain: hidden layers ``[0, depth/2)`` or ``[depth/2, depth)`` and the head."""
    from torch import nn

    depth, width = spec["depth"], spec["width"]
    half = depth // 2
    layers = []
    for k in range(depth):
        if (k < half) == (rank == 0):
            layers += [nn.Linear(spec["features"] if k == 0 else width, width), nn.ReLU()]
    if rank == 1:
        layers.append(nn.Linear(width, 10))  # (the softmax is in the loss)
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="balanced-b64", choices=list(CHAINS))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up epoch)")
    args, _ = parser.parse_known_args()  # (throughput.py passes its common options too)

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

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
    module = stage_module(spec, rank)
    batch, steps = spec["batch"], spec["steps"]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, spec["features"], generator=generator)
    y = torch.randint(0, 10, (batch * steps,), generator=generator)
    stage = PipelineStage(module, rank, size, torch.device("cpu"))
    loss = torch.nn.CrossEntropyLoss()
    kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=loss)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    speeds = []
    for epoch in range(1 + args.epochs):
        dist.barrier()
        began = time.perf_counter()
        for step in range(steps):
            rows = slice(step * batch, (step + 1) * batch)
            optimizer.zero_grad()
            if rank == 0:
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
