"""Internal: a stage's nodes as steps that can be replayed, for a split backward.

A split backward computes, per micro-batch, only the gradient with respect
to the stage inputs (``I``), and later the weight gradients of many
micro-batches in one pass (``W``). Both work step by step from what the
forward kept: each step's inputs. A step's backward *replays* the step
under a tape and asks for one gradient; inside a compiled program the
replayed forward is dead code wherever the gradient does not need it, and it
is removed:

- a matrix product's input gradient needs the weights and the output
  gradient, its weight gradient the input and the output gradient, never
  the product itself. So ``Dense``, ``EinsumDense`` and ``Conv*`` run as two
  steps, the linear core and its activation, and neither ``I`` nor ``W``
  computes a product twice;
- an activation, a reshape, a Keras op or a dropout is cheap to recompute;
  dropout draws the same mask because its random generator's state is
  saved before the forward and restored for the replay.

Steps read and write numbered tensors (the graph's, plus one for each
core's output), so a stage with branches and skip edges replays as a chain
does: the gradient of each tensor is the sum over the steps that read it.

``W`` replays each weighted step once on the concatenated inputs of all its
micro-batches with their concatenated output gradients: one matrix product
per layer per batch, as ``keras.Sequential`` does, instead of one per
micro-batch.

A node is replayed only where that is known to be exact and cheap (see
:func:`why_not_replayable`); a stage with any other node uses the recorded
backward of :mod:`keras_pipe.stage.compute` instead.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat

# Layers with weights whose replay recomputes nothing expensive: linear in
# their weights given the saved input (once the activation is split off), or
# elementwise (LayerNormalization).
WEIGHTED = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Embedding,
    keras.layers.LayerNormalization,
)
# Layers whose activation is applied last in ``call`` (checked in Keras 3.15).
SPLIT_ACTIVATION = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)
# Weightless Keras layers that are not cheap or not pure to replay.
NOT_REPLAYED = (keras.layers.Lambda, keras.layers.RNN, keras.layers.Bidirectional, keras.layers.TFSMLayer)


def why_not_replayable(call) -> str | None:
    """``None`` if node ``call`` (a :class:`~keras_pipe.graph.graph.NodeCall`) replays exactly and cheaply, else why."""
    layer = call.layer
    if layer is None:
        operation = call.operation
        if type(operation).__module__.startswith("keras."):
            return None  # a Keras op: a pure function of its inputs
        return f"{type(operation).__name__} is not a Keras op"
    if isinstance(layer, NOT_REPLAYED):
        return f"{type(layer).__name__} is not replayed"
    seeds = {id(g.state) for g in compat.seed_generators(layer)}
    for sub in compat.sublayers(layer):
        state = [v for v in sub.non_trainable_variables if id(v) not in seeds]
        if sub.trainable and state:
            return f"{sub.name} keeps state that its forward updates ({state[0].path})"
    activation = getattr(layer, "activation", None)
    if (
        isinstance(layer, SPLIT_ACTIVATION)
        and layer.activity_regularizer is not None
        and activation not in (None, keras.activations.linear)
    ):
        return f"{layer.name} has an activity regularizer after its activation"
    trained = compat.trained_weights(layer)
    if trained and not isinstance(layer, WEIGHTED):
        return f"{type(layer).__name__} has weights and is not one of the linear layers"
    if not type(layer).__module__.startswith("keras.") and not trained:
        return f"{type(layer).__name__} is not a Keras layer (its call may have side effects)"
    if call.node.arguments.kwargs:
        return f"{layer.name} is called with keyword arguments {sorted(call.node.arguments.kwargs)}"
    return None


# Activations whose gradient TensorFlow computes from their output alone
# (the gradients registered for Relu, Sigmoid and Tanh read op.outputs[0]):
# the same kernels, given the kept output, give the same gradient.
_FROM_OUTPUT = {
    keras.activations.relu: lambda y, dy: tf.raw_ops.ReluGrad(gradients=dy, features=y),
    keras.activations.sigmoid: lambda y, dy: tf.raw_ops.SigmoidGrad(y=y, dy=dy),
    keras.activations.tanh: lambda y, dy: tf.raw_ops.TanhGrad(y=y, dy=dy),
}

# The chain is walked in plain Python while a program is traced: only Keras'
# own layers are replayed, and they need no conversion by AutoGraph.
_plain_python = tf.autograph.experimental.do_not_convert


class Step:
    """One replayable piece of the stage: a whole node, a layer's linear core, or its activation.

    ``inputs``/``outputs`` are tensor numbers (a core writes a number of its own).
    """

    def __init__(self, call, part: str, inputs: tuple, outputs: tuple):
        self.call = call
        self.layer = call.layer
        self.part = part  # "node", "core" or "activation"
        self.inputs = inputs
        self.outputs = outputs
        layer = self.layer
        own = part != "activation" and layer is not None
        self.variables = compat.trained_weights(layer) if own else []
        self.seeds = compat.seed_generators(layer) if own else []
        # an activation whose gradient TensorFlow takes from its output: the forward keeps the
        # output (the next step's input, kept anyway) instead of the input (one more tensor)
        activation = layer.activation if part == "activation" else None
        self.from_output = next((f for a, f in _FROM_OUTPUT.items() if a is activation), None)

    def __call__(self, values: dict, training) -> list:
        if self.part == "activation":
            return [self.layer.activation(values[self.inputs[0]])]
        with _without_activation(self.layer) if self.part == "core" else contextlib.nullcontext():
            return self.call(values, training)

    def own_losses(self) -> list:
        """The losses the step's layer added in its last call (activity regularization)."""
        if self.part == "activation" or self.layer is None:
            return []
        return [loss for sub in compat.sublayers(self.layer) for loss in compat.own_losses(sub)]

    def __repr__(self) -> str:
        return f"Step({self.call.name}, {self.part})"


