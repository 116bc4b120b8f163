"""Saving and loading a pipeline as the equivalent ``keras.Sequential``.

A ``PipelineModel`` saved with ``model.save("model.keras")`` (called on every
rank, as in any Keras script) is one standard ``.keras`` file, written by
rank 0 alone: the equivalent ``keras.Sequential`` with every stage's weights
and optimizer state. Plain ``keras.models.load_model`` opens it without MPI
or keras_pipe; :func:`load_model` opens it (or any ``Sequential`` file) on
any number of ranks. Files are read on rank 0 only and each stage receives
its part, so the ranks need not share a filesystem.

Rank 0 holds the whole model while saving or loading: the file format has
no per-stage shards.
"""

from __future__ import annotations

import contextlib
import os

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.graph import trace as traces
from keras_pipe.model.transfer import ROOT, WholeArrays, fill, gathered, load_into, on_root
from keras_pipe.model.weights import ordered
from keras_pipe.mpi.failure import collective
from keras_pipe.mpi.files import atomic_path

# -- the whole model ----------------------------------------------


def skeleton(model) -> keras.Model:
    """The pipeline's model re-created whole from its configs, compiled as the pipeline is (for rank 0).

    A chain is the equivalent ``keras.Sequential``; a graph, its model's own
    class (a keras_hub ``GPT2CausalLM`` saves as one).
    """
    if model._pipeline_layers:
        shape, dtype = model._pipeline_input
        # (safe_mode off: the configs are this process's own layers', a Lambda's too; loading a file keeps it on)
        layers = [
            keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer), safe_mode=False)
            for layer in model._pipeline_layers
        ]
        whole = keras.Sequential([keras.Input(batch_shape=shape, dtype=dtype), *layers], name=model.name)
    else:
        config = keras.saving.serialize_keras_object(model._source)
        whole = keras.saving.deserialize_keras_object(config, safe_mode=False)
    if model.compiled:
        compile_whole(whole, model.get_compile_config())
    return whole


def compile_whole(whole, compile_config) -> None:
    """Compiles ``whole`` as ``compile_config`` says, and builds its optimizer.

    Not ``compile_from_config``: Keras skips it for a model whose class has a
    ``compile()`` of its own (keras_hub's task models), which would keep that
    class's default optimizer.
    """
    whole.compile(**keras.saving.deserialize_keras_object(compile_config))
    if whole.optimizer is not None and not whole.optimizer.built:
        whole.optimizer.build(whole.trainable_variables)


def of_layers(model) -> keras.Model:
    """The whole model made of this process's own layer objects (rank 0), for Keras to write.

    What :func:`skeleton` falls back on when a layer cannot be rebuilt from
    its config (a custom layer Keras cannot locate, or whose ``get_config``
    misses an argument): ``keras.Sequential`` saves such a model (it writes
    the configs; only loading needs the class), and so does this. A chain is
    a new ``keras.Sequential`` of the pipeline's layers, a graph a new
    the model the pipeline was made of; compiled as the pipeline is.
    The layers of other stages hold no weights here: call it inside
    :func:`compat.lent_values`.
    """
    if model._pipeline_layers:
        shape, dtype = model._pipeline_input
        whole = keras.Sequential(
            [keras.Input(batch_shape=shape, dtype=dtype), *model._pipeline_layers], name=model.name
        )
    else:
        # the model the pipeline was made of, its class kept (a keras_hub task, a subclassed model): a new
        # keras.Model over a task's graph is one Keras cannot load again where a layer of a nested model is
        # called outside it too (a language model's head on its backbone's token embedding)
        whole = traces.source_of(model._source) or model._source
    if model.compiled:
        compile_whole(whole, model.get_compile_config())
    return whole


def _rebuilt_or_none(model) -> keras.Model | None:
    """:func:`skeleton`, or ``None`` where the layers' configs cannot rebuild the model's weights.

    A layer Keras cannot rebuild from its config (see :func:`of_layers`), or
    one whose config does not hold all its weights: LoRA enabled on a
    keras_hub backbone (whose config builds its layers without it), so the
    rebuilt model has fewer weights than the pipeline gathered.
    """
    try:
        whole = skeleton(model)
    except Exception:  # noqa: BLE001 - a layer's from_config may raise anything; the layers themselves are written
        return None
    return whole if len(whole.weights) == len(ordered(model.engine)) else None


def to_whole(model) -> keras.Model | None:
    """The whole model as one Keras model on rank 0 (``None`` elsewhere); collective.

    With replicas, the first replica's pipeline gathers (the others hold the same weights).
    Rebuilt from the layers' configs (:func:`skeleton`): a model of its own, which the caller keeps.
    Where the configs cannot rebuild it (:func:`_rebuilt_or_none`), Keras' own save and load of
    this process's layers, lent every stage's weights for the moment (:func:`_standalone`).
    """
    parts = gathered(model)
    if parts is None:
        return None
    whole = _rebuilt_or_none(model)
    if whole is None:
        return _standalone(model, parts)
    fill(whole, parts)
    return whole


