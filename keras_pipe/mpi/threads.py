"""Sizing each rank's TensorFlow thread pools to its share of the host's cores.

Several ranks on one host that each use TensorFlow's default pools (one
thread per core) oversubscribe the cores and slow each other down badly. By
default each rank gets ``cores // ranks_on_this_host`` threads (at least one);
``KERAS_PIPE_THREADS=N`` overrides that, and a user who sets TensorFlow's pools
before importing keras_pipe keeps them. ``N`` = the host's cores lends a
waiting rank's core to its neighbour: faster where one rank computes alone on
wide products for much of a step, slower on thin micro-batches, where ranks
that share cores wait at each parallel loop for a descheduled thread
(``docs/performance.md``, "Lending a waiting rank's core"); hence not the default.

The pools can only be sized before TensorFlow runs its first op, so this
happens at import, without any MPI call: the number of ranks on this host
comes from the launcher's environment (MPICH's Hydra, Open MPI and Slurm set
it). Under another launcher it is counted when the first ``PipelineModel``
gathers the ranks' host names, which works if the script creates no tensor
before it (else a warning says how to size the pools by hand).
"""

from __future__ import annotations

import os
import warnings

# Set by the launchers, in order of preference: ranks of this job on this host.
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

_configured: int | None = None  # threads per rank, once set


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_on_host_from_environment(environ=os.environ) -> int | None:
    """How many ranks share this host, as the launcher says; ``None`` if it does not.

    >>> ranks_on_host_from_environment({"MPI_LOCALNRANKS": "4"})
    4
    >>> ranks_on_host_from_environment({}) is None
    True
    """
    for name in LOCAL_SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def share_of_cores(ranks: int) -> int:
    """Each of ``ranks`` ranks' default threads on this host: the host's cores divided among them, at least one."""
    return max(1, host_cores() // ranks)


def threads_override(environ=os.environ) -> int | None:
    """``KERAS_PIPE_THREADS`` as a positive integer, or ``None`` when unset; a clear error when invalid."""
    value = environ.get("KERAS_PIPE_THREADS", "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"KERAS_PIPE_THREADS={value!r}: give a positive integer (threads per rank), or unset it.")
    return int(value)


def configure_threads(ranks_on_host: int | None = None, warn: bool = True) -> int | None:
    """Sets TensorFlow's intra- and inter-op pools to this rank's share of the cores.

    ``ranks_on_host`` defaults to the launcher's figure. Does nothing (returns
    ``None``) when that is unknown, when one rank runs alone on its host and
    no override is given, when the user already chose the pools, or when it
    already ran. After TensorFlow's first op it can only warn.
    """
    global _configured
    import tensorflow as tf

    if _configured is not None:
        return _configured
    override = threads_override()
    ranks = ranks_on_host if ranks_on_host is not None else ranks_on_host_from_environment()
    if override is None and (ranks is None or ranks == 1):
        return None
    if tf.config.threading.get_intra_op_parallelism_threads() != 0:
        return None  # the user's choice
    threads = override or share_of_cores(ranks)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        if warn:
            warnings.warn(
                "keras_pipe could not size TensorFlow's thread pools because TensorFlow already ran an op; "
                "import keras_pipe before creating tensors (under MPICH, Open MPI or Slurm that suffices), "
                "or set KERAS_PIPE_THREADS and call tf.config.threading.set_*_parallelism_threads yourself. "
                "Ranks may oversubscribe the cores.",
                stacklevel=3,
            )
        return None
    _configured = threads
    return threads


def cores_to_spare() -> bool:
    """Whether every rank on this host has cores of its own for its threads (so a waiting rank may spin)."""
    ranks = ranks_on_host_from_environment() or 1
    threads = _configured or threads_override() or share_of_cores(ranks)
    return ranks * threads <= host_cores()
