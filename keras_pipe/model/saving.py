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
from keras_pipe.errors import PipelineIOError
from keras_pipe.graph import trace as traces
from keras_pipe.model.weights import copy_from_first_replica, ordered
from keras_pipe.mpi.comm import TAG_STATE, Communicator
from keras_pipe.mpi.failure import collective
from keras_pipe.mpi.files import atomic_path, describe_unreadable

ROOT = 0


# -- moving arrays between rank 0 and the stages ---------------------------


def gather_to_root(comm: Communicator, arrays: list[np.ndarray]) -> list[list[np.ndarray]] | None:
    """Every rank's list of arrays, on rank 0 (``None`` elsewhere); shapes travel as JSON."""
    arrays = [np.asarray(a) for a in arrays]
    shapes = comm.allgather_json([[list(a.shape), a.dtype.str] for a in arrays])
    if comm.rank != ROOT:
        for array in arrays:
            comm.send(array, ROOT, TAG_STATE)
        comm.flush()
        return None
    gathered = []
    for rank, shape_list in enumerate(shapes):
        if rank == ROOT:
            gathered.append(arrays)
        else:
            gathered.append([comm.recv_exact(rank, TAG_STATE, tuple(shape), dtype) for shape, dtype in shape_list])
    return gathered


def scatter_from_root(comm: Communicator, per_rank: list[list[np.ndarray]] | None) -> list[np.ndarray]:
    """Rank ``r`` gets ``per_rank[r]`` from rank 0."""
    shapes = comm.bcast_json(
        [[[list(np.shape(a)), np.asarray(a).dtype.str] for a in arrays] for arrays in per_rank]
        if comm.rank == ROOT
        else None,
        root=ROOT,
    )
    if comm.rank == ROOT:
        for rank, arrays in enumerate(per_rank):
            if rank != ROOT:
                for array in arrays:
                    comm.send(np.asarray(array), rank, TAG_STATE)
        comm.flush()
        return [np.asarray(a) for a in per_rank[ROOT]]
    return [comm.recv_exact(ROOT, TAG_STATE, tuple(shape), dtype) for shape, dtype in shapes[comm.rank]]


def on_root(comm: Communicator, action, what: str, reading=None):
    """Runs ``action`` on rank 0; if it fails, every rank raises the same error.

    ``reading``: the file ``action`` reads, so that the error says what is wrong with it.
    """
    result, error = None, None
    if comm.rank == ROOT:
        try:
            result = action()
        except Exception as failure:  # noqa: BLE001 - re-raised on every rank below
            error = describe_unreadable(reading, failure) if reading else f"{type(failure).__name__}: {failure}"
    error = comm.bcast_json(error, root=ROOT)
    if error is not None:
        raise PipelineIOError(f"rank 0 could not {what}: {error}")
    return result


# -- optimizer state ------------------------------------------------------


def optimizer_state(optimizer, indexed: list, others=()) -> dict[str, np.ndarray]:
    """The optimizer's variables keyed so that stages and the whole model agree.

    ``indexed``: ``(variable, model-wide index)`` of the trainable weights
    whose slots to take; ``others``: weights whose slots to leave out (a
    copy of a weight another stage answers for). A slot (Adam's momentum of
    a kernel, say) is keyed by the model-wide index of its weight and the
    slot's name (Keras names it after the weight's path); the optimizer's
    own variables (iteration count, learning rate) by their names.
    """
    return {key: np.asarray(slot.numpy()) for key, slot in _slots(optimizer, indexed, others).items()}


def assign_optimizer_state(optimizer, indexed: list, state: dict) -> None:
    """Sets the optimizer's variables from :func:`optimizer_state` output (of any split)."""
    slots = _slots(optimizer, indexed)
    missing = sorted(set(slots) - set(state))
    if missing:
        raise PipelineIOError(f"the saved optimizer state lacks {missing[:5]}: was it saved with another optimizer?")
    for key, slot in slots.items():
        slot.assign(state[key])


def _slots(optimizer, indexed: list, others=()) -> dict:
    keys = [(_path_key(v), index) for v, index in indexed] + [(_path_key(v), None) for v in others]
    keys.sort(key=lambda pair: -len(pair[0]))  # longest prefix first: "d1_kernel_2" before "d1_kernel"
    slots = {}
    for slot in optimizer.variables:
        for prefix, index in keys:
            if slot.name.startswith(prefix + "_"):
                if index is not None:
                    slots[f"{index}:{slot.name[len(prefix) + 1 :]}"] = slot
                break
        else:
            slots[f"optimizer:{slot.name}"] = slot
    return slots


def _path_key(variable) -> str:
    return variable.path.replace("/", "_")


def trainable_index(model_weights) -> dict:
    """``id(variable) -> index`` among the trainable ones of ``model_weights`` (the model-wide key of its slots)."""
    trainable = [v for v in model_weights if v.trainable]
    return {id(v): i for i, v in enumerate(trainable)}


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
    parts = _gathered(model)
    if parts is None:
        return None
    whole = _rebuilt_or_none(model)
    if whole is None:
        return _standalone(model, parts)
    _fill(whole, parts)
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
        _fill(own, parts)
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
    parts = _gathered(model)
    if parts is None:
        yield None
        return
    whole = _rebuilt_or_none(model)
    if whole is not None:
        _fill(whole, parts)
        yield whole
        return
    with compat.lent_values([v for v, _, _ in ordered(model.engine)]):
        whole = of_layers(model)
        _fill(whole, parts)
        yield whole