def _standalone(model, parts) -> keras.Model:
    """Rank 0: the model the pipeline was made of (its class kept: a keras_hub task stays one), holding every
    stage's weights, through Keras' own save and load (in memory, as Keras pickles a model).

    What Keras writes is what it writes for the unsplit model: LoRA kernels
    merged into the kernels they adapt (``Dense.save_own_variables``), so the
    model it loads has none. Compiled as the pipeline is.
    """
    with compat.lent_values([v for v, _, _ in ordered(model.engine)]):
        own = of_layers(model)
        fill(own, parts)
        data = compat.keras_pickle_bytes(own)
    return compat.keras_unpickle(data)


@contextlib.contextmanager
def whole_for_writing(model):
    """The whole model on rank 0 (``None`` elsewhere) for the time of writing it; collective.

    :func:`to_whole`, or where a layer cannot be rebuilt from its config,
    this process's own layers holding every stage's weights for that time
    (:func:`of_layers`): Keras writes what it would write for the unsplit
    model, and only loading needs the layer's class.
    """
    parts = gathered(model)
    if parts is None:
        yield None
        return
    whole = _rebuilt_or_none(model)
    if whole is not None:
        fill(whole, parts)
        yield whole
        return
    with compat.lent_values([v for v, _, _ in ordered(model.engine)]):
        whole = of_layers(model)
        fill(whole, parts)
        yield whole


def _json_specs(spec):
    """``(shape, dtype)`` pairs as JSON lists."""
    from keras_pipe.model.building import map_specs

    return map_specs(lambda shape, dtype: [list(shape), dtype], spec)


def _tuple_specs(spec):
    """The inverse of :func:`_json_specs`."""
    if isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], str):
        return (tuple(spec[0]), spec[1])
    if isinstance(spec, dict):
        return {k: _tuple_specs(v) for k, v in spec.items()}
    return [_tuple_specs(v) for v in spec]


def write_weights(model, filepath, overwrite: bool = True, finish=None, **kwargs) -> None:
    """``model.save_weights`` (collective); ``finish(path)`` runs on rank 0 on the complete file before its rename."""
    with whole_for_writing(model) as whole:

        def write(temporary):
            whole.save_weights(temporary, **kwargs)
            if finish is not None:
                finish(temporary)

        on_root(model.engine.world, lambda: write_atomically(filepath, overwrite, write), f"save weights to {filepath}")


def write_atomically(filepath, overwrite: bool, write) -> None:
    """``write(path)`` to a partial file beside ``filepath``, renamed over it once complete (see :mod:`files`).

    With ``overwrite=False`` an existing file is an error: Keras would ask on
    the terminal, which a rank of an MPI job cannot answer.
    """
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(f"{filepath} exists and overwrite=False; pass overwrite=True to replace it")
    with atomic_path(filepath) as temporary:
        write(temporary)


_DEFAULTS = PipelineOptions.defaults()


