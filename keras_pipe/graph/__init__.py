"""The model as data: its graph of nodes and the cut of that graph into stages.

What every rank knows of every call of the model (:mod:`.graph`) and which
nodes each stage runs, and what crosses between stages (:mod:`.cut`), tested
in one process.

May import :mod:`keras_pipe.schedules` and the root modules
(:mod:`keras_pipe.errors`, :mod:`keras_pipe.compat`); never
:mod:`keras_pipe.mpi` or a layer above (stage, engine, model).
"""
