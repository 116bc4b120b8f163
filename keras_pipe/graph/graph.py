"""A Keras model as a graph of nodes: what every rank knows of every call, and how its own calls run.

A Functional model already is its graph (Keras' ``Node``s and
``KerasTensor``s); a subclassed model, or a large composite layer, is
first traced into one by Keras itself (:mod:`keras_pipe.graph.trace`).
:func:`from_model` walks it in Keras' own execution order, expands every
nested model (a backbone inside a task model) into its nodes, and numbers
the tensors; the result is the
plain :class:`keras_pipe.graph.cut.Graph` every rank cuts alike, plus, per node,
a :class:`NodeCall` that runs the Keras call on real tensors as
``Functional.call`` does (the same arguments, ``training`` where the
operation takes it, Keras masks riding on the tensors). A list of layers is
first made a Functional model (:func:`chain_model`), as ``keras.Sequential``
makes one, so a chain is the special case of a graph, not a second code
path.

The layers of a model built here are built inside
:func:`keras_pipe.compat.unallocated_scope`: their variables have shapes and
initializers but no memory, until the rank that owns them initializes them
(:func:`allocate`). A model handed in built has its weights on every rank;
:func:`release` frees those a rank does not own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import keras

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.graph import cut
from keras_pipe.graph import trace as traces


class NodeCall:
    """One Keras call of the graph, runnable on tensor values.

    ``inputs``/``outputs`` are tensor numbers; ``values`` maps numbers to
    tensors (with their Keras masks attached).
    """

    def __init__(self, node, index_of: dict, name: str, training=None):
        self.node = node
        self.operation = node.operation
        self.name = name
        # a training the call is given whatever the model's (it, or a call it is nested in, passes one
        # of its own in a subclassed model's call(): see trace.Traced.fixed); None: the model's
        self.training = training
        self._keys = [(id(kt), index_of[id(kt)]) for kt in node.input_tensors]
        self.inputs = tuple(dict.fromkeys(index for _, index in self._keys))
        self.outputs = tuple(index_of[id(kt)] for kt in node.outputs)

    @property
    def layer(self):
        """The layer called, or ``None`` for an op node (``x[:, 0]``, ``keras.ops.add``)."""
        return self.operation if isinstance(self.operation, keras.layers.Layer) else None

    def __call__(self, values: dict, training=None) -> list:
        tensors = {key: values[index] for key, index in self._keys}
        args, kwargs = self.node.arguments.fill_in(tensors)
        given = training if self.training is None else self.training
        outputs = compat.call_operation(self.operation, args, kwargs, given)
        return keras.tree.flatten(outputs)

    def __repr__(self) -> str:
        return f"NodeCall({self.name}: {list(self.inputs)} -> {list(self.outputs)})"


@dataclass
class ModelGraph:
    """A model's plain graph (the same on every rank) and the Keras objects behind it.

    ``units`` maps a unit name to its layer (every layer holding variables,
    once however often it is called); ``weight_order`` lists, in the order
    of ``model.weights``, each weight's ``(unit, index in layer.weights)``.
    """

    model: keras.Model
    plain: cut.Graph
    calls: list
    units: dict
    weight_order: list
    notes: list = field(default_factory=list)  # layers that hold much and could not be split, and why

    def output_structure(self):
        return compat.output_structure(self.model)

    def weight_shapes(self, unit: str, trainable: bool = False) -> list:
        layer = self.units[unit]
        weights = compat.trained_weights(layer) if trainable else layer.weights
        return [(tuple(w.shape), str(w.dtype)) for w in weights]


def chain_model(layers, input_tensor, name: str | None = None) -> keras.Model:
    """The Functional model of a chain of ``layers`` on ``input_tensor``, as ``keras.Sequential`` builds it.

    Built without allocating the layers' weights (see the module docstring).
    """
    with compat.unallocated_scope():
        x = input_tensor
        for index, layer in enumerate(layers):
            try:
                x = layer(x)
            except NotImplementedError:
                # Keras cannot infer the layer's output symbolically (as Sequential, which then calls
                # it on real tensors): its output spec is measured on a real one
                x = Measured(layer, x)(x)
            except Exception as error:  # noqa: BLE001 - re-raised with context
                _refuse_positional(layer, error)
                raise PipelineConfigError(
                    f"layer {index} ({layer.name}, {type(layer).__name__}) cannot be called on an input of "
                    f"shape {_shapes(x)} and dtype {_dtype(x)}: {error}"
                ) from error
        return keras.Model(input_tensor, x, name=name)


class Measured(keras.layers.Layer):
    """A layer whose output shape Keras cannot infer symbolically, with the one measured on a real input.

    Called once on zeros of its input's shape (a varying dimension as 1); a
    layer that holds weights cannot be measured so (they do not exist yet)
    and is refused, as keras_pipe must know every stage's shapes.
    """

    def __init__(self, layer, like, **kwargs):
        super().__init__(name=f"{layer.name}_measured", **kwargs)
        self.layer = layer
        sample = keras.tree.map_structure(
            lambda t: keras.ops.zeros(tuple(d or 1 for d in t.shape), dtype=t.dtype), like
        )
        with compat.allocating_scope():
            out = layer(sample)
        if layer.weights:
            raise PipelineConfigError(
                f"layer {layer.name!r} ({type(layer).__name__}) cannot infer its output shape symbolically and holds "
                "weights; implement its compute_output_shape()."
            )
        self._structure = out
        self._spec = [(tuple(t.shape[1:]), keras.backend.standardize_dtype(t.dtype)) for t in keras.tree.flatten(out)]

    def compute_output_spec(self, inputs, *args, **kwargs):
        rows = keras.tree.flatten(inputs)[0].shape[0]
        flat = [keras.KerasTensor((rows, *shape), dtype) for shape, dtype in self._spec]
        return keras.tree.pack_sequence_as(self._structure, flat)

    def call(self, inputs, *args, **kwargs):
        return self.layer(inputs, *args, **kwargs)


def _refuse_positional(layer, error) -> None:
    """``keras.Sequential``'s error for a layer whose ``call`` takes more than one required positional argument."""
    if not isinstance(error, TypeError):
        return
    import inspect

    parameters = inspect.signature(layer.call).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is p.empty]
    if len(required) > 1:
        raise PipelineConfigError(
            "Layers of a PipelineModel's layer list can only have a single required positional argument, the input "
            f"tensor. Layer {type(layer).__name__} has multiple required positional arguments: {required}"
        ) from error