def steps_of(calls, first_free: int) -> list[Step]:
    """The steps of replayable node ``calls``; a core's output gets number ``first_free``, then up."""
    steps = []
    for call in calls:
        layer = call.layer
        activation = getattr(layer, "activation", None)
        split = (
            isinstance(layer, SPLIT_ACTIVATION)
            and activation is not None
            and activation is not keras.activations.linear
            and layer.activity_regularizer is None
        )
        if split:
            core = (first_free,)
            first_free += 1
            steps += [Step(call, "core", call.inputs, core), Step(call, "activation", core, call.outputs)]
        else:
            steps.append(Step(call, "node", call.inputs, call.outputs))
    return steps


@contextlib.contextmanager
def _without_activation(layer):
    # Read by ``call`` while a program is traced: the core is traced without
    # it, and the layer is left as it was.
    activation = layer.activation
    layer.activation = None
    try:
        yield
    finally:
        layer.activation = activation


def seed_states(step: Step) -> list:
    """The current states of the step's random generators (to replay the same draws)."""
    return [tf.identity(compat.variable_handle(g.state)) for g in step.seeds]


@contextlib.contextmanager
def replaying(step: Step, saved: list):
    """Sets the step's random generators to ``saved`` for a replay, and back afterwards."""
    handles = [compat.variable_handle(g.state) for g in step.seeds]
    current = [tf.identity(h) for h in handles]
    for handle, value in zip(handles, saved):
        handle.assign(value)
    try:
        yield
    finally:
        for handle, value in zip(handles, current):
            handle.assign(value)


@_plain_python
def forward(steps: list[Step], values: dict, training: bool, keep: bool):
    """Runs the steps on ``values`` (updated in place): ``(activity loss, inputs of each step, seeds of each)``.

    ``inputs`` (per step, its input tensors in order) and ``seeds`` are empty lists unless ``keep``.
    """
    activity = tf.constant(0.0, tf.float32)
    inputs, seeds = [], []
    for step in steps:
        if keep:
            inputs.append([values[t] for t in step.inputs])
            seeds.append(seed_states(step))
        values.update(zip(step.outputs, step(values, training)))
        if keep and step.from_output:
            inputs[-1] = [values[step.outputs[0]]]  # (see Step.from_output)
        activity += _sum(step.own_losses())
    return activity, inputs, seeds


