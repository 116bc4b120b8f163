"""One step across ranks: the pipeline under one ``PipelineModel``.

The engine and what it holds: the executor walking a stage's actions for a
batch and the end of its step, the links between stages, the sums over
replicas and of tied weights, the ranks' agreement on the model and the
steps, the virtual-stage chunks, which actions this rank runs, the exchange
of targets and predictions, the shared logs, and the tracing hook the
executor reports its spans to (the timeline that draws them is in
:mod:`keras_pipe.model`, beside the other Keras callbacks). The probe (a
real forward through the pipeline on the first batch) and the time profile
of ``balance="time"`` live here too, not in :mod:`keras_pipe.graph`: both
run the stages' nodes on every rank and share what they measured, a
collective.

May import :mod:`keras_pipe.stage`, :mod:`keras_pipe.graph`,
:mod:`keras_pipe.schedules`, :mod:`keras_pipe.mpi` and the root modules;
never :mod:`keras_pipe.model`.
"""
