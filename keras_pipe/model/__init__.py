"""The Keras model: ``PipelineModel`` and what makes it behave as a ``keras.Model``.

Building it from layers or a graph, ``fit``/``evaluate``/``predict`` around
Keras' own loop (:mod:`.calls`, :mod:`.datasets`), the ``compile()`` checks,
callbacks, the whole model's weights across ranks, ``summary()``, saving and
loading, and ``PipelineTimeline`` (:mod:`.timeline`, the Keras callback that
records steps through the engine's tracing hook). Every step it runs is handed to :mod:`keras_pipe.engine`.

The top layer: it may import :mod:`keras_pipe.engine`, :mod:`keras_pipe.stage`,
:mod:`keras_pipe.graph`, :mod:`keras_pipe.schedules`, :mod:`keras_pipe.mpi`
and the root modules (:mod:`keras_pipe.errors`, :mod:`keras_pipe.compat`);
nothing below imports it (the ``[importlinter]`` contracts in setup.cfg).
"""
