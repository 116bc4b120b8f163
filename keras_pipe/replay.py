"""Internal: a stage's layers as a chain of steps that can be replayed, for a split backward.

A split backward computes, per micro-batch, only the gradient with respect
to the stage input (``I``), and later the weight gradients of many
micro-batches in one pass (``W``). Both work layer by layer from what the
forward kept: each step's input. A step's backward *replays* the step under
a tape and asks for one gradient; inside a compiled program the replayed
forward is dead code wherever the gradient does not need it, and it is
removed:

- a matrix product's input gradient needs the weights and the output
  gradient, its weight gradient the input and the output gradient, never
  the product itself. So ``Dense``, ``EinsumDense`` and ``Conv*`` run as two
  steps, the linear core and its activation, and neither ``I`` nor ``W``
  computes a product twice;
- an activation, a reshape or a dropout is cheap to recompute; dropout
  draws the same mask because its random generator's state is saved before
  the forward and restored for the replay.

``W`` replays each weighted step once on the concatenated inputs of all its
micro-batches with their concatenated output gradients: one matrix product
per layer per batch, as ``keras.Sequential`` does, instead of one per
micro-batch.

A layer is replayed only where that is known to be exact and cheap (see
:func:`why_not_replayable`); a stage with any other layer uses the recorded
backward of :mod:`keras_pipe.compute` instead.
"""

from __future__ import annotations

import contextlib

import keras
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


def why_not_replayable(layer) -> str | None:
    """``None`` if ``layer`` can be replayed exactly and cheaply, else the reason."""
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
        and activation
        not in (
            None,
            keras.activations.linear,
        )
    ):
        return f"{layer.name} has an activity regularizer after its activation"
    if layer.trainable_weights and not isinstance(layer, WEIGHTED):
        return f"{type(layer).__name__} has weights and is not one of the linear layers"
    if not type(layer).__module__.startswith("keras.") and not layer.trainable_weights:
        return f"{type(layer).__name__} is not a Keras layer (its call may have side effects)"
    return None


# The chain is walked in plain Python while a program is traced: only Keras'
# own layers are replayed, and they need no conversion by AutoGraph.
_plain_python = tf.autograph.experimental.do_not_convert


class Step:
    """One replayable piece of the chain: a whole layer, a layer's linear core, or its activation."""

    def __init__(self, layer, part: str):
        self.layer = layer
        self.part = part  # "layer", "core" or "activation"
        self.variables = [] if part == "activation" else list(layer.trainable_variables)
        self.seeds = [] if part == "activation" else compat.seed_generators(layer)

    def __call__(self, x, training):
        if self.part == "activation":
            return self.layer.activation(x)
        with _without_activation(self.layer) if self.part == "core" else contextlib.nullcontext():
            return self.layer(x, training=training)

    def own_losses(self) -> list:
        """The losses the step's layers added in its last call (activity regularization)."""
        if self.part == "activation":
            return []
        return [loss for sub in compat.sublayers(self.layer) for loss in compat.own_losses(sub)]

    def __repr__(self) -> str:
        return f"Step({self.layer.name}, {self.part})"


def steps_of(layers) -> list[Step]:
    """The chain of steps of replayable ``layers``."""
    steps = []
    for layer in layers:
        activation = getattr(layer, "activation", None)
        split = (
            isinstance(layer, SPLIT_ACTIVATION)
            and activation is not None
            and activation is not keras.activations.linear
            and layer.activity_regularizer is None
        )
        steps += [Step(layer, "core"), Step(layer, "activation")] if split else [Step(layer, "layer")]
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
def forward(steps: list[Step], x, training: bool, keep: bool):
    """Runs the chain: ``(y, activity loss, inputs of each step, seed states of each step)``.

    ``inputs`` and ``seeds`` are empty lists unless ``keep``.
    """
    activity = tf.constant(0.0, tf.float32)
    inputs, seeds = [], []
    for step in steps:
        if keep:
            inputs.append(x)
            seeds.append(seed_states(step))
        x = step(x, training)
        activity += _sum(step.own_losses())
    return x, activity, inputs, seeds


@_plain_python
def input_gradient(steps: list[Step], inputs, seeds, grad, activity_scale, need_input_grad: bool, head=None):
    """``I``: ``(gradient of the chain input or None, output gradient of each weighted step)``.

    ``grad`` is the gradient of the loss with respect to the chain's output;
    on the last stage it is ``None`` and ``head(y)`` gives the micro-batch's
    loss from the chain's output instead (the loss must see the last step
    itself: Keras computes a softmax's cross-entropy from its logits, so the
    gradient with respect to the probabilities does not exist). Each step's
    activity loss enters with weight ``activity_scale``.
    """
    step_grads = [None] * len(steps)
    last = len(steps) - 1
    for k in reversed(range(len(steps))):
        step, x = steps[k], inputs[k]
        at_head = head is not None and k == last
        if step.variables and not at_head:
            step_grads[k] = grad
        if k == 0 and not need_input_grad and not (at_head and step.variables):
            break
        with replaying(step, seeds[k]), tf.GradientTape(watch_accessed_variables=False, persistent=at_head) as tape:
            tape.watch(x)
            y = step(x, True)
            outer = head(y) if at_head else _dot(y, grad)
            target = outer + activity_scale * _sum(step.own_losses())
        if at_head and step.variables:
            step_grads[k] = _zeros_if_none(tape.gradient(outer, y), y)
        if k == 0 and not need_input_grad:
            break
        grad = _zeros_if_none(tape.gradient(target, x), x)
    return (grad if need_input_grad else None), step_grads


@_plain_python
def weight_gradients(steps: list[Step], inputs: list, grads: list, activity_scale):
    """``W``: the gradients of every weighted step's variables, from its inputs and output gradients.

    ``inputs[k]``/``grads[k]`` are lists over micro-batches, concatenated
    here so that each step's weight gradient is one pass over the batch.
    """
    result = []
    for k, step in enumerate(steps):
        if not step.variables:
            continue
        x = tf.concat(inputs[k], axis=0) if len(inputs[k]) > 1 else inputs[k][0]
        g = tf.concat(grads[k], axis=0) if len(grads[k]) > 1 else grads[k][0]
        handles = [compat.variable_handle(v) for v in step.variables]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(handles)
            y = step(x, True)
            target = _dot(y, g) + activity_scale * _sum(step.own_losses())
        result += [_zeros_if_none(grad, v) for grad, v in zip(tape.gradient(target, handles), step.variables)]
    return result


def _dot(y, g):
    """``sum(y * g)`` in float32: a target whose gradient is ``g`` pulled back through ``y``."""
    return tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(tf.stop_gradient(g), tf.float32))


def _sum(losses) -> tf.Tensor:
    total = tf.constant(0.0, tf.float32)
    for loss in losses:
        total += tf.cast(tf.reduce_sum(loss), tf.float32)
    return total


def _zeros_if_none(grad, like):
    return tf.zeros(like.shape, like.dtype) if grad is None else grad
