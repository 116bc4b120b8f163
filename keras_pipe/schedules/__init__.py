"""Schedules as plain data: 1F1B, GPipe, zero-bubble, interleaved, and what runs them on paper.

The actions of a schedule (:mod:`.actions`), the one-chunk schedules
(:mod:`.schedule`, which also names and makes every schedule), the virtual
stages' (:mod:`.virtual`) and zero-bubble ones (:mod:`.zero_bubble`), the
simulator's ideal clock (:mod:`.simulator`), ``schedule="auto"``
(:mod:`.auto`) and the cost model of a step (:mod:`.cost`). No tensors, no
MPI: generated and checked in one process.

A bottom layer: it imports only the root modules (:mod:`keras_pipe.errors`);
never :mod:`keras_pipe.mpi` nor any layer above.
"""