class SavingMethods:
    """``PipelineModel``'s saving and loading methods (a mixin; every one is collective but the configs)."""

    def get_config(self) -> dict:
        """The model's configuration: its layers (or its graph's model) and the pipeline's options.

        ``from_config`` re-creates it, as ``keras.Sequential``'s does, so that
        ``pickle``, ``keras.models.clone_model`` and Keras' serialization work.
        """
        config = {"name": self.name, "trainable": self.trainable}
        if self.dtype_policy.name != keras.config.dtype_policy().name:
            config["dtype"] = keras.dtype_policies.serialize(self.dtype_policy)
        config.update(self._options.given())
        if self._from_graph:
            config["model"] = keras.saving.serialize_keras_object(self._source)
            return config
        config["layers"] = [keras.saving.serialize_keras_object(layer) for layer in self._pipeline_layers]
        if self._pipeline_input is not None:
            config["input"] = keras.tree.map_structure(lambda x: x, _json_specs(self._pipeline_input))
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A model from :meth:`get_config` output (collective, as creating any ``PipelineModel`` is)."""
        import inspect

        config = dict(config)
        parameters = inspect.signature(cls.__init__).parameters
        accepted = set(parameters)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            # (a subclass that passes **kwargs on to PipelineModel takes its options and keras.Model's too)
            accepted |= set(_DEFAULTS) | {"name", "trainable", "dtype"}
        if "input_layers" in config and "output_layers" in config:
            # a Functional model's config (keras.Model(inputs, outputs).get_config()): its graph, not a chain
            kwargs = {k: v for k, v in config.items() if k in accepted and k not in ("layers", "inputs", "outputs")}
            graph = keras.Model.from_config(config, custom_objects=custom_objects)
            return cls.from_model(graph, **kwargs)
        layers = [keras.saving.deserialize_keras_object(c, custom_objects) for c in config.pop("layers", [])]
        source = config.pop("model", None)
        source = keras.saving.deserialize_keras_object(source, custom_objects) if source is not None else None
        spec = config.pop("input", None)
        kwargs = {k: v for k, v in config.items() if k in accepted}
        if source is not None:
            return cls.from_model(source, **kwargs)
        items = []
        if spec is not None:
            from keras_pipe.model.building import input_of, map_specs

            items.append(map_specs(input_of, _tuple_specs(spec)))
        return cls(items + layers, **kwargs) if items or layers else cls(**kwargs)

    @collective
    def __reduce__(self):
        """``pickle.dumps(model)``: the whole model, on every rank (collective), as Keras pickles a model.

        Rank 0 gathers the whole model (weights and optimizer state) and
        writes it as Keras' own pickle does (``.keras`` bytes); every rank
        gets those bytes, so each rank's pickle is the whole model, and
        ``pickle.loads`` (collective too, on any number of ranks) makes a
        pipeline of it with this one's options.
        """
        if not self.engine.built and self._source is None and self._pipeline_input is None:
            # its input is not known yet: no weights anywhere, the layers' configs are the model
            return (type(self).from_config, (self.get_config(),))
        self.build()
        world = self.engine.world
        with whole_for_writing(self) as whole:  # (collective: the whole model on rank 0, None elsewhere)
            data = on_root(
                world, lambda: np.frombuffer(compat.keras_pickle_bytes(whole), np.uint8), f"pickle {self.name!r}"
            )
        size = world.bcast_json(None if data is None else int(data.size), root=ROOT)
        data = world.bcast_array(data if data is not None else np.empty(size, np.uint8), root=ROOT)
        options = self._options.given()
        return (type(self)._unpickled, (data.tobytes(), dict(options, name=self.name)))

    @classmethod
    def _unpickled(cls, data: bytes, options: dict):
        """The pipeline of a pickled model (collective): every rank reads the bytes; rank 0's weights are taken."""
        from mpi4py import MPI

        whole = compat.keras_unpickle(data)
        compile_config = whole.get_compile_config() if whole.compiled else None
        # (from_model consumes the model: rank 0 reads a second one for the optimizer state)
        state = (
            compat.keras_unpickle(data) if compile_config is not None and MPI.COMM_WORLD.Get_rank() == ROOT else None
        )
        pipeline = cls.from_model(whole, **options)
        if compile_config is not None:
            pipeline.compile_from_config(compile_config)
            load_into(pipeline, state)
        return pipeline

    @collective
    def to_keras(self) -> keras.Model | None:
        """The whole model, weights and optimizer state, as one Keras model on rank 0 (``None`` elsewhere).

        A chain is a ``keras.Sequential``; a graph its model's own class.
        """
        self.build()
        return to_whole(self)

    to_sequential = to_keras

    @collective
    def save(self, filepath, overwrite: bool = True, zipped=None, **kwargs) -> None:
        """Writes one standard ``.keras`` file, from rank 0: the equivalent ``Sequential``.

        Plain ``keras.models.load_model`` opens the file in one process,
        without MPI or keras_pipe; :func:`keras_pipe.load_model` opens it on
        any number of ranks.
        """
        self.build()
        arguments = dict(kwargs)
        if zipped is not None:
            arguments["zipped"] = zipped
        with whole_for_writing(self) as whole:

            def write(temporary):
                whole.save(temporary, **arguments)

            on_root(self.engine.world, lambda: write_atomically(filepath, overwrite, write), f"save {filepath}")

    @collective
    def save_weights(self, filepath, overwrite: bool = True, **kwargs) -> None:
        """Writes the whole model's weights (and optimizer state) to one ``.weights.h5`` file, from rank 0."""
        write_weights(self, filepath, overwrite, **kwargs)

    @collective
    def load_weights(self, filepath, skip_mismatch: bool = False, **kwargs) -> None:
        """Reads a ``.weights.h5`` file of this model (or its ``Sequential``) on rank 0; each stage gets its part."""
        self.build()

        def read():
            whole = _rebuilt_or_none(self)
            if whole is not None:
                whole.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
                return whole
            # a layer Keras cannot rebuild from its config: this process's own layers read the file
            with compat.lent_values([v for v, _, _ in ordered(self.engine)]):
                whole = of_layers(self)
                whole.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
                return WholeArrays(whole)

        load_into(self, on_root(self.engine.world, read, f"load weights from {filepath}", reading=filepath))
