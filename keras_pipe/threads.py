"""Sizing each rank's TensorFlow thread pools to its share of the host's cores.

Several ranks on one host that each use TensorFlow's default pools (one
thread per core) oversubscribe the cores and slow each other down badly. By
default each rank gets ``cores // ranks_on_this_host`` threads (at least one);
``KERAS_PIPE_THREADS=N`` overrides that, and a user who sets TensorFlow's pools
before importing keras_pipe keeps them.
"""

from __future__ import annotations

import os
import warnings

from mpi4py import MPI


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_on_this_host(comm: MPI.Comm | None = None) -> int:
    """How many ranks of ``comm`` share this host (shared-memory node)."""
    comm = comm if comm is not None else MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size()
    finally:
        local.Free()


def default_threads(comm: MPI.Comm | None = None) -> int:
    """Threads per rank: ``KERAS_PIPE_THREADS``, else this rank's share of the host's cores."""
    override = os.environ.get("KERAS_PIPE_THREADS")
    if override:
        return max(1, int(override))
    return max(1, host_cores() // ranks_on_this_host(comm))


def configure_threads(comm: MPI.Comm | None = None) -> int | None:
    """Sets TensorFlow's intra- and inter-op pools to :func:`default_threads`.

    Does nothing (returns ``None``) when one rank runs alone on its host and no
    override is given, or when the user already chose the pools. Must run
    before TensorFlow executes its first op; later it only warns.
    """
    import tensorflow as tf

    comm = comm if comm is not None else MPI.COMM_WORLD
    if not os.environ.get("KERAS_PIPE_THREADS") and ranks_on_this_host(comm) == 1:
        return None
    if tf.config.threading.get_intra_op_parallelism_threads() != 0:
        return None  # the user's choice
    threads = default_threads(comm)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        warnings.warn(
            "keras_pipe could not size TensorFlow's thread pools because TensorFlow already ran an op; "
            "import keras_pipe before creating tensors, or set KERAS_PIPE_THREADS and call "
            "tf.config.threading.set_*_parallelism_threads yourself. Ranks may oversubscribe the cores.",
            stacklevel=2,
        )
        return None
    return threads