def from_model(model: keras.Model, stages: int = 1) -> ModelGraph:
    """The graph of a built model, nested models expanded into their nodes.

    A Functional or Sequential model is its graph; a subclassed model's
    ``call()`` is traced on symbolic tensors (:mod:`keras_pipe.graph.trace`) and
    checked on a real batch, or refused saying why. A composite layer (its
    ``call()`` runs other layers that hold weights) that holds more than one
    of ``stages``' share of the parameters is traced too and expanded into
    its calls, so that the cut can fall inside it; one that cannot be is
    kept whole, with a note saying why (``summary()`` prints it).
    """
    functional = functional_of(model)
    if functional is None:
        functional = traces.view_of(model)
        problem = traces.check_view(functional)
        if problem is not None:
            raise PipelineConfigError(problem)
    source = traces.source_of(functional)
    total = sum(_size(w.shape) for w in functional.weights)
    walk = _Walk(split_above=total / stages if stages > 1 else float("inf"), total=total)
    inputs = [walk.new_tensor(kt, kt.name) for kt in functional.inputs]
    outputs = walk.run(functional, inputs)
    together = walk.merge_units()
    plain = cut.Graph(tuple(walk.tensors), tuple(walk.nodes), tuple(inputs), tuple(outputs), together)
    weight_order = _weight_order(model if source is None else source, walk)
    owner = model if source is None else functional
    return ModelGraph(owner, plain, walk.calls, walk.units, weight_order, walk.notes)


