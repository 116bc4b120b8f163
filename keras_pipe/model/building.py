"""What makes a ``PipelineModel`` a model: its layers or graph, building, calling it, shapes, other models.

:class:`ModelBuilding` is the part of the façade that ``keras.Sequential``
and Functional models have: ``add``/``pop``, ``layers``, ``inputs`` and
``outputs``, ``build``, ``__call__`` and shape inference, and the
constructors from existing models. Two things happen at two times:

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
from keras_pipe.mpi.failure import collective


class ModelBuilding:
    """The model-building side of ``PipelineModel`` (a mixin; the façade provides ``engine``)."""

    # -- the layers --------------------------------------------------------

    def add(self, layer, rebuild: bool = True) -> None:
        """Appends a layer (or, first, a ``keras.Input``), as ``Sequential.add``."""
        if self._source is not None and self._from_graph:
            raise PipelineConfigError("a PipelineModel made from a graph (inputs=, outputs=) takes no more layers.")
        if not self._pipeline_layers and compat.input_shape_argument(layer) is not None:
            # the legacy Dense(4, input_shape=(2,)): its input, as Sequential reads it
            self.add(keras.Input(shape=compat.input_shape_argument(layer)))
        if isinstance(layer, keras.layers.InputLayer):
            layer = layer.output
        if isinstance(layer, keras.KerasTensor):
            if self._pipeline_layers or self._pipeline_input is not None:
                raise PipelineConfigError(
                    f"PipelineModel {self.name!r} has already been configured to use input shape "
                    f"{self._pipeline_input[0] if self._pipeline_input else '(from its first layer)'}: "
                    "keras.Input can only be the first item of its layer list."
                )
            self._pipeline_input = keras.tree.map_structure(lambda t: (tuple(t.shape), str(t.dtype)), layer)
            object.__setattr__(self, "_input_tensor", layer)  # model.inputs is this very tensor, as in Sequential
            return
        if not isinstance(layer, keras.layers.Layer):
            raise PipelineConfigError(
                f"Only instances of `keras.Layer` can be added to a PipelineModel. Received: {layer!r} "
                f"(of type {type(layer).__name__})."
            )
        if any(layer is other for other in self._pipeline_layers):
            raise PipelineConfigError(
                f"layer {layer.name!r} appears twice in the layer list; in a list every layer is used once. "
                "Create a second layer, or write the model as keras.Model(inputs, outputs) to call one twice."
            )
        if any(layer.name == other.name for other in self._pipeline_layers):
            raise PipelineConfigError(
                f"All layers added to a PipelineModel should have unique names. Name {layer.name!r} is already "
                "the name of a layer in this model. Update the `name` argument to pass a unique name."
            )
        self._refuse_change("add a layer")
        self._pipeline_layers.append(layer)
        if rebuild:
            self._follow_layers()

    def pop(self, rebuild: bool = True):
        """Removes and returns the last layer, as ``Sequential.pop``."""
        if not self._pipeline_layers:
            raise PipelineConfigError(f"PipelineModel {self.name!r} has no layers to pop.")
        self._refuse_change("pop a layer")
        layer = self._pipeline_layers.pop()
        if rebuild:
            self._follow_layers()
        return layer

    def _refuse_change(self, what: str) -> None:
        if self.engine.built and self.engine.world.size > 1:
            raise PipelineConfigError(
                f"cannot {what} after the model was built (it is already cut over the ranks); change the layers "
                "before compile()/fit(), or build a new model."
            )

    def _follow_layers(self) -> None:
        """After ``add``/``pop``: the chain's graph again; on one rank, the pipeline too (as Sequential rebuilds)."""
        if self.engine.built:
            self._unbuild()
        object.__setattr__(self, "_source", None)
        if self._pipeline_input is not None or self._first_layer_input() is not None:
            self._build_graph()
            if self.engine.world.size == 1 and self._pipeline_layers:
                self._build()

    def _first_layer_input(self):
        """The input of a first layer that is itself a built model (``Sequential([functional, Dense(1)])``)."""
        first = self._pipeline_layers[0] if self._pipeline_layers else None
        if isinstance(first, keras.Model) and first.built and getattr(first, "inputs", None):
            return keras.tree.map_structure(lambda t: (tuple(t.shape), str(t.dtype)), first.input)
        return None

    @property
    def layers(self) -> list:
        """Every layer of the model, in order, on every rank (weights only on the stages that hold them)."""
        if self._pipeline_layers or self._source is None:
            return list(self._pipeline_layers)
        return list(self._source.layers)

    @layers.setter
    def layers(self, _):
        # (Keras' words: a graph's as keras.Model's, a chain's as Sequential's, which code written for Keras matches)
        if self._from_graph:
            raise AttributeError(
                "`Model.layers` attribute is reserved and should not be used. Please use another name."
            )
        raise AttributeError(
            "`PipelineModel.layers` attribute is reserved and should not be used. Use `add()` and `pop()` to change "
            "the layers in this model."
        )

    @property
    def stage_layers(self) -> list:
        """The layers this rank holds weights of (once built: see :meth:`build`)."""
        if not self.engine.built:
            raise PipelineConfigError("the model is not built yet; call model.build() on every rank first.")
        return self.engine.stage_layers()

    # -- the graph -----------------------------------------------------------

    @property
    def _functional(self):
        """The Functional model behind the pipeline (``Sequential._functional``'s counterpart), or ``None``."""
        return self._source

    def _graph_or_raise(self, what: str):
        if self._source is None:
            raise AttributeError(f"PipelineModel {self.name!r} has no defined {what} yet.")
        return self._source

    inputs = property(lambda self: self._graph_or_raise("inputs").inputs, doc="The model's inputs (KerasTensors).")
    outputs = property(lambda self: self._graph_or_raise("outputs").outputs, doc="The model's outputs.")
    input_shape = property(lambda self: self._graph_or_raise("input shape").input_shape, doc="The input shape.")
    output_shape = property(lambda self: self._graph_or_raise("output shape").output_shape, doc="The output shape.")

    @property
    def input(self):
        return self._graph_or_raise("input").input

    @property
    def output(self):
        return self._graph_or_raise("output").output

    def _build_graph(self, input_spec=None) -> None:
        """The chain's Functional model, from its input (shapes and dtypes), allocating no weight."""
        if self._source is not None:
            return
        if not self._pipeline_layers:
            raise PipelineConfigError(
                f"PipelineModel {self.name!r} cannot be built because it has no layers; pass a list of layers or "
                "call `model.add(layer)`."
            )
        spec = self._pipeline_input or self._first_layer_input() or input_spec
        if spec is None:
            raise PipelineConfigError(
                "the input shape is unknown; start the layer list with keras.Input(shape) or call fit()."
            )
        if self._input_tensor is not None and spec is self._pipeline_input:
            inputs = self._input_tensor
        else:
            inputs = map_specs(input_of, spec)
        object.__setattr__(self, "_source", graphs.chain_model(self._pipeline_layers, inputs, name=self.name))
        self._pipeline_input = spec

    # -- the pipeline ----------------------------------------------------------

    def build(self, input_shape=None) -> None:
        """Cuts the model over the ranks and builds this rank's stage (collective: call it on every rank).

        Happens by itself on the first ``fit``/``evaluate``/``predict`` or
        call (or on ``get_weights``, ``summary``, ...), all of which every
        rank calls. ``input_shape`` (batch dimension included) is needed
        only where neither a ``keras.Input`` nor data gave it.
        """
        if input_shape is not None:
            self._check_shape(input_shape)
        self._build(input_shape)

    def _check_shape(self, input_shape) -> None:
        known = self._pipeline_input
        if known is None or not _is_spec(known):
            return
        given = tuple(input_shape)
        if len(given) != len(known[0]) or any(
            a is not None and b is not None and a != b for a, b in zip(known[0], given)
        ):
            raise PipelineConfigError(
                f"PipelineModel {self.name!r} has already been configured to use input shape {known[0]}. "
                f"You cannot build it with input_shape {given}."
            )

    def _build(self, input_shape=None, release: bool = True) -> None:
        """``build``; with ``release=False`` every rank keeps the weights of other stages (until ``_adopt``)."""
        if self.engine.built:
            return
        if self._source is None:
            spec = None if input_shape is None else shapes_to_specs(input_shape, self._call_dtypes)
            self._build_graph(spec)
        self.engine.frozen = not self.trainable  # (the layers' own flags are left as they are, as Keras does)
        own = self.engine.build(self._source, getattr(self, "_first_batch_size", None), release=release)
        self._stage_layers.clear()  # (in place: Keras tracks the list, and untracks what leaves it)
        self._stage_layers.extend(own)
        self.built = True
        if release:
            _weights.copy_between_holders(self.engine)
            _weights.copy_from_first_replica(self.engine)

    def _unbuild(self) -> None:
        """One rank, the layers changed: forget the cut (the layers keep their weights)."""
        self.engine.reset()
        self._stage_layers.clear()
        self.built = False

    def _build_for(self, x) -> None:
        """Builds the model for a first batch ``x`` (its shapes and dtypes give a chain its input)."""
        if self.engine.built:
            return
        first = keras.tree.flatten(x)[0]
        self._first_batch_size = int(first.shape[0])
        if self._source is None and self._pipeline_input is None and self._first_layer_input() is None:
            self._build_graph(keras.tree.map_structure(lambda a: ((None,) + tuple(a.shape[1:]), _dtype(a)), x))
        self._build()

    def _adopt(self, model) -> None:
        """After ``_build(release=False)`` of ``model``: rank 0's weights everywhere, then each rank frees the rest."""
        engine = self.engine
        if engine.world.size > 1 and all(not compat.unallocated(v) for v in model.weights):
            for variable, _, here in _weights.ordered(engine):
                if engine.world.rank == 0:
                    value = np.array(variable.numpy())
                else:
                    value = np.empty(tuple(variable.shape), np.dtype(variable.dtype))
                value = engine.world.bcast_array(value, root=0)
                if here:
                    variable.assign(value)
        else:
            _weights.copy_between_holders(self.engine)
            _weights.copy_from_first_replica(self.engine)
            _weights.load_deferred(self.engine, model)  # (a preset loaded inside unallocated(): each rank its own)
        engine.release_others()

    # -- calling it --------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if args and not self._source:
            # Keras builds a layer from its inputs' shapes alone; a chain's input takes their dtypes too
            self._call_dtypes = keras.tree.map_structure(_dtype, args[0])
        return super().__call__(*args, **kwargs)

    @collective  # (eager, on several ranks: agreed on entry; one rank's error is raised on all or ends the job)
    def call(self, inputs, training=None):
        """The whole model on ``inputs``: in one process as the unsplit model; on several, pipelined (collective).

        Several ranks run ``predict``'s pipeline on the batch and every rank
        returns the outputs; a call inside a compiled function, or with
        ``training=True``, is possible on one rank only (use ``fit``).
        """
        self._build_for(inputs)
        if self.num_stages == 1:  # (every rank holds the whole model)
            return self._source(inputs, training=training)
        if training or not compat.executing_eagerly():
            raise PipelineConfigError(
                f"a PipelineModel on {self.engine.world.size} ranks can be called eagerly for inference only (each "
                "rank holds its stage's layers; the call runs the pipeline); use fit() to train, predict() inside "
                "other code."
            )
        return self.predict_step((inputs,))

    def compute_output_spec(self, inputs, training=None, mask=None):
        """The outputs' shapes and dtypes for symbolic ``inputs``, from the graph (no rank communicates)."""
        if self._source is None:
            self._build_graph(keras.tree.map_structure(lambda t: ((None,) + tuple(t.shape[1:]), str(t.dtype)), inputs))
        return self._source.compute_output_spec(inputs)

    def compute_output_shape(self, input_shape):
        """The output shape for ``input_shape``, from the graph (no rank communicates)."""
        if self._source is None:
            self._build_graph(shapes_to_specs(input_shape, None))
        return self._source.compute_output_shape(input_shape)

    # -- other models ---------------------------------------------------------

    @classmethod
    def from_model(cls, model: keras.Model, inputs=None, **pipeline_options):
        """Any built Keras model (Sequential, Functional, keras_hub's, subclassed) as a pipeline (collective).

        Nested models are expanded into their nodes. A subclassed model's
        ``call()`` is traced on symbolic tensors (see :mod:`keras_pipe.graph.trace`)
        and checked against ``call()`` on a small real batch, or refused,
        naming the line it cannot trace; its input shapes are those it was
        built or called with, or ``inputs`` (``keras.Input``s, as ``call``
        takes them) where it was neither. Each rank keeps the
        weights of its own stage and frees the others' (the model handed in
        is consumed: use the pipeline from then on); rank 0's weights are
        the pipeline's, as for :meth:`from_sequential`. A model created
        inside :func:`keras_pipe.unallocated` holds no weights anywhere until
        each rank allocates its own stage's.

        Example:

        ```python
        lm = keras_hub.models.GPT2CausalLM(backbone=keras_hub.models.GPT2Backbone(...), preprocessor=None)
        model = PipelineModel.from_model(lm, num_microbatches=8)
        ```
        """
        if isinstance(model, keras.Sequential):
            return cls.from_sequential(model, **pipeline_options)
        view = None
        if graphs.functional_of(model) is None:
            view = traces.view_of(model, inputs)  # (raises, saying why, alike on every rank)
        elif inputs is not None:
            raise PipelineConfigError("from_model(inputs=...) is for a subclassed model; this one has its inputs.")
        pipeline_options.setdefault("name", model.name)
        pipeline = cls(**pipeline_options)
        if view is not None:
            problem = traces.check_view(view)  # (on every rank: each rank's verdict, the first refusal for all)
            if pipeline.engine.world.size > 1:
                problem = next((p for p in pipeline.engine.world.allgather_json(problem) if p), None)
            if problem is not None:
                raise PipelineConfigError(problem)
        pipeline._use_model(model if view is None else view)
        pipeline._build(release=False)
        pipeline._adopt(model)
        return pipeline

    @classmethod
    def from_sequential(cls, model: keras.Sequential, **pipeline_options):
        """The same model as a pipeline: one line changes in an existing script (collective).

        The layers are the model's own; if it is built, rank 0's weights are
        copied to the stages that hold them and every rank frees the others
        (use the pipeline from then on): an unseeded script trains rank 0's
        model. A Functional model goes to :meth:`from_model`.

        Example:

        ```python
        seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model = PipelineModel.from_sequential(seq, num_microbatches=4)
        ```
        """
        if not isinstance(model, keras.Sequential):
            if graphs.functional_of(model) is not None:
                return cls.from_model(model, **pipeline_options)
            raise PipelineConfigError(
                f"from_sequential takes a keras.Sequential, got a {type(model).__name__} ({model.name!r}); "
                "use PipelineModel.from_model for a Functional model."
            )
        pipeline_options.setdefault("name", model.name)
        items = []
        if model.built and getattr(model, "inputs", None):
            first = model.inputs[0]
            items.append(keras.Input(batch_shape=tuple(first.shape), dtype=first.dtype))
        pipeline = cls(items + list(model.layers), **pipeline_options)
        if model.built:
            pipeline._build(release=False)
            pipeline._adopt(model)
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