@_plain_python
def input_gradient(
    steps, inputs, seeds, grads: dict, activity_scale, *, wanted, head=None, head_from: int = 0, values=None, reads=()
):
    """``I``: ``(gradients of the tensors in wanted, output gradients of each weighted step)``.

    A weighted step's output gradients are ``None`` where nothing read that output.

    ``grads`` maps the stage's outputs to their gradients (what the later
    stages sent back). On the last stage ``head(values)`` gives the
    micro-batch's loss from the model outputs instead: the steps from
    ``head_from`` on are replayed together with it under one tape (the loss
    must see the step that made each output: Keras computes a softmax's
    cross-entropy from its logits, so the gradient with respect to the
    probabilities does not exist); ``values`` are the forward's tensors and
    ``reads`` the model outputs ``head`` reads. Each step's activity loss
    enters with weight ``activity_scale``. ``wanted`` lists the stage inputs
    whose gradient the earlier stages wait for.
    """
    grads = dict(grads)
    step_grads: list = [None] * len(steps)
    needs = _needing_gradients(steps, set(wanted))
    stop = len(steps)
    if head is not None:
        stop = head_from
        _head_gradient(
            steps[head_from:],
            values,
            reads,
            seeds[head_from:],
            head,
            activity_scale,
            needs,
            grads,
            step_grads,
            head_from,
        )
    for k in reversed(range(stop)):
        step = steps[k]
        outgoing = [grads.get(t) for t in step.outputs]
        if all(g is None for g in outgoing):
            continue
        if step.variables:
            step_grads[k] = outgoing
        if step.from_output:  # the kept output and its gradient give the input's
            if step.inputs[0] in needs and outgoing[0] is not None:
                y = inputs[k][0]
                _accumulate(grads, step.inputs, [step.from_output(y, tf.cast(outgoing[0], y.dtype))], {})
            continue
        values = dict(zip(step.inputs, inputs[k]))
        watched = [t for t in step.inputs if t in needs and values[t].dtype.is_floating]
        if not watched:
            continue
        with replaying(step, seeds[k]), tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([values[t] for t in watched])
            outputs = step(values, True)
            targets, seeds_ = _pulled_back(outputs, outgoing, activity_scale * _sum(step.own_losses()))
        sources = [values[t] for t in watched]
        _accumulate(grads, watched, tape.gradient(targets, sources, output_gradients=seeds_), values)
    return [grads.get(t) for t in wanted], step_grads


def _head_gradient(steps, values, reads, seeds, head, activity_scale, needs, grads, step_grads, offset):
    """The last steps replayed with the loss under one tape: gradients of what they read, and of their outputs."""
    values = dict(values)
    written = _written(steps)
    read = dict.fromkeys([t for step in steps for t in step.inputs] + list(reads))
    watched = [t for t in read if t not in written and t in needs and values[t].dtype.is_floating]
    with contextlib.ExitStack() as stack:
        for step, saved in zip(steps, seeds):
            stack.enter_context(replaying(step, saved))
        tape = stack.enter_context(tf.GradientTape(watch_accessed_variables=False, persistent=True))
        tape.watch([values[t] for t in watched])
        weighted_outputs = []
        loss = tf.constant(0.0, tf.float32)
        for step in steps:
            outputs = step(values, True)
            if step.variables:  # (recorded from here on even where nothing before it is watched)
                tape.watch([y for y in outputs if y.dtype.is_floating])
            values.update(zip(step.outputs, outputs))
            weighted_outputs.append(outputs if step.variables else None)
            loss += activity_scale * _sum(step.own_losses())
        loss += head(values)
    for position, outputs in enumerate(weighted_outputs):
        if outputs is not None:
            step_grads[offset + position] = list(tape.gradient(loss, outputs))
    if watched:
        _accumulate(grads, watched, tape.gradient(loss, [values[t] for t in watched]), values)
    del tape


def _needing_gradients(steps, wanted: set) -> set:
    """The tensors whose gradient is needed: the wanted stage inputs, and every floating tensor a step writes."""
    needs = set(wanted)
    for step in steps:
        needs.update(step.outputs)
    return needs


def _written(steps) -> set:
    return {t for step in steps for t in step.outputs}


def _accumulate(grads: dict, tensors, new, values) -> None:
    for t, g in zip(tensors, new):
        if g is None:
            continue
        g = tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
        grads[t] = g if grads.get(t) is None else grads[t] + g