def functional_of(model):
    """The Functional graph behind ``model``: itself, or a built Sequential's; ``None`` for a subclassed model."""
    if isinstance(model, keras.Sequential):
        return compat.sequential_functional(model)
    return model if compat.is_functional(model) else None


class _Walk:
    """Numbers tensors and collects nodes while walking a Functional graph (and every nested one)."""

    def __init__(self, split_above: float = float("inf"), total: int = 0):
        self.split_above = split_above  # a composite layer holding more parameters is expanded if it can be
        self.total = total
        self.notes: list[str] = []
        self.tensors: list[cut.Tensor] = []
        self.nodes: list[cut.Node] = []
        self.calls: list[NodeCall] = []
        self.units: dict[str, keras.layers.Layer] = {}
        self.unit_of: dict[int, str] = {}  # id(layer) -> unit name
        self.index_of: dict[int, int] = {}  # id(KerasTensor) -> tensor number
        self.names: set[str] = set()
        self.calls_of: dict[int, int] = {}  # id(operation) -> calls so far

    def new_tensor(self, kt, name: str) -> int:
        mask = compat.get_mask(kt)
        self.tensors.append(
            cut.Tensor(name, tuple(kt.shape), str(kt.dtype), None if mask is None else tuple(mask.shape))
        )
        self.index_of[id(kt)] = len(self.tensors) - 1
        return len(self.tensors) - 1

    def merge_units(self) -> tuple:
        """One unit for layers that hold the same variables; the groups of units that share some of theirs.

        ``OPTCausalLM`` looks its tokens up with its ``embeddings`` layer (a
        ``TokenAndPositionEmbedding``) and projects its logits with that
        layer's child ``token_embedding``: two layers, one variable. A call of
        a layer whose variables another unit holds all of belongs to that
        unit, so a stage calling either holds the whole unit's weights and
        the stages holding it are tied (their gradients summed).

        Layers that share some variables, neither holding all of the
        other's (DistilBERT's embeddings and its masked-LM head, which holds
        the token table beside its own weights), stay two units that are
        held together (returned as groups, ``cut.Graph.together``): a stage
        that holds one holds both, and the weights of both are tied over the
        stages holding them.
        """
        held = {unit: {id(v) for v in layer.variables} for unit, layer in self.units.items()}
        owner = {}
        for unit, ids in held.items():
            wider = [u for u, other in held.items() if u != unit and ids <= other and (ids < other or u < unit)]
            if wider:
                owner[unit] = max(wider, key=lambda u: (len(held[u]), u))

        def root(unit):
            while unit in owner:
                unit = owner[unit]
            return unit

        if owner:
            self.nodes = [
                dataclasses.replace(node, unit=root(node.unit)) if node.unit in owner else node for node in self.nodes
            ]
            for unit in owner:
                del self.units[unit]
            self.unit_of = {key: root(unit) for key, unit in self.unit_of.items()}
        group_of = {unit: {unit} for unit in self.units}
        for unit in self.units:
            for other in self.units:
                if unit < other and held[unit] & held[other] and group_of[unit] is not group_of[other]:
                    merged = group_of[unit] | group_of[other]
                    for member in merged:
                        group_of[member] = merged
        groups = {id(g): g for g in group_of.values() if len(g) > 1}
        return tuple(tuple(sorted(g)) for g in groups.values())

    def run(self, functional, inputs: list, training=None, fixed: dict | None = None) -> list:
        """Numbers ``functional``'s nodes; ``training``: the one they all get (a call they are nested in fixed it).

        In a Functional graph the model's flag wins over a node's own
        (``base(x, training=False)`` trains under ``fit``: Keras'
        ``functional.operation_fn`` gives every node the model's ``training``);
        in a traced ``call()`` a call's own argument wins (``fixed``), as in
        Keras' ``__call__``, and it holds for everything nested in that call.
        """
        traced = traces.traced_of(functional)
        fixed = fixed if fixed is not None else (traced.fixed if traced is not None else {})
        for kt, index in zip(functional.inputs, inputs):
            self.index_of[id(kt)] = index
        for node in compat.execution_order(functional):
            given = training if training is not None else fixed.get(id(node))
            inner = functional_of(node.operation) if isinstance(node.operation, keras.Model) else None
            if inner is not None:
                self._expand(node, inner, given)
            elif not self._expand_traced(node, given):
                self._add(node, given)
        return [self.index_of[id(kt)] for kt in functional.outputs]

    def _expand(self, node, inner, training=None) -> None:
        """A nested model's nodes in place of its call: its inputs are the call's tensors."""
        args, kwargs = list(node.arguments.args), dict(node.arguments.kwargs)
        if not args and "inputs" in kwargs:  # model(inputs=...), as keras_hub's Gemma 3 task calls its backbone
            args = [kwargs.pop("inputs")]
        # (Keras records mask=None, or a structure of Nones, on a nested model's call)
        extra = sorted(
            k for k, v in kwargs.items() if k != "training" and any(leaf is not None for leaf in keras.tree.flatten(v))
        )
        if len(args) != 1 or extra:
            raise PipelineConfigError(
                f"the nested model {node.operation.name!r} is called with more than its inputs ({extra or args}); "
                "keras_pipe expands a nested model called as model(inputs)."
            )
        given = compat.flat_inputs(inner, args[0])  # (a dict to a model built on a list: by the inputs' names)
        if len(given) != len(inner.inputs):
            raise PipelineConfigError(
                f"the nested model {node.operation.name!r} takes {len(inner.inputs)} inputs but is called with "
                f"{len(given)}."
            )
        outputs = self.run(inner, [self.index_of[id(kt)] for kt in given], training)
        for kt, index in zip(node.outputs, outputs):
            self.index_of[id(kt)] = index

    def _expand_traced(self, node, training=None) -> bool:
        """A subclassed model's call, or a large composite layer's, traced and expanded in place; ``False``: kept whole.

        Every subclassed model nested in the graph is expanded, as nested
        Functional models are; a composite layer (not one of Keras' own) only
        where it holds more than a stage's share of the parameters, so that
        the cut cannot balance the stages without falling inside it: a layer
        kept whole runs its own ``call()``, masks, caches and all.
        """
        operation = node.operation
        if not isinstance(operation, keras.layers.Layer) or len(compat.sublayers(operation)) < 2:
            return False
        is_model = isinstance(operation, keras.Model)
        params = sum(_size(w.shape) for w in operation.weights)
        if not is_model and (type(operation).__module__.startswith("keras.") or params <= self.split_above):
            return False
        share = f"{params / self.total:.0%} of the model" if self.total else "no weights"
        what = f"{operation.name} ({type(operation).__name__}) holds {params:,} parameters ({share})"

        def keep(reason: str) -> bool:
            self.notes.append(f"{what} and was not split: {reason}.")
            return False

        try:
            traced = traces.trace_call(operation, node.arguments.args, node.arguments.kwargs)
        except traces.Untraceable as error:
            return keep(str(error))
        weighted = [n for n in compat.execution_order(traced.functional) if getattr(n.operation, "weights", None)]
        if not is_model and len(weighted) < 2:
            return keep("its call() runs fewer than two layers that hold weights")
        outputs = traced.functional.outputs
        if len(outputs) != len(node.outputs) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(outputs, node.outputs)
        ):
            return keep("its traced outputs differ in number or shape from its call's")
        if not traces.allocated(operation):
            return keep(
                "its weights are not allocated here (keras_pipe.unallocated()), so its trace cannot be "
                "checked on a real batch"
            )
        problem = traces.check_on_batch(traced)
        if problem is not None:
            return keep(f"its traced graph differs from its call() on a real batch ({problem})")
        results = self.run(traced.functional, [self.index_of[id(kt)] for kt in traced.given], training, traced.fixed)
        for kt, index in zip(node.outputs, results):
            self.index_of[id(kt)] = index
        return True

    def _add(self, node, training=None) -> None:
        operation = node.operation
        count = self.calls_of.get(id(operation), 0)
        self.calls_of[id(operation)] = count + 1
        name = operation.name if not count else f"{operation.name}:{count}"
        while name in self.names:  # (a nested model's layer named as an outer one)
            name += "'"
        self.names.add(name)
        for position, kt in enumerate(node.outputs):
            suffix = f"[{position}]" if len(node.outputs) > 1 else ""
            self.new_tensor(kt, f"{name}{suffix}")
        call = NodeCall(node, self.index_of, name, training)
        unit, params = None, 0
        layer = call.layer
        if layer is not None and layer.variables:
            unit = self.unit_of.get(id(layer))
            if unit is None:
                unit = layer.name if layer.name not in self.units else f"{layer.name}#{len(self.units)}"
                self.units[unit] = layer
                self.unit_of[id(layer)] = unit
            params = int(sum(_size(w.shape) for w in layer.weights))
        self.calls.append(call)
        kind = type(operation).__name__
        self.nodes.append(cut.Node(name, call.inputs, call.outputs, unit, params + 1.0, kind, op=layer is None))