def _gathered(model):
    """Every stage's weights and optimizer state, on rank 0 (``None`` elsewhere); collective."""
    if model.replica_index != 0:
        return None
    engine = model.engine
    comm = engine.pipeline
    entries = ordered(engine)
    answered = [position for position, (_, owner, _) in enumerate(entries) if owner == engine.stage]
    gathered = gather_to_root(comm, [entries[p][0].numpy() for p in answered])
    positions = comm.allgather_json(answered)
    optimizer = model.optimizer if model.compiled else None
    with_optimizer = comm.allgather_json(bool(optimizer is not None and optimizer.built))
    opt_parts = None
    if all(with_optimizer):
        index = trainable_index([v for v, _, _ in entries])
        indexed = [(entries[p][0], index[id(entries[p][0])]) for p in answered if id(entries[p][0]) in index]
        answered_ids = {id(v) for v, _ in indexed}
        copies = [v for v in engine.trainable_variables if id(v) not in answered_ids]
        state = optimizer_state(optimizer, indexed, copies)
        names = sorted(state)
        parts = gather_to_root(comm, [state[name] for name in names])
        keys = comm.allgather_json(names)
        opt_parts = [dict(zip(k, p)) for k, p in zip(keys, parts)] if parts is not None else None
    if comm.rank != ROOT:
        return None
    values = [None] * len(entries)
    for stage_positions, arrays in zip(positions, gathered):
        for p, array in zip(stage_positions, arrays):
            values[p] = array
    return values, opt_parts


def _fill(whole: keras.Model, parts) -> None:
    values, opt_parts = parts
    whole.set_weights(values)
    if opt_parts is not None and whole.optimizer is not None:
        merged = {}
        for part in opt_parts:
            merged.update(part)  # the optimizer's own variables are the same on every stage
        index = trainable_index(whole.weights)
        assign_optimizer_state(whole.optimizer, [(v, index[id(v)]) for v in whole.trainable_variables], merged)


class WholeArrays:
    """A whole model's weights (in its ``weights`` order) and optimizer state, as numpy arrays (rank 0).

    What :func:`load_into` takes where the whole model only lived for a
    moment (its layers are this process's own, :func:`of_layers`).
    """

    def __init__(self, whole: keras.Model):
        self.values = [np.asarray(w.numpy()) for w in whole.weights]
        self.state = None
        if getattr(whole, "optimizer", None) is not None and whole.optimizer.built:
            index = trainable_index(whole.weights)
            self.state = optimizer_state(whole.optimizer, [(v, index[id(v)]) for v in whole.trainable_variables])


def load_into(model, whole: keras.Model | WholeArrays | None) -> None:
    """Gives every stage its weights (and optimizer state) from ``whole`` on rank 0; collective.

    The first replica's pipeline receives them from rank 0, then passes them to the other replicas.
    """
    if model.replica_index == 0:
        _load_pipeline(model, whole)
    copy_from_first_replica(model.engine, model.optimizer if model.compiled else None)


def _load_pipeline(model, whole) -> None:
    engine = model.engine
    comm = engine.pipeline
    entries = ordered(engine)
    held = comm.allgather_json([p for p, (_, _, here) in enumerate(entries) if here])
    per_rank = None
    if comm.rank == ROOT and not isinstance(whole, WholeArrays):
        whole = WholeArrays(whole)
    if comm.rank == ROOT:
        values = whole.values
        if len(values) != len(entries):
            raise PipelineIOError(f"the file holds {len(values)} weights but the model has {len(entries)}")
        per_rank = [[values[p] for p in positions] for positions in held]
    received = scatter_from_root(comm, per_rank)
    for p, value in zip(held[comm.rank], received):
        entries[p][0].assign(value)
    has_state = comm.bcast_json(
        bool(whole is not None and whole.state is not None and model.compiled) if comm.rank == ROOT else None,
        root=ROOT,
    )
    if not has_state or not model.compiled:
        return
    index = trainable_index([v for v, _, _ in entries])
    wanted = comm.allgather_json(
        sorted({index[id(entries[p][0])] for p in held[comm.rank] if id(entries[p][0]) in index})
    )
    per_rank_state = keys = None
    if comm.rank == ROOT:
        full = whole.state
        keys = [sorted(k for k in full if k.startswith("optimizer:") or int(k.split(":")[0]) in set(w)) for w in wanted]
        per_rank_state = [[full[k] for k in ks] for ks in keys]
    keys = comm.bcast_json(keys, root=ROOT)[comm.rank]
    values = scatter_from_root(comm, per_rank_state)
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(engine.trainable_variables)
    indexed = [(v, index[id(v)]) for v in engine.trainable_variables if id(v) in index]
    assign_optimizer_state(optimizer, indexed, dict(zip(keys, values)))


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