@_plain_python
def weight_gradients(steps: list[Step], inputs: list, grads: list, activity_scale, variables: list):
    """``W``: the gradients of ``variables`` from every weighted step's inputs and output gradients.

    ``inputs[k]``/``grads[k]`` are, for weighted step ``k``, lists over
    micro-batches (each the step's input tensors / output gradients). Where
    they are small beside the step's weights (small micro-batches: the cost
    is writing the weight gradient) they are concatenated, so that each
    step's weight gradient is one pass over the batch; where they are larger
    (the cost is the product itself) each micro-batch's gradient is taken
    alone and summed, so that no copy of the activations is made. A layer
    called by several steps gets the sum of their gradients.
    """
    total: dict = {}
    for k, step in enumerate(steps):
        if not step.variables or inputs[k] is None:
            continue
        count = len(inputs[k])
        groups = [range(count)] if _concatenates(step, inputs[k], grads[k]) else [[i] for i in range(count)]
        rows = [tf.cast(tf.shape(_first(mb))[0], tf.float32) for mb in inputs[k]]
        for group in groups:
            # a layer's activity loss is a mean over the rows of its call: each group weighs its share
            share = activity_scale if len(groups) == 1 else activity_scale * rows[group[0]] / tf.add_n(rows)
            x = [_concat([inputs[k][i][j] for i in group]) for j in range(len(step.inputs))]
            g = [
                None if grads[k][0][j] is None else _concat([grads[k][i][j] for i in group])
                for j in range(len(step.outputs))
            ]
            handles = [compat.variable_handle(v) for v in step.variables]
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(handles)
                outputs = step(dict(zip(step.inputs, x)), True)
                targets, seeds_ = _pulled_back(outputs, g, share * _sum(step.own_losses()))
            for variable, grad in zip(step.variables, tape.gradient(targets, handles, output_gradients=seeds_)):
                if grad is not None:
                    total[id(variable)] = _add(total.get(id(variable)), grad)
    return [total.get(id(v)) for v in variables]  # None where no step reads a weight, as Keras' tape gives


def _add(total, grad):
    """Two gradients of one weight summed; two sparse ones (an ``Embedding``'s) stay sparse, their slices joined.

    Keras' optimizers update only the rows a sparse gradient names (Adam's
    slots of the other rows do not decay), so a sum of micro-batches'
    sparse gradients must stay the sparse gradient of their concatenation.
    """
    if total is None:
        return grad
    if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([total.values, grad.values], 0), tf.concat([total.indices, grad.indices], 0), total.dense_shape
        )
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def _concatenates(step: Step, inputs: list, grads: list) -> bool:
    """Whether ``W`` concatenates the micro-batches of a weighted step: their tensors are no larger than its weights."""
    if len(inputs) == 1 or isinstance(step.layer, keras.layers.Embedding):
        # an Embedding's (sparse) gradient of the joined rows has the whole batch's slices: for ids known
        # without the batch (positions) one per id, where a gradient per micro-batch would have one each
        return True
    sizes = [t.shape.num_elements() for mb in inputs + grads for t in mb if t is not None and hasattr(t, "shape")]
    if any(size is None for size in sizes):
        return True
    weights = sum(int(np.prod(v.shape)) for v in step.variables)
    return sum(sizes) <= weights


def _first(tensors):
    """The first tensor of a step's inputs (a sparse one's values' count is not its rows: its dense shape)."""
    tensor = tensors[0]
    return tf.zeros(tensor.dense_shape[:1], tf.int8) if isinstance(tensor, tf.SparseTensor) else tensor


def _concat(parts):
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tf.SparseTensor):  # (a sparse model input)
        return tf.sparse.concat(0, parts)
    return tf.concat(parts, axis=0)


def _pulled_back(outputs, grads, loss):
    """A tape's targets and their output gradients: each output with its gradient ``g``, and the scalar ``loss`` with 1.

    The gradient the tape pulls back through ``y`` is ``g`` cast to ``y``'s
    dtype, as the unsplit model's backward casts it. Why not the scalar
    ``sum(y * g)`` as a target: its gradient is a tensor of ones of ``y``'s
    shape, a constant that TensorFlow folds when XLA compiles the program, a
    micro-batch-sized buffer per layer allocated in the program's first run
    (96 MiB for an eight-layer stage of ``Dense(1024)`` at 2048 rows) while
    the step holds its micro-batches.
    """
    targets, seeds = [loss], [tf.ones_like(loss)]
    for y, g in zip(outputs, grads):
        if g is not None and y.dtype.is_floating:
            targets.append(y)
            seeds.append(tf.cast(g, y.dtype))
    return targets, seeds


def _sum(losses) -> tf.Tensor:
    total = tf.constant(0.0, tf.float32)
    for loss in losses:
        total += tf.cast(tf.reduce_sum(loss), tf.float32)
    return total