def _weight_order(model, walk: _Walk) -> list:
    """Each of ``model.weights``, as ``(unit, index in the unit's layer.weights)``."""
    where = {}
    for unit, layer in walk.units.items():
        for index, variable in enumerate(layer.weights):
            where.setdefault(id(variable), (unit, index))
    order, orphans = [], []
    for variable in model.weights:
        if id(variable) in where:
            order.append(where[id(variable)])
        else:
            orphans.append(variable.path)
    if orphans:
        raise PipelineConfigError(
            f"{model.name!r} holds weights that no node of its graph uses ({orphans[:5]}); keras_pipe places "
            "weights with the layers that use them. Leave unused layers out of the model."
        )
    return order


# -- memory ---------------------------------------------------------------------


@contextlib.contextmanager
def unallocated():
    """Models and layers created inside hold shapes, not weights, until a ``PipelineModel`` is made of them.

    Each rank then allocates only its own stage's weights, with their
    initializers: a model too large for one process is never whole anywhere.
    Seed Keras (``keras.utils.set_random_seed``) before creating the model
    for initial weights equal to the unsplit model's.

    Example:

    ```python
    keras.utils.set_random_seed(0)
    with keras_pipe.unallocated():
        lm = keras_hub.models.GPT2CausalLM(backbone=keras_hub.models.GPT2Backbone(...), preprocessor=None)
    model = keras_pipe.PipelineModel.from_model(lm, num_microbatches=8)
    ```
    """
    with compat.unallocated_scope():
        yield


def allocate(layers) -> None:
    """Gives memory (and initial values) to the unallocated variables of ``layers`` (this rank's own)."""
    for layer in layers:
        for variable in layer.variables:
            compat.restore_initializer(variable)
            if compat.unallocated(variable):
                with compat.named_as_built(variable):  # (the tf.Variable named by its path, as if built eagerly)
                    compat.initialize_deferred(variable)


def release(layers) -> None:
    """Frees the weights of ``layers`` another rank owns (they stay as shapes, and cannot be read here)."""
    for layer in layers:
        for variable in layer.variables:
            compat.release_variable(variable)


def _shapes(x) -> tuple:
    if isinstance(x, keras.KerasTensor):
        return tuple(x.shape)
    return tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(x))


def _dtype(x) -> str:
    return str(keras.tree.flatten(x)[0].dtype)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
