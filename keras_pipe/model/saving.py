"""Saving and loading a pipeline as the equivalent unsplit Keras model, and the routes between them.

A ``PipelineModel`` saved with ``model.save("model.keras")`` (called on every
rank, as in any Keras script) is one standard ``.keras`` file, written by
rank 0 alone as each stage sends its layers' values (:mod:`.streaming`): the
equivalent ``keras.Sequential`` (or the model's own class) with every
stage's weights and optimizer state. Plain ``keras.models.load_model`` opens
it without MPI or keras_pipe; :func:`load_model` opens it (or any
``Sequential`` file) on any number of ranks, rank 0 reading it entry by
entry, so the ranks need not share a filesystem. A ``.weights.json`` path is
Keras' sharded layout, written and read a stage a rank (:mod:`.sharded`).

What needs the whole model in one process (``to_keras``, ``export``,
pickling, other formats) builds it on rank 0, after checking rank 0's host
has the memory (:meth:`ModelSaver.check_whole_fits`). :class:`ModelSaver`
does the model's saving methods (the model holds one and delegates to it);
:func:`from_config` and :func:`unpickled` make a model from a config or a
pickle.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.errors import PipelineConfigError, PipelineIOError
from keras_pipe.graph import trace as traces
from keras_pipe.model import sharded, streaming
from keras_pipe.model.building import input_of, map_specs
from keras_pipe.model.transfer import ROOT, WholeArrays, fill, gathered, load_into, numpy_dtype, on_root
from keras_pipe.model.weights import ordered
from keras_pipe.mpi.files import atomic_path

_DEFAULTS = PipelineOptions.defaults()
EXPORT_FORMATS = ("tf_saved_model", "onnx", "openvino", "litert", "torch")  # keras.Model.export's, Keras 3.15


class ModelSaver:
    """A ``PipelineModel``'s configuration, pickle, files and whole model on rank 0.

    Not a Keras object: the model holds it untracked. Every method but
    :meth:`config` is collective; the model's methods that call them are
    agreed on entry (``@collective``), these are not.

    Args:
        model: the ``PipelineModel``, for Keras' side of it: its ``name``,
            ``trainable`` flag and dtype policy, whether it is compiled and
            its compile config, its optimizer, ``build()`` and ``get_config()``.
        builder: its :class:`~keras_pipe.model.building.ModelBuilder` (a
            chain's layers and input, or the graph's model).
        engine: its :class:`~keras_pipe.engine.engine.Engine` (the world;
            every stage's weights in the whole model's order).
        options: its :class:`~keras_pipe.engine.options.PipelineOptions`, as
            given (the config and the pickle carry those that differ from
            the defaults).
    """

    def __init__(self, model, builder, engine, options: PipelineOptions):
        self.model = model
        self.builder = builder
        self.engine = engine
        self.options = options

    # -- configs and pickles -------------------------------------------------

    def config(self) -> dict:
        """``model.get_config()``: its layers (or its graph's model) and the pipeline's options."""
        model, builder = self.model, self.builder
        config = {"name": model.name, "trainable": model.trainable}
        if model.dtype_policy.name != keras.config.dtype_policy().name:
            config["dtype"] = keras.dtype_policies.serialize(model.dtype_policy)
        config.update(self.options.given())
        if builder.from_graph:
            config["model"] = keras.saving.serialize_keras_object(builder.source)
            return config
        config["layers"] = [keras.saving.serialize_keras_object(layer) for layer in builder.layers]
        if builder.input_spec is not None:
            config["input"] = keras.tree.map_structure(lambda x: x, _json_specs(builder.input_spec))
        return config

    def reduce(self):
        """``model.__reduce__()``: rank 0's ``.keras`` bytes of the whole model, on every rank (collective)."""
        model, builder = self.model, self.builder
        if not self.engine.built and builder.source is None and builder.input_spec is None:
            # its input is not known yet: no weights anywhere, the layers' configs are the model
            return (type(model).from_config, (model.get_config(),))
        model.build()
        world = self.engine.world
        with self.whole_for_writing("pickling the model") as whole:  # (collective: the whole model on rank 0 alone)
            data = on_root(
                world, lambda: np.frombuffer(compat.keras_pickle_bytes(whole), np.uint8), f"pickle {model.name!r}"
            )
        size = world.bcast_json(None if data is None else int(data.size), root=ROOT)
        data = world.bcast_array(data if data is not None else np.empty(size, np.uint8), root=ROOT)
        return (type(model)._unpickled, (data.tobytes(), dict(self.options.given(), name=model.name)))

    # -- files ------------------------------------------------------------------

    def save(self, filepath, overwrite: bool = True, zipped=None, **kwargs) -> None:
        """``model.save``: rank 0 writes the whole model's ``.keras`` file (collective).

        A ``.keras`` path: rank 0 writes each layer's weights as the stage answering for it sends them
        (:mod:`.streaming`), holding its own stage and one layer's values; other formats (``zipped=False``, a
        legacy ``.h5``) go through the whole model on rank 0.
        """
        self.model.build()
        if os.fspath(filepath).endswith(".keras") and zipped in (None, True) and not kwargs:

            def write(write_entries):
                with self.described() as whole:  # (its config and compile config; the weights are streamed)
                    write_atomically(
                        filepath,
                        overwrite,
                        lambda temporary: compat.write_keras_archive(temporary, whole, write_entries),
                    )

            streaming.save(self, write, f"save {filepath}")
            return
        arguments = dict(kwargs)
        if zipped is not None:
            arguments["zipped"] = zipped
        with self.whole_for_writing(f"saving {filepath}") as whole:

            def write(temporary):
                whole.save(temporary, **arguments)

            on_root(self.engine.world, lambda: write_atomically(filepath, overwrite, write), f"save {filepath}")

    def save_weights(self, filepath, overwrite: bool = True, finish=None, keep=(), **kwargs) -> None:
        """``model.save_weights`` (collective); ``finish(path)`` runs on rank 0 on the complete file before its
        rename (``BackupAndRestore`` marks its position in it).

        A ``.weights.h5`` path: rank 0 writes each layer's entry as the stage answering for it sends it
        (:mod:`.streaming`). A ``.weights.json`` path, or ``max_shard_size``: Keras' sharded layout, a stage a
        rank (:mod:`.sharded`;
        ``finish(metadata)`` then adds to the index's metadata; ``keep``: other indexes whose shards stay).
        """
        if sharded.wants_sharded(filepath, kwargs.get("max_shard_size")):
            sharded.save(self, filepath, overwrite, kwargs.pop("max_shard_size", None), finish, keep)
            return
        if os.fspath(filepath).endswith(".weights.h5") and not kwargs:

            def write(write_entries):
                def into(temporary):
                    store = compat.weights_file_writer(temporary)
                    try:
                        write_entries(store)
                    finally:
                        store.close()
                    if finish is not None:
                        finish(temporary)

                write_atomically(filepath, overwrite, into)

            streaming.save(self, write, f"save weights to {filepath}")
            return
        with self.whole_for_writing(f"saving {filepath}") as whole:

            def write(temporary):
                whole.save_weights(temporary, **kwargs)
                if finish is not None:
                    finish(temporary)

            on_root(
                self.engine.world, lambda: write_atomically(filepath, overwrite, write), f"save weights to {filepath}"
            )

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs) -> None:
        """``model.export``: rank 0 exports the whole model, as Keras exports the unsplit one (collective).

        The artifact (a SavedModel directory, or an ONNX, LiteRT... file) is
        Keras' export of :meth:`whole_for_writing`'s model, so it serves
        without MPI or keras_pipe; it replaces ``filepath`` only once complete.
        """
        if format not in EXPORT_FORMATS:  # (Keras' own check and words, on every rank before any communication)
            raise PipelineConfigError(f"Unrecognized format={format}. Supported formats are: {list(EXPORT_FORMATS)}.")
        self.model.build()
        with self.whole_for_writing(f"export({filepath!r})") as whole:

            def write(temporary):
                printed = io.StringIO()  # (Keras names the path it wrote: the partial one, renamed after)
                with contextlib.redirect_stdout(printed):
                    whole.export(temporary, format=format, verbose=verbose, input_signature=input_signature, **kwargs)
                print(printed.getvalue().replace(temporary, os.fspath(filepath)), end="")

            on_root(self.engine.world, lambda: write_atomically(filepath, True, write), f"export {filepath}")

    def refuse_one_process_writer(self, what: str) -> None:
        """Refuses, alike on every rank, a writer of one process's objects (Keras' ``saving_lib``, TensorFlow's
        checkpoints) where this rank holds only its stage: each rank would write its part over the same path."""
        stages = self.engine.num_stages
        if stages == 1:
            return
        raise PipelineConfigError(
            f"{what} writes one process's objects, and with {stages} stages each rank holds only its stage's "
            "weights: every rank would write its part over the same path. Use model.save(path) (a .keras file), "
            "model.save_weights(path), model.export(path), or the ModelCheckpoint and BackupAndRestore callbacks: "
            "every rank takes part, and rank 0 writes the whole model."
        )

    def load_weights(self, filepath, skip_mismatch: bool = False, **kwargs) -> None:
        """``model.load_weights``: rank 0 reads the file into the whole model; each stage gets its part.

        A ``.weights.json`` (Keras' sharded layout): every rank reads its own stage's values (:mod:`.sharded`).
        A ``.weights.h5`` or ``.keras``: rank 0 reads it entry by entry, each sent to the ranks holding it
        (:mod:`.streaming`).
        """
        if os.fspath(filepath).endswith(sharded.INDEX):
            if kwargs:
                raise PipelineConfigError(f"load_weights got unexpected arguments {sorted(kwargs)}")
            sharded.load(self, filepath, skip_mismatch)
            return
        if os.fspath(filepath).endswith((".weights.h5", ".keras")) and not kwargs:
            streaming.load(self, filepath, skip_mismatch)
            return
        self.model.build()

        def read():
            whole = self.rebuilt_or_none()
            if whole is not None:
                whole.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
                return whole
            # a layer Keras cannot rebuild from its config: this process's own layers read the file
            with compat.lent_values([v for v, _, _ in ordered(self.engine)]):
                whole = self.of_layers()
                whole.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
                return WholeArrays(whole)

        load_into(self.model, on_root(self.engine.world, read, f"load weights from {filepath}", reading=filepath))

    # -- the whole model on rank 0 ------------------------------------------------

    def skeleton(self, build_optimizer: bool = True) -> keras.Model:
        """The pipeline's model re-created whole from its configs, compiled as the pipeline is (for rank 0).

        A chain is the equivalent ``keras.Sequential``; a graph, its model's own
        class (a keras_hub ``GPT2CausalLM`` saves as one).
        """
        model, builder = self.model, self.builder
        if builder.layers:
            shape, dtype = builder.input_spec
            # (safe_mode off: the configs are this process's own layers', a Lambda's too; loading a file keeps it on)
            layers = [
                keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer), safe_mode=False)
                for layer in builder.layers
            ]
            whole = keras.Sequential([keras.Input(batch_shape=shape, dtype=dtype), *layers], name=model.name)
        else:
            config = keras.saving.serialize_keras_object(builder.source)
            whole = keras.saving.deserialize_keras_object(config, safe_mode=False)
        if model.compiled:
            compile_whole(whole, model.get_compile_config(), build=build_optimizer)
        return whole

    def of_layers(self, build_optimizer: bool = True) -> keras.Model:
        """The whole model made of this process's own layer objects (rank 0), for Keras to write.

        What :meth:`skeleton` falls back on when a layer cannot be rebuilt from
        its config (a custom layer Keras cannot locate, or whose ``get_config``
        misses an argument): ``keras.Sequential`` saves such a model (it writes
        the configs; only loading needs the class), and so does this. A chain is
        a new ``keras.Sequential`` of the pipeline's layers, a graph
        the model the pipeline was made of; compiled as the pipeline is.
        The layers of other stages hold no weights here: call it inside
        :func:`compat.lent_values`.
        """
        model, builder = self.model, self.builder
        if builder.layers:
            shape, dtype = builder.input_spec
            whole = keras.Sequential([keras.Input(batch_shape=shape, dtype=dtype), *builder.layers], name=model.name)
        else:
            # the model the pipeline was made of, its class kept (a keras_hub task, a subclassed model): a new
            # keras.Model over a task's graph is one Keras cannot load again where a layer of a nested model is
            # called outside it too (a language model's head on its backbone's token embedding)
            whole = traces.source_of(builder.source) or builder.source
        if model.compiled:
            compile_whole(whole, model.get_compile_config(), build=build_optimizer)
        return whole

    def walked(self) -> keras.Model:
        """The whole model of this process's own layers, for Keras' walk of its weights (every rank, no memory).

        A chain's layers in a ``keras.Sequential`` left unbuilt (building it
        would call another stage's layers, whose weights this rank does not
        hold); a graph's, the model the pipeline was made of. Keras' walk names
        each entry as in the unsplit model's file (:mod:`.sharded`, :mod:`.streaming`).
        """
        builder = self.builder
        if builder.layers:
            return keras.Sequential(list(builder.layers), name=self.model.name)
        return traces.source_of(builder.source) or builder.source

    @contextlib.contextmanager
    def described(self):
        """The whole model for its config and compile config (its optimizer not built), on rank 0, for the time of
        writing a ``.keras`` file whose weights are streamed: rebuilt from the layers' configs without memory for
        its weights, or where that fails (a layer Keras cannot rebuild), this process's own layers lent values."""
        try:
            with compat.unallocated_scope():
                whole = self.skeleton(build_optimizer=False)
        except Exception:  # noqa: BLE001 - a layer's from_config may raise anything; the layers themselves are written
            whole = None
        if whole is not None and len(whole.weights) == len(ordered(self.engine)):  # (LoRA: see rebuilt_or_none)
            yield whole
            return
        with compat.lent_values([v for v, _, _ in ordered(self.engine)]):
            yield self.of_layers(build_optimizer=False)

    def rebuilt_or_none(self) -> keras.Model | None:
        """:meth:`skeleton`, or ``None`` where the layers' configs cannot rebuild the model's weights.

        A layer Keras cannot rebuild from its config (see :meth:`of_layers`), or
        one whose config does not hold all its weights: LoRA enabled on a
        keras_hub backbone (whose config builds its layers without it), so the
        rebuilt model has fewer weights than the pipeline gathered.
        """
        try:
            whole = self.skeleton()
        except Exception:  # noqa: BLE001 - a layer's from_config may raise anything; the layers themselves are written
            return None
        return whole if len(whole.weights) == len(ordered(self.engine)) else None

    def check_whole_fits(self, what: str, available: int | None = None) -> None:
        """Refuses, alike on every rank and before anything moves, a route that builds the whole model on rank 0
        (``to_keras``, ``export``, pickling) where rank 0's host has not the memory for it
        (collective).

        The need: the whole model's weights and optimizer state twice over
        (the arrays gathered, and the model they fill). ``available``: the
        bytes rank 0's host has (``MemAvailable``, Linux; unknown elsewhere:
        no check).
        """
        engine, model = self.engine, self.model
        optimizer = model.optimizer if model.compiled else None
        here = 0
        if engine.replica == 0:
            here = sum(_nbytes(v) for v, owner, held in ordered(engine) if held and owner == engine.stage)
            if optimizer is not None and optimizer.built:
                here += sum(_nbytes(v) for v in optimizer.variables)
        state = sum(engine.world.allgather_json(int(here)))
        if engine.world.rank == 0 and available is None:
            available = host_memory_available()
        available = engine.world.bcast_json(available if engine.world.rank == 0 else None, root=0)
        if available is not None and 2 * state > available:
            gib = 1024**3
            raise PipelineIOError(
                f"{what} builds the whole model on rank 0: its weights and optimizer state ({state / gib:.1f} GiB), "
                f"gathered and then set into the model, need about {2 * state / gib:.1f} GiB, and rank 0's host has "
                f"{available / gib:.1f} GiB available. Save a sharded checkpoint instead, a stage a rank: "
                "model.save_weights('ck.weights.json') (plain Keras' load_weights reads it where memory allows); "
                "model.save('model.keras') also streams through rank 0 a layer at a time."
            )

    def to_keras(self) -> keras.Model | None:
        """``model.to_keras()``: the whole model as one Keras model on rank 0 (``None`` elsewhere); collective.

        With replicas, the first replica's pipeline gathers (the others hold the same weights).
        Rebuilt from the layers' configs (:meth:`skeleton`): a model of its own, which the caller keeps.
        Where the configs cannot rebuild it (:meth:`rebuilt_or_none`), Keras' own save and load of
        this process's layers, lent every stage's weights for the moment (:meth:`_standalone`).
        """
        self.model.build()
        self.check_whole_fits("to_keras()")
        parts = gathered(self.model)
        if parts is None:
            return None
        whole = self.rebuilt_or_none()
        if whole is None:
            return self._standalone(parts)
        fill(whole, parts)
        return whole

    def _standalone(self, parts) -> keras.Model:
        """Rank 0: the model the pipeline was made of (its class kept: a keras_hub task stays one), holding every
        stage's weights, through Keras' own save and load (in memory, as Keras pickles a model).

        What Keras writes is what it writes for the unsplit model: LoRA kernels
        merged into the kernels they adapt (``Dense.save_own_variables``), so the
        model it loads has none. Compiled as the pipeline is.
        """
        with compat.lent_values([v for v, _, _ in ordered(self.engine)]):
            own = self.of_layers()
            fill(own, parts)
            data = compat.keras_pickle_bytes(own)
        return compat.keras_unpickle(data)

    @contextlib.contextmanager
    def whole_for_writing(self, what: str = "writing the whole model"):
        """The whole model on rank 0 (``None`` elsewhere) for the time of writing it; collective.

        :meth:`to_keras`'s model, or where a layer cannot be rebuilt from its
        config, this process's own layers holding every stage's weights for
        that time (:meth:`of_layers`): Keras writes what it would write for the
        unsplit model, and only loading needs the layer's class.
        """
        self.check_whole_fits(what)
        parts = gathered(self.model)
        if parts is None:
            yield None
            return
        whole = self.rebuilt_or_none()
        if whole is not None:
            fill(whole, parts)
            yield whole
            return
        with compat.lent_values([v for v, _, _ in ordered(self.engine)]):
            whole = self.of_layers()
            fill(whole, parts)
            yield whole


