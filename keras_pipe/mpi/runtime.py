"""The process's lifecycle: what importing keras_pipe sets up, and how a pipeline joins the job.

Two moments, one function each:

- **Import** (:func:`start_process`, called once by ``keras_pipe/__init__.py``
  before anything imports TensorFlow's ops): MPI starts under the start
  timeout's deadline (:mod:`keras_pipe.mpi.start`), an uncaught exception on
  any rank is made to end the whole job (:mod:`keras_pipe.mpi.failure`), and
  TensorFlow's thread pools and this rank's GPU are chosen from the
  launcher's environment (:mod:`keras_pipe.mpi.threads`,
  :mod:`keras_pipe.mpi.devices`): both can only be set before TensorFlow's
  first op. No rank communicates with another.
- **A pipeline joins the job** (:func:`join_job`, collective: each
  ``PipelineModel``'s engine calls it on every rank): the ranks meet, lay
  out stages and replicas, start agreeing on entry to collective methods,
  and, where the launcher did not say how many ranks share a host, size the
  pools and choose the GPUs from the hosts they gathered. What is once per
  process happens for the first pipeline; the layout is each pipeline's own.

This module is imported before MPI has started: at module level it imports
only what does not start it (:mod:`keras_pipe.mpi.start`, ``threads``,
``devices``); ``failure``, ``topology`` and ``agreement`` import mpi4py, and
are imported in the functions, after :func:`start_process` started MPI
under its deadline.
"""

from __future__ import annotations

from keras_pipe.mpi import devices, threads
from keras_pipe.mpi.start import start_mpi

_started = False


def start_process() -> None:
    """What ``import keras_pipe`` does, once: MPI under a deadline, the failure hook, threads, GPU; no messages."""
    global _started
    if _started:
        return
    # First MPI, under its deadline (a rank that failed before starting MPI would leave this one in MPI_Init for
    # ever), then the hook that makes an uncaught error on one rank end the whole job: both before TensorFlow,
    # whose import may fail on a broken host. Then TensorFlow's pools and this rank's GPU, before its first op.
    start_mpi()
    from keras_pipe.mpi.failure import install_excepthook

    install_excepthook()
    threads.configure_threads(warn=False)
    devices.try_configure_gpus()  # (a failure is kept, and raised on every rank by join_job)
    _started = True


def join_job(num_stages: int | None, stall_timeout: float | None):
    """Places this rank in a pipeline of the job (collective): its :class:`~keras_pipe.mpi.topology.Topology`.

    Raises on every rank where the ranks disagree on ``num_stages`` or any
    rank could not choose its GPU.
    """
    from keras_pipe.mpi.agreement import start_entry_agreement
    from keras_pipe.mpi.topology import connect

    topology = connect(num_stages, stall_timeout)
    start_entry_agreement(topology.world)
    hosts, me = topology.layout.hosts, topology.layout.hosts[topology.world.rank]
    threads.configure_threads(ranks_on_host=hosts.count(me))
    devices.try_configure_gpus(local_rank=hosts[: topology.world.rank].count(me), local_size=hosts.count(me))
    devices.check_all_ranks(topology.world)
    return topology


def init() -> None:
    """Prepares this process for keras_pipe, which its import has already done (idempotent, no communication).

    Kept for scripts written for keras_pipe 0.2, which called it first thing
    to have the failure hook from their first line: since 0.3 importing
    keras_pipe starts MPI, installs the hook and sizes TensorFlow's thread
    pools, and ``python -m keras_pipe train.py`` does so before the script's
    first line.

    Example:

    ```python
    import keras_pipe
    keras_pipe.init()      # does nothing more: the import did it
    ```
    """
    start_process()
