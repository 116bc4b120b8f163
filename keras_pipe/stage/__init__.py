"""One stage's compute and nothing else: no MPI, no sends, no timing.

Compiled programs, the forward and the backward (split into ``I`` and ``W``,
or recorded), the replay of a stage's nodes, the gradient sums over
micro-batches, the update, the compiled loss term by term, micro-batch
bounds, the tensor-with-mask that crosses a boundary, and the batch
normalization whose statistics a stage moves once a batch.

May import :mod:`keras_pipe.graph`, :mod:`keras_pipe.schedules` and the root
modules (:mod:`keras_pipe.errors`, :mod:`keras_pipe.compat`); never
:mod:`keras_pipe.mpi`, :mod:`keras_pipe.engine` or :mod:`keras_pipe.model`.
(Today it needs neither graph nor schedules.)
"""