def from_config(cls, config, custom_objects=None):
    """``cls.from_config(config)``: a model from ``get_config()`` output (or a Functional model's config)."""
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
        items.append(map_specs(input_of, _tuple_specs(spec)))
    return cls(items + layers, **kwargs) if items or layers else cls(**kwargs)


def unpickled(cls, data: bytes, options: dict):
    """The pipeline (of class ``cls``) of a pickled model (collective): every rank reads the bytes; rank 0's
    weights and optimizer state are taken."""
    from mpi4py import MPI

    whole = compat.keras_unpickle(data)
    compile_config = whole.get_compile_config() if whole.compiled else None
    # (from_model consumes the model: rank 0 reads a second one for the optimizer state)
    state = compat.keras_unpickle(data) if compile_config is not None and MPI.COMM_WORLD.Get_rank() == ROOT else None
    pipeline = cls.from_model(whole, **options)
    if compile_config is not None:
        pipeline.compile_from_config(compile_config)
        load_into(pipeline, state)
    return pipeline


def compile_whole(whole, compile_config, build: bool = True) -> None:
    """Compiles ``whole`` as ``compile_config`` says, and builds its optimizer (unless ``build`` is false).

    Not ``compile_from_config``: Keras skips it for a model whose class has a
    ``compile()`` of its own (keras_hub's task models), which would keep that
    class's default optimizer.
    """
    whole.compile(**keras.saving.deserialize_keras_object(compile_config))
    if build and whole.optimizer is not None and not whole.optimizer.built:
        whole.optimizer.build(whole.trainable_variables)


def write_atomically(filepath, overwrite: bool, write) -> None:
    """``write(path)`` to a partial file beside ``filepath``, renamed over it once complete (see :mod:`files`).

    With ``overwrite=False`` an existing file is an error: Keras would ask on
    the terminal, which a rank of an MPI job cannot answer.
    """
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(f"{filepath} exists and overwrite=False; pass overwrite=True to replace it")
    with atomic_path(filepath) as temporary:
        write(temporary)


def _json_specs(spec):
    """``(shape, dtype)`` pairs as JSON lists."""
    return map_specs(lambda shape, dtype: [list(shape), dtype], spec)


def _tuple_specs(spec):
    """The inverse of :func:`_json_specs`."""
    if isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], str):
        return (tuple(spec[0]), spec[1])
    if isinstance(spec, dict):
        return {k: _tuple_specs(v) for k, v in spec.items()}
    return [_tuple_specs(v) for v in spec]


def host_memory_available() -> int | None:
    """The bytes this host has available (Linux's ``MemAvailable``), or ``None`` where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _nbytes(variable) -> int:
    return int(np.prod(variable.shape, dtype=np.int64)) * numpy_dtype(variable.dtype).itemsize
