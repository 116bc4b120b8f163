"""The process layer: MPI and what one process of the job sets up.

The communicator (:mod:`.comm`), stall reports (:mod:`.stall`), failing fast
(:mod:`.failure`), the ranks agreeing on entry to a collective and telling
how their values differ (:mod:`.agreement`), the process lifecycle
(:mod:`.runtime`), the layout of stages and replicas and this rank's place
(:mod:`.layout`, :mod:`.topology`), thread pools (:mod:`.threads`), GPUs
(:mod:`.devices`) and atomic files (:mod:`.files`).

Exports what plans a job without MPI (``__all__``): :class:`Layout` (which
rank is which stage of which replica, from the ranks' host names) and
:func:`choose_gpu` (which GPU a rank of a host uses).

A bottom layer beside :mod:`keras_pipe.schedules`: it imports only the root
modules (:mod:`keras_pipe.errors`, :mod:`keras_pipe.compat`); never a layer
above (graph, stage, engine, model), nor schedules. This ``__init__`` runs
before MPI has started (``keras_pipe/__init__.py`` imports
:mod:`.runtime` to start it): it imports only modules that import nothing
of MPI at module level (``tests/test_lint.py`` checks).
"""

from keras_pipe.mpi.devices import choose_gpu
from keras_pipe.mpi.layout import Layout

__all__ = ["Layout", "choose_gpu"]
