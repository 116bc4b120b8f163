"""What makes a ``PipelineModel`` a model: its layers or graph, building, calling it, shapes, other models.

:class:`ModelBuilder` is the part of the façade that ``keras.Sequential``
and Functional models have: ``add``/``pop``, ``layers``, ``inputs`` and
``outputs``, ``build``, ``call`` and shape inference; the model holds one
and its methods of those names delegate to it. :func:`pipeline_of` and
:func:`pipeline_of_sequential` are the constructors from existing models.
Two things happen at two times:

- the model's **graph** (a Functional model; a chain is made one, as
  ``Sequential`` makes one) exists as soon as its input is known, on every
  rank, without allocating any weight and without communication;
- its **pipeline** (the cut, this rank's stage and its weights) is built
  collectively, at the first ``fit``/``evaluate``/``predict``/call, or an
  explicit ``build()`` that every rank makes. On one rank that costs
  nothing, so a one-rank model is built whenever its graph is, as
  ``Sequential`` is; on several, adding a layer after it is an error.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.graph import graph as graphs
from keras_pipe.graph import trace as traces
from keras_pipe.model import weights as _weights
from keras_pipe.model.compile_checks import check_no_preprocessor, check_source_steps


class ModelBuilder:
    """A ``PipelineModel``'s layers or graph, and the building of its pipeline over the ranks.

    Not a Keras object: the model holds it untracked. Nothing here is
    collective by itself; the model's methods that call it are.

    Args:
        model: the ``PipelineModel`` it builds. Read for its ``name`` and
            ``trainable`` flag; once its pipeline is built, the model's
            ``built`` flag is set and ``model._stage_layers`` (the list
            Keras tracks on the model: its weights are this rank's) holds
            this rank's layers.
        engine: the model's :class:`~keras_pipe.engine.engine.Engine` (the
            cut, this rank's stage, the world).

    Attributes:
        layers: a chain's layers, in order (empty for a model made from a graph).
        input_spec: a chain's input, ``(shape, dtype)`` pairs in its structure; ``None`` while unknown.
        input_tensor: the user's ``keras.Input``, kept as given (``model.inputs`` is this very tensor, as in
            ``Sequential``); ``None`` if none was given.
        source: the Functional model the pipeline runs (a chain's, made once its input is known), or ``None``.
        from_graph: whether the model was made from a graph (``inputs=``/``outputs=``, ``from_model``).
        call_dtypes: the dtypes of a call's inputs before the graph was known (a chain's input takes them).
        first_batch_size: the first batch's size (the engine measures ``balance="time"`` on a micro-batch of it).
    """

    def __init__(self, model, engine):
        self.model = model
        self.engine = engine
        self.layers: list = []
        self.input_spec = None
        self.input_tensor = None
        self.source = None
        self.from_graph = False
        self.call_dtypes = None
        self.first_batch_size = None

    def start(self, layers, inputs, outputs, name) -> None:
        """The constructor's arguments: a list of layers, or ``inputs`` and ``outputs`` (then built, collectively)."""
        if outputs is not None and inputs is None and layers is not None:
            inputs, layers = layers, None  # PipelineModel(inputs, outputs), as keras.Model(inputs, outputs)
        if inputs is not None or outputs is not None:
            if layers is not None:
                raise PipelineConfigError("give either a list of layers or inputs= and outputs=, not both.")
            if inputs is None or outputs is None:
                raise PipelineConfigError("a Functional PipelineModel needs both inputs= and outputs=.")
            self.use_model(keras.Model(inputs, outputs, name=name))
            # built as a Functional model is, once constructed: the cut and this rank's stage (collective,
            # as creating the model is); its weights are those of the layers the graph was made of
            self.build_pipeline()
        for item in layers or []:
            self.add(item, rebuild=False)
        if layers:
            self.follow_layers()

    def use_model(self, model) -> None:
        """The pipeline runs ``model`` (a Functional model, or a traced view of a subclassed one)."""
        self.source = model
        self.from_graph = True

    # -- the layers --------------------------------------------------------

    def add(self, layer, rebuild: bool = True) -> None:
        """Appends a layer (or, first, a ``keras.Input``), as ``Sequential.add``."""
        if self.source is not None and self.from_graph:
            raise PipelineConfigError("a PipelineModel made from a graph (inputs=, outputs=) takes no more layers.")
        if not self.layers and compat.input_shape_argument(layer) is not None:
            # the legacy Dense(4, input_shape=(2,)): its input, as Sequential reads it
            self.add(keras.Input(shape=compat.input_shape_argument(layer)))
        if isinstance(layer, keras.layers.InputLayer):
            layer = layer.output
        if isinstance(layer, keras.KerasTensor):
            if self.layers or self.input_spec is not None:
                raise PipelineConfigError(
                    f"PipelineModel {self.model.name!r} has already been configured to use input shape "
                    f"{self.input_spec[0] if self.input_spec else '(from its first layer)'}: "
                    "keras.Input can only be the first item of its layer list."
                )
            self.input_spec = keras.tree.map_structure(lambda t: (tuple(t.shape), str(t.dtype)), layer)
            self.input_tensor = layer
            return
        if not isinstance(layer, keras.layers.Layer):
            raise PipelineConfigError(
                f"Only instances of `keras.Layer` can be added to a PipelineModel. Received: {layer!r} "
                f"(of type {type(layer).__name__})."
            )
        if any(layer is other for other in self.layers):
            raise PipelineConfigError(
                f"layer {layer.name!r} appears twice in the layer list; in a list every layer is used once. "
                "Create a second layer, or write the model as keras.Model(inputs, outputs) to call one twice."
            )
        if any(layer.name == other.name for other in self.layers):
            raise PipelineConfigError(
                f"All layers added to a PipelineModel should have unique names. Name {layer.name!r} is already "
                "the name of a layer in this model. Update the `name` argument to pass a unique name."
            )
        self._refuse_change("add a layer")
        self.layers.append(layer)
        if rebuild:
            self.follow_layers()

    def pop(self, rebuild: bool = True):
        """Removes and returns the last layer, as ``Sequential.pop``."""
        if not self.layers:
            raise PipelineConfigError(f"PipelineModel {self.model.name!r} has no layers to pop.")
        self._refuse_change("pop a layer")
        layer = self.layers.pop()
        if rebuild:
            self.follow_layers()
        return layer

    def _refuse_change(self, what: str) -> None:
        if self.engine.built and self.engine.world.size > 1:
            raise PipelineConfigError(
                f"cannot {what} after the model was built (it is already cut over the ranks); change the layers "
                "before compile()/fit(), or build a new model."
            )

    def follow_layers(self) -> None:
        """After ``add``/``pop``: the chain's graph again; on one rank, the pipeline too (as Sequential rebuilds)."""
        if self.engine.built:
            self.unbuild()
        self.source = None
        if self.input_spec is not None or self._first_layer_input() is not None:
            self.build_graph()
            if self.engine.world.size == 1 and self.layers:
                self.build_pipeline()

    def _first_layer_input(self):
        """The input of a first layer that is itself a built model (``Sequential([functional, Dense(1)])``)."""
        first = self.layers[0] if self.layers else None
        if isinstance(first, keras.Model) and first.built and getattr(first, "inputs", None):
            return keras.tree.map_structure(lambda t: (tuple(t.shape), str(t.dtype)), first.input)
        return None

    def all_layers(self) -> list:
        """Every layer of the model, in order (a chain's, or its graph's)."""
        if self.layers or self.source is None:
            return list(self.layers)
        return list(self.source.layers)

    def layers_reserved(self) -> AttributeError:
        """The error for ``model.layers = ...``, in Keras' words: a graph's as ``keras.Model``'s, a chain's as
        ``Sequential``'s (which code written for Keras matches)."""
        if self.from_graph:
            return AttributeError(
                "`Model.layers` attribute is reserved and should not be used. Please use another name."
            )
        return AttributeError(
            "`PipelineModel.layers` attribute is reserved and should not be used. Use `add()` and `pop()` to change "
            "the layers in this model."
        )

    def stage_layers(self) -> list:
        """The layers this rank holds weights of, once built."""
        if not self.engine.built:
            raise PipelineConfigError("the model is not built yet; call model.build() on every rank first.")
        return self.engine.stage_layers()

    # -- the graph -----------------------------------------------------------

    def graph_or_raise(self, what: str):
        """The model's graph, or Keras' error for a model whose ``what`` is not known yet."""
        if self.source is None:
            raise AttributeError(f"PipelineModel {self.model.name!r} has no defined {what} yet.")
        return self.source

    def build_graph(self, input_spec=None) -> None:
        """The chain's Functional model, from its input (shapes and dtypes), allocating no weight."""
        if self.source is not None:
            return
        if not self.layers:
            raise PipelineConfigError(
                f"PipelineModel {self.model.name!r} cannot be built because it has no layers; pass a list of "
                "layers or call `model.add(layer)`."
            )
        spec = self.input_spec or self._first_layer_input() or input_spec
        if spec is None:
            raise PipelineConfigError(
                "the input shape is unknown; start the layer list with keras.Input(shape) or call fit()."
            )
        if self.input_tensor is not None and spec is self.input_spec:
            inputs = self.input_tensor
        else:
            inputs = map_specs(input_of, spec)
        self.source = graphs.chain_model(self.layers, inputs, name=self.model.name)
        self.input_spec = spec

    # -- the pipeline ----------------------------------------------------------

    def build(self, input_shape=None) -> None:
        """``model.build``: checks ``input_shape`` against a known input, then builds the pipeline."""
        if input_shape is not None:
            self._check_shape(input_shape)
        self.build_pipeline(input_shape)

    def _check_shape(self, input_shape) -> None:
        known = self.input_spec
        if known is None or not _is_spec(known):
            return
        given = tuple(input_shape)
        if len(given) != len(known[0]) or any(
            a is not None and b is not None and a != b for a, b in zip(known[0], given)
        ):
            raise PipelineConfigError(
                f"PipelineModel {self.model.name!r} has already been configured to use input shape {known[0]}. "
                f"You cannot build it with input_shape {given}."
            )

    def build_pipeline(self, input_shape=None, release: bool = True) -> None:
        """The cut and this rank's stage; with ``release=False`` every rank keeps the weights of other stages
        (until :meth:`adopt`)."""
        if self.engine.built:
            return
        if self.source is None:
            spec = None if input_shape is None else shapes_to_specs(input_shape, self.call_dtypes)
            self.build_graph(spec)
        self.engine.frozen = not self.model.trainable  # (the layers' own flags are left as they are, as Keras does)
        self.engine.build(self.source, self.first_batch_size, release=release)
        self.follow_engine()
        self.model.built = True
        if release:
            _weights.copy_between_holders(self.engine)
            _weights.copy_from_first_replica(self.engine)

    def follow_engine(self) -> None:
        """``model._stage_layers``: the layers whose weights this rank holds (after building, and after
        ``schedule="auto"`` picked a schedule that cuts the model otherwise)."""
        self.model._stage_layers.clear()  # (in place: Keras tracks the list, and untracks what leaves it)
        self.model._stage_layers.extend(self.engine.own_layers())

    def check_quantize(self) -> None:
        """Refuses ``model.quantize`` with several stages: each rank holds only its stage's weights."""
        if self.engine.num_stages > 1:
            raise PipelineConfigError(
                f"quantize() on a PipelineModel cut into {self.engine.num_stages} stages: each rank holds only its "
                "stage's weights. Quantize the Keras model before pipelining it: model.quantize(mode), then "
                "PipelineModel.from_model(model, ...)."
            )

    def rebuild(self) -> None:
        """After the layers' variables changed (``quantize``): the pipeline cut and built again, if it was built."""
        if self.engine.built:
            self.unbuild()
            self.build_pipeline()

    def unbuild(self) -> None:
        """One rank, the layers changed: forget the cut (the layers keep their weights)."""
        self.engine.reset()
        self.model._stage_layers.clear()
        self.model.built = False

    def build_for(self, x) -> None:
        """Builds the model for a first batch ``x`` (its shapes and dtypes give a chain its input)."""
        if self.engine.built:
            return
        first = keras.tree.flatten(x)[0]
        self.first_batch_size = int(first.shape[0])
        if self.source is None and self.input_spec is None and self._first_layer_input() is None:
            self.build_graph(keras.tree.map_structure(lambda a: ((None,) + tuple(a.shape[1:]), _dtype(a)), x))
        self.build_pipeline()

    def adopt(self, model) -> None:
        """After ``build_pipeline(release=False)`` of ``model``: rank 0's weights everywhere, then each rank frees
        the rest."""
        engine = self.engine
        whole = all(not compat.unallocated(v) for v in model.weights)
        # (decided together: made inside unallocated(), a rank whose stage holds every weight, the last one with a
        # tied embedding over small layers, has all of them allocated while the others do not)
        if engine.world.size > 1 and all(engine.world.allgather_json(whole)):
            for variable, _, here in _weights.ordered(engine):
                if engine.world.rank == 0:
                    value = np.array(variable.numpy())
                else:
                    value = np.empty(tuple(variable.shape), np.dtype(variable.dtype))
                value = engine.world.bcast_array(value, root=0)
                if here:
                    variable.assign(value)
        else:
            # (a preset loaded inside unallocated(): each rank reads its own, then copies what the file did not give)
            loaded = _weights.load_deferred(engine, model)
            _weights.copy_between_holders(engine, loaded)
            _weights.copy_from_first_replica(engine, loaded=loaded)
        engine.release_others()

    # -- calling it --------------------------------------------------------

    def called_with(self, args) -> None:
        """Before Keras' ``__call__``: Keras builds a layer from its inputs' shapes alone; a chain's input takes
        their dtypes too."""
        if args and not self.source:
            self.call_dtypes = keras.tree.map_structure(_dtype, args[0])

    def call(self, inputs, training, pipelined):
        """``model.call``: in one process the graph itself; on several, ``pipelined((inputs,))`` (inference only)."""
        self.build_for(inputs)
        if self.engine.num_stages == 1:  # (every rank holds the whole model)
            return self.source(inputs, training=training)
        if training or not compat.executing_eagerly():
            raise PipelineConfigError(
                f"a PipelineModel on {self.engine.world.size} ranks can be called eagerly for inference only (each "
                "rank holds its stage's layers; the call runs the pipeline); use fit() to train, predict() inside "
                "other code."
            )
        return pipelined((inputs,))

    def compute_output_spec(self, inputs):
        """The outputs' shapes and dtypes for symbolic ``inputs``, from the graph (no rank communicates)."""
        if self.source is None:
            self.build_graph(keras.tree.map_structure(lambda t: ((None,) + tuple(t.shape[1:]), str(t.dtype)), inputs))
        return self.source.compute_output_spec(inputs)

    def compute_output_shape(self, input_shape):
        """The output shape for ``input_shape``, from the graph (no rank communicates)."""
        if self.source is None:
            self.build_graph(shapes_to_specs(input_shape, None))
        return self.source.compute_output_shape(input_shape)


