"""Which accelerator each rank uses: one GPU of its host per rank, chosen by its rank among the host's ranks.

By default the ``k``-th rank of a host sees only the ``k``-th GPU of that
host (TensorFlow then calls it ``/GPU:0``), so no two ranks share a device;
more ranks than GPUs on a host is an error that says how to go on. Set
``KERAS_PIPE_GPUS`` to choose otherwise:

- ``KERAS_PIPE_GPUS=none``: every rank runs on the CPU;
- ``KERAS_PIPE_GPUS=shared``: ranks take the GPUs in turn (rank ``k`` uses GPU ``k % n``);
- ``KERAS_PIPE_GPUS=2,3``: the host's ``k``-th rank uses the ``k``-th listed GPU.

A host without GPUs needs nothing. The choice is made at import, before
TensorFlow initialises its devices, from the launcher's figures (the rank's
place among the host's ranks: MPICH's ``MPI_LOCALRANKID``, Open MPI's
``OMPI_COMM_WORLD_LOCAL_RANK``, Slurm's ``SLURM_LOCALID``); under another
launcher it is made when the first ``PipelineModel`` has gathered the ranks'
hosts, which works if the script ran no TensorFlow op before. A script that
already chose with ``tf.config.set_visible_devices`` keeps its choice.

Example (plain data, no GPU needed):

>>> choose_gpu(local_rank=1, local_size=2, num_gpus=4)
1
>>> choose_gpu(local_rank=5, local_size=8, num_gpus=4, setting="shared")
1
>>> choose_gpu(local_rank=0, local_size=2, num_gpus=4, setting="none") is None
True
"""

from __future__ import annotations

import os
import warnings

from keras_pipe.errors import PipelineConfigError

LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")

_chosen = False
_problem: str | None = None  # a choice that failed at import, raised on every rank by the first PipelineModel


def choose_gpu(local_rank: int, local_size: int, num_gpus: int, setting: str | None = None) -> int | None:
    """The index of the GPU (of ``num_gpus`` on the host) the host's ``local_rank``-th rank uses; ``None``: the CPU."""
    setting = (setting or "").strip().lower()
    if num_gpus == 0 or setting == "none":
        return None
    if setting == "shared":
        return local_rank % num_gpus
    if setting:
        try:
            listed = [int(part) for part in setting.split(",")]
        except ValueError:
            listed = []
        if not listed or any(not 0 <= g < num_gpus for g in listed):
            raise PipelineConfigError(
                f"KERAS_PIPE_GPUS={setting!r}: give 'none', 'shared', or GPU indices below {num_gpus} separated by "
                "commas, one per rank of the host (e.g. '0,1')."
            )
        if local_rank >= len(listed):
            raise PipelineConfigError(
                f"KERAS_PIPE_GPUS={setting!r} lists {len(listed)} GPUs but this host runs {local_size} ranks: list one "
                "per rank."
            )
        return listed[local_rank]
    if local_size > num_gpus:
        raise PipelineConfigError(
            f"{local_size} ranks run on this host but it has {num_gpus} GPUs: by default each rank uses a GPU of its "
            "own. Start fewer ranks per host, or set KERAS_PIPE_GPUS=shared (ranks share the GPUs in turn) or "
            "KERAS_PIPE_GPUS=none (CPU only)."
        )
    return local_rank


def local_rank_from_environment(environ=os.environ) -> int | None:
    """This rank's place among its host's ranks, as the launcher says; ``None`` if it does not.

    >>> local_rank_from_environment({"MPI_LOCALRANKID": "3"})
    3
    """
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def try_configure_gpus(local_rank: int | None = None, local_size: int | None = None) -> None:
    """:func:`configure_gpus`, keeping a failure for :func:`check_all_ranks` (at import, no rank can be told)."""
    global _problem
    try:
        configure_gpus(local_rank, local_size)
    except PipelineConfigError as error:
        _problem = str(error)


def check_all_ranks(world) -> None:
    """Raises on every rank if any rank's GPU choice failed (collective: no rank is left waiting)."""
    problems = world.allgather_json(_problem) if world.size > 1 else [_problem]
    failed = {rank: text for rank, text in enumerate(problems) if text}
    if failed:
        rank, text = next(iter(failed.items()))
        raise PipelineConfigError(f"ranks {sorted(failed)} cannot choose a GPU; rank {rank}: {text}")


def configure_gpus(local_rank: int | None = None, local_size: int | None = None) -> None:
    """Makes this rank see only its GPU (see the module docstring); once, and only on a host with GPUs."""
    global _chosen
    from keras_pipe.mpi.threads import ranks_on_host_from_environment

    if _chosen or _problem is not None:
        return
    local_rank = local_rank_from_environment() if local_rank is None else local_rank
    local_size = ranks_on_host_from_environment() if local_size is None else local_size
    if local_rank is None or local_size is None:
        return  # decided when the first PipelineModel knows the hosts
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    _chosen = True
    if not gpus:
        return
    index = choose_gpu(local_rank, local_size, len(gpus), os.environ.get("KERAS_PIPE_GPUS"))
    visible = [] if index is None else [gpus[index]]
    if tf.config.get_visible_devices("GPU") != gpus:
        return  # the script chose
    try:
        tf.config.set_visible_devices(visible, "GPU")
    except RuntimeError:
        warnings.warn(
            "keras_pipe could not give this rank a GPU of its own because TensorFlow already initialised its "
            "devices: import keras_pipe before running any TensorFlow op, or call tf.config.set_visible_devices "
            "yourself.",
            stacklevel=3,
        )
