"""The process layer: MPI and what one process of the job sets up.

The communicator (:mod:`.comm`), stall reports (:mod:`.stall`), failing fast
(:mod:`.failure`), the ranks agreeing on entry to a collective and telling
how their values differ (:mod:`.agreement`), the process lifecycle
(:mod:`.runtime`), the layout of stages and replicas and this rank's place
(:mod:`.layout`, :mod:`.topology`), thread pools (:mod:`.threads`), GPUs
(:mod:`.devices`) and atomic files (:mod:`.files`).

A bottom layer beside :mod:`keras_pipe.schedules`: it imports only the root
modules (:mod:`keras_pipe.errors`, :mod:`keras_pipe.compat`); never a layer
above (graph, stage, engine, model), nor schedules.
"""