# -- other models ---------------------------------------------------------


def pipeline_of(cls, model: keras.Model, inputs, pipeline_options: dict):
    """``cls.from_model(model, inputs, **pipeline_options)``: a pipeline of class ``cls`` running ``model``."""
    if isinstance(model, keras.Sequential):
        return cls.from_sequential(model, **pipeline_options)  # (which checks it)
    check_source_steps(model)
    check_no_preprocessor(model)
    view = None
    if graphs.functional_of(model) is None:
        view = traces.view_of(model, inputs)  # (raises, saying why, alike on every rank)
    elif inputs is not None:
        raise PipelineConfigError("from_model(inputs=...) is for a subclassed model; this one has its inputs.")
    pipeline_options.setdefault("name", model.name)
    pipeline = cls(**pipeline_options)
    builder = pipeline._builder
    if view is not None:
        problem = traces.check_view(view)  # (on every rank: each rank's verdict, the first refusal for all)
        if builder.engine.world.size > 1:
            problem = next((p for p in builder.engine.world.allgather_json(problem) if p), None)
        if problem is not None:
            raise PipelineConfigError(problem)
    builder.use_model(model if view is None else view)
    builder.build_pipeline(release=False)
    builder.adopt(model)
    return pipeline


def pipeline_of_sequential(cls, model: keras.Sequential, pipeline_options: dict):
    """``cls.from_sequential(model, **pipeline_options)``: a pipeline of class ``cls`` of the model's layers."""
    if not isinstance(model, keras.Sequential):
        if graphs.functional_of(model) is not None:
            return cls.from_model(model, **pipeline_options)  # (which checks it)
        raise PipelineConfigError(
            f"from_sequential takes a keras.Sequential, got a {type(model).__name__} ({model.name!r}); "
            "use PipelineModel.from_model for a Functional model."
        )
    check_source_steps(model)
    pipeline_options.setdefault("name", model.name)
    items = []
    if model.built and getattr(model, "inputs", None):
        first = model.inputs[0]
        items.append(keras.Input(batch_shape=tuple(first.shape), dtype=first.dtype))
    pipeline = cls(items + list(model.layers), **pipeline_options)
    if model.built:
        pipeline._builder.build_pipeline(release=False)
        pipeline._builder.adopt(model)
    return pipeline


def map_specs(fn, spec):
    """``fn(shape, dtype)`` on each ``(shape, dtype)`` of a structure of them (a dict, list or one)."""
    if _is_spec(spec):
        return fn(tuple(spec[0]), spec[1])
    if isinstance(spec, dict):
        return {key: map_specs(fn, value) for key, value in spec.items()}
    return type(spec)(map_specs(fn, value) for value in spec)


def shapes_to_specs(shapes, dtypes):
    """Keras' build shapes (a shape, or a dict or list of them) with dtypes (a structure like them, or ``None``)."""
    if _is_shape(shapes):
        return (tuple(shapes), dtypes if isinstance(dtypes, str) else keras.config.floatx())
    if isinstance(shapes, dict):
        return {k: shapes_to_specs(v, dtypes.get(k) if isinstance(dtypes, dict) else None) for k, v in shapes.items()}
    listed = list(dtypes) if isinstance(dtypes, (list, tuple)) else [None] * len(shapes)
    return type(shapes)(shapes_to_specs(v, d) for v, d in zip(shapes, listed))


def _is_shape(value) -> bool:
    return isinstance(value, (tuple, list)) and all(d is None or isinstance(d, (int, np.integer)) for d in value)


def _is_spec(spec) -> bool:
    """Whether ``spec`` is one input's ``(shape, dtype)`` rather than a structure of them."""
    return isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str)


def _dtype(array) -> str:
    """An input's dtype, with ``:sparse`` or ``:ragged`` after it for such tensors (as ``keras.Input`` takes them)."""
    dtype = getattr(array, "dtype", None)
    name = str(np.asarray(array).dtype) if dtype is None else (dtype.name if hasattr(dtype, "name") else str(dtype))
    kind = type(array).__name__
    return name + (":sparse" if kind == "SparseTensor" else ":ragged" if kind == "RaggedTensor" else "")


def input_of(shape, dtype: str):
    """A ``keras.Input`` of ``shape`` and ``dtype`` (see :func:`_dtype` for a sparse or ragged one)."""
    name, _, kind = dtype.partition(":")
    return keras.Input(batch_shape=shape, dtype=name, sparse=kind == "sparse", ragged=kind == "ragged")
