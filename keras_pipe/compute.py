"""Internal: one stage's compute — compiled forward, backward, weight-gradient and update programs.

Compute only: nothing here sends, receives or times. The executor
(:mod:`keras_pipe.executor`) calls these methods in the order the schedule
gives, and moves tensors between ranks itself.

Each method runs one compiled program per micro-batch (or per batch, for
``W`` and the update), XLA-compiled unless ``compile(jit_compile=False)``:
the program is tried with XLA on its first call and falls back to a plain
``tf.function`` where XLA cannot compile the stage's layers (a
``numpy_function``, say). Two ways to backpropagate:

- **split** (every layer replayable, :mod:`keras_pipe.replay`): ``F`` keeps
  each step's input, ``I`` computes the input gradient alone and keeps each
  weighted step's output gradient, ``W`` computes the weight gradients of
  many micro-batches in one pass; the last ``W`` of a step hands its
  gradients straight to the optimizer, in the same program, when no replica
  needs them first.
- **recorded** (any other stage): ``F`` runs under an eager
  ``tf.GradientTape`` that records the compiled forward as one op, and ``B``
  runs TensorFlow's gradient of it, keeping the activations the forward
  kept; weight gradients are added to accumulators.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from keras_pipe import compat, replay
from keras_pipe.batchnorm import DeferredBatchNormalization
from keras_pipe.gradients import GradientSum
from keras_pipe.links import Masked

_XLA_REFUSALS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, NotImplementedError)


class Program:
    """A compiled function: XLA if it compiles, else a plain ``tf.function``; eager when asked.

    Calls go straight to the traced graph of the arguments' shapes (see
    :func:`keras_pipe.compat.call_concrete`): a ``tf.function`` call spends
    100-200 us matching its arguments to a trace, more than a small
    micro-batch's compute.
    """

    def __init__(self, function, jit: bool, eager: bool = False):
        self.python = function
        self.eager = eager
        self.xla = tf.function(function, jit_compile=True) if jit and not eager else None
        self.graph = tf.function(function)
        self.compiled_with_xla: bool | None = None  # known after the first call
        self._concrete: dict = {}

    def __call__(self, *args):
        if self.eager:
            return self.python(*args)
        key = _signature(args)
        concrete = self._concrete.get(key)
        if concrete is None:
            concrete = self._trace(key, args)
        flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(args, expand_composites=True) if a is not None]
        if self.xla is None:
            return compat.call_concrete(concrete, flat)
        try:
            result = compat.call_concrete(concrete, flat)
        except _XLA_REFUSALS as error:
            # XLA refuses the stage's layers: on the first call, or on the first under a gradient
            # tape (TensorFlow then compiles the forward with what its gradient needs, an LSTM's
            # TensorList say). Plain graphs from now on.
            if self.compiled_with_xla and not _refused_by_xla(error):
                raise
            self.xla, self.compiled_with_xla = None, False
            self._concrete.clear()
            return compat.call_concrete(self._trace(key, args), flat)
        self.compiled_with_xla = True
        return result

    def _trace(self, key, args):
        function = self.xla if self.xla is not None else self.graph
        self._concrete[key] = concrete = function.get_concrete_function(*args)
        return concrete


def _refused_by_xla(error) -> bool:
    """Whether an error of a program that compiled before is XLA's refusal, not the computation's own error."""
    return isinstance(error, tf.errors.UnimplementedError) or "XLA" in str(error)


def _signature(value):
    """What selects a trace: the structure, shapes and dtypes of the arguments (hashable)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((key, _signature(value[key])) for key in sorted(value))
    if value is None:
        return None
    if isinstance(value, tf.IndexedSlices):
        return ("slices", _signature(value.values), _signature(value.indices))
    return (tuple(value.shape), str(value.dtype))


class StageCompute:
    """The layers one rank owns and the compiled programs that run them.

    Args:
        layers: this stage's layers, built.
        is_first: whether the stage reads the model input (it needs no input gradient).
        jit: compile programs with XLA where the layers allow it.
        eager: run everything op by op (``compile(run_eagerly=True)``).
    """

    def __init__(
        self,
        layers,
        is_first: bool,
        jit: bool = True,
        eager: bool = False,
        masked: bool = False,
        mask_out: bool = False,
        recompute: str = "never",
        several: bool = False,
    ):
        check_recompute(recompute)
        self.recompute = recompute
        self.layers = list(layers)
        self.is_first = is_first
        self.jit = jit
        self.eager = eager
        self.mask_out = mask_out  # the output's Keras mask goes to the next stage with it
        self.trainable_variables = [v for layer in self.layers for v in layer.trainable_weights]
        reasons = [r for r in map(replay.why_not_replayable, self.layers) if r]
        if masked:
            reasons.insert(0, "a Keras mask travels through the stage")
        if several:
            reasons.insert(0, "several tensors cross into, within or out of the stage")
        if recompute != "never":
            reasons.insert(0, f"recompute={recompute!r} reruns the recorded forward")
        self.split = not reasons
        self.why_recorded = reasons[0] if reasons else None
        self.steps = replay.steps_of(self.layers) if self.split else []
        self.has_weight_regularizers = any(v.regularizer is not None for v in self.trainable_variables)
        # what a recomputed forward reads (the random generators' state) and updates (the rest)
        self._generator_states = [
            compat.variable_handle(g.state) for layer in self.layers for g in compat.seed_generators(layer)
        ]
        self._deferred_norms = [
            sub
            for layer in self.layers
            for sub in compat.sublayers(layer)
            if isinstance(sub, DeferredBatchNormalization)
        ]
        stateful = [compat.variable_handle(v) for layer in self.layers for v in layer.non_trainable_variables]
        stateful += [v for norm in self._deferred_norms for v in norm.step_variables()]
        self._forward_updates = [v for v in stateful if all(v is not g for g in self._generator_states)]
        self.gradients = GradientSum(self.trainable_variables, self._program)
        self._programs: dict = {}
        self._kept: dict = {}  # micro-batch -> what its backward needs
        self._for_weights: dict = {}  # micro-batch -> (inputs, output gradients) of weighted steps

    def configure(self, jit: bool, eager: bool) -> None:
        """Changes how programs compile (after ``compile()``); forgets the compiled ones."""
        self.jit, self.eager = jit, eager
        self._programs.clear()

    def _program(self, key, function) -> Program:
        if key not in self._programs:
            self._programs[key] = Program(function, self.jit, self.eager)
        return self._programs[key]

    # -- forward ----------------------------------------------------------

    def recomputes(self, i: int, num_microbatches: int) -> bool:
        """Whether micro-batch ``i``'s forward keeps only its input, its backward rerunning the forward."""
        return self.recompute == "always" or (self.recompute == "except_last" and i != num_microbatches - 1)

    def forward(self, i: int, x, training: bool, recompute: bool = False):
        """``F``: ``(y, activity loss)`` of micro-batch ``i``; when training, keeps what its backward needs.

        With ``recompute`` that is only the input and the random generators'
        state: the backward reruns the forward, drawing the same dropout masks.
        """
        if not training:
            return self._program(("forward", False), lambda x: self._chain(x, False)[:2])(x)
        if self.split and not recompute:
            y, activity, inputs, seeds = self._program(("forward", True), lambda x: self._chain(x, True, keep=True))(x)
            self._kept[i] = (inputs, seeds)
            return y, activity
        program = self._program(("forward", True), lambda x: self._chain(x, True)[:2])
        return self._recorded(i, program, x, (), recompute, lambda out: [*_sources(out[0]), out[1]])

    def forward_head(self, i: int, loss_fn, reduction: str, x, y, sample_weight, training: bool, recompute=False):
        """Last stage, a masked output under a mean loss: ``(summed loss, denominator, y_pred, activity)``.

        Keras divides a masked output's loss by the count of its unmasked
        entries (``sum_over_batch_size``) or by their summed sample weights
        (``mean_with_sample_weight``), counted over the batch. A micro-batch
        holds only part of that count, so this returns its loss times its own
        denominator (the sum of its entries' losses) and the denominator; the
        backward (recorded) then seeds the sum with one over the whole batch's
        denominator, known only after every micro-batch's forward (see
        :func:`keras_pipe.schedule.gpipe`'s ``whole_batch_loss``). ``y_pred``
        is ``Masked``, for the metrics.
        """

        def head(x, y, sample_weight):
            y_pred, activity = self._chain(x, training)[:2]
            mask = compat.get_mask(y_pred)
            loss = tf.cast(loss_fn(y, y_pred, sample_weight), tf.float32)
            denominator = loss_denominator(mask, sample_weight, reduction)
            return loss * denominator, denominator, _prediction(y_pred), activity

        program = self._program(("forward_head", id(loss_fn), reduction, training), head)
        if not training:
            return program(x, y, sample_weight)
        return self._recorded(i, program, x, (y, sample_weight), recompute, lambda out: [out[0], out[3]])

    def _recorded(self, i: int, program, x, args: tuple, recompute: bool, differentiated):
        """Runs ``program(x, *args)`` for a recorded backward: under a tape, or keeping only its input.

        ``differentiated(outputs)`` picks the outputs the backward seeds
        (the stage output's floating-point tensors and the activity loss).
        """
        if recompute:
            self._kept[i] = _Rerun(x, self._random_state(), program, args, differentiated)
            return program(x, *args)
        tape = tf.GradientTape()
        with tape:
            if not self.is_first:
                tape.watch(_sources(x))
            outputs = program(x, *args)
        self._kept[i] = (tape, x, differentiated(outputs))
        return outputs

    def _chain(self, x, training: bool, keep: bool = False):
        if self.split:
            return replay.forward(self.steps, x, training, keep)
        activity = tf.constant(0.0, tf.float32)
        if isinstance(x, Masked):  # activations and the Keras mask they carry
            x, mask = x
            x = tf.identity(x)  # a tensor of this trace's own, to carry the mask
            compat.set_mask(x, mask)
        for layer in self.layers:
            x = layer(x, training=training)
            for sub in compat.sublayers(layer):
                for loss in compat.own_losses(sub):
                    activity += tf.cast(tf.reduce_sum(loss), tf.float32)
        if self.mask_out:
            x = Masked(x, tf.cast(compat.get_mask(x), tf.bool))
        return x, activity, [], []

    def forward_loss(self, loss_fn, x, y, sample_weight, scales):
        """Last stage, evaluation: ``(loss share, y_pred)``; ``scales = (data, activity)`` weights."""

        def evaluate(x, y, sample_weight, scales):
            y_pred, activity = self._chain(x, False)[:2]
            return _weighted(loss_fn(y, y_pred, sample_weight), activity, scales), _prediction(y_pred)

        return self._program(("forward_loss", id(loss_fn)), evaluate)(x, y, sample_weight, scales)

    # -- backward -----------------------------------------------------------

    def forward_backward(self, i: int, loss_fn, x, y, sample_weight, scales):
        """Last stage, ``FB`` or ``FI``: ``(loss share, y_pred, input gradient)`` of micro-batch ``i``."""
        need_input = not self.is_first
        if self.split:

            def forward_input(x, y, sample_weight, scales):
                y_pred, activity, inputs, seeds = replay.forward(self.steps, x, True, keep=True)

                def head(y_pred):
                    return tf.cast(loss_fn(y, y_pred, sample_weight), tf.float32) * scales[0]

                dx, step_grads = replay.input_gradient(self.steps, inputs, seeds, None, scales[1], need_input, head)
                loss = head(y_pred) + activity * scales[1]
                return loss, y_pred, _or_empty(dx), _weighted_parts(self.steps, inputs, step_grads)

            loss, y_pred, dx, parts = self._program(("forward_input", id(loss_fn)), forward_input)(
                x, y, sample_weight, scales
            )
            self._for_weights[i] = parts
            return loss, y_pred, dx

        def forward_backward(x, y, sample_weight, scales):
            with tf.GradientTape() as tape:
                if need_input:
                    tape.watch(_sources(x))
                y_pred, activity = self._chain(x, True)[:2]
                loss = _weighted(loss_fn(y, y_pred, sample_weight), activity, scales)
            inputs = _sources(x) if need_input else []
            sources = inputs + self.trainable_variables
            grads = tape.gradient(loss, sources)
            dx = None
            if need_input:
                dx = [tf.zeros_like(t) if g is None else g for g, t in zip(grads[: len(inputs)], inputs)]
                dx = _input_gradient(x, dx)
            return loss, _prediction(y_pred), _or_empty(dx), self.gradients.add_in_graph(grads[len(inputs) :])

        self.gradients.prepare()
        loss, y_pred, dx, sparse = self._program(
            ("forward_backward", id(loss_fn), self.gradients.empty), forward_backward
        )(x, y, sample_weight, scales)
        self.gradients.added(sparse)
        return loss, y_pred, dx

    def backward(self, i: int, grad, activity_scale: float):
        """``B`` (recorded) or ``I`` (split) of micro-batch ``i`` given its output gradient; the input gradient."""
        need_input = not self.is_first
        if self.split:
            inputs, seeds = self._kept.pop(i)

            def input_grad(inputs, seeds, grad, activity_scale):
                dx, step_grads = replay.input_gradient(self.steps, inputs, seeds, grad, activity_scale, need_input)
                return _or_empty(dx), _weighted_parts(self.steps, inputs, step_grads)

            dx, parts = self._program("input_grad", input_grad)(inputs, seeds, grad, tf.constant(activity_scale))
            self._for_weights[i] = parts
            return dx if need_input else None
        kept = self._kept.pop(i)
        if isinstance(kept, _Rerun):
            return self._rerun_backward(kept, grad, activity_scale)
        tape, x, outputs = kept
        inputs = _sources(x) if need_input else []
        sources = inputs + self.trainable_variables
        output_grads = (grad if isinstance(grad, list) else [grad]) + [tf.constant(activity_scale, tf.float32)]
        grads = tape.gradient(outputs, sources, output_gradients=output_grads)
        del tape, outputs  # the activations this micro-batch kept
        grads = [tf.zeros(s.shape, s.dtype) if g is None else g for g, s in zip(grads, sources)]
        self.gradients.add(grads[len(inputs) :])
        return _input_gradient(x, grads[: len(inputs)]) if need_input else None

    def weights(
        self, microbatches, activity_scale: float, regularize: bool, optimizer=None, loss_scale: float = 1.0
    ) -> None:
        """``W`` over ``microbatches``: adds their weight gradients (and, if ``regularize``, the weight regularizers').

        With an ``optimizer`` (the step's last ``W`` and no replica to wait
        for) the gradients go straight into its update, in the same program.
        """
        if not self.trainable_variables:
            for i in microbatches:
                self._for_weights.pop(i, None)
            return
        # per weighted step, its inputs and output gradients over the micro-batches
        parts = [self._for_weights.pop(i) for i in microbatches]
        inputs = [[p[0][k] for p in parts] for k in range(len(parts[0][0]))]
        grads = [[p[1][k] for p in parts] for k in range(len(parts[0][1]))]
        weighted = [k for k, s in enumerate(self.steps) if s.variables]

        def weight_grads(inputs, grads, activity_scale, loss_scale):
            full_in, full_g = [None] * len(self.steps), [None] * len(self.steps)
            for position, k in enumerate(weighted):
                full_in[k], full_g[k] = inputs[position], grads[position]
            result = replay.weight_gradients(self.steps, full_in, full_g, activity_scale)
            if regularize:
                regularizers = self._regularization_gradients()
                result = [
                    tf.convert_to_tensor(g) + r * tf.cast(loss_scale, r.dtype) if v.regularizer is not None else g
                    for g, r, v in zip(result, regularizers, self.trainable_variables)
                ]
            return result

        scales = (tf.constant(activity_scale, tf.float32), tf.constant(loss_scale, tf.float32))
        if optimizer is not None and self.gradients.empty:

            def weights_and_update(inputs, grads, activity_scale, loss_scale):
                optimizer.apply(weight_grads(inputs, grads, activity_scale, loss_scale), self.trainable_variables)

            self._program(("weights_update", id(optimizer), regularize), weights_and_update)(inputs, grads, *scales)
            return
        result = self._program(("weights", regularize), weight_grads)(inputs, grads, *scales)
        self.gradients.add(result)
        if optimizer is not None:
            self.apply(optimizer)

    # -- the end of a step ----------------------------------------------------

    def add_regularization(self, loss_scale: float = 1.0) -> tf.Tensor:
        """Adds the weight regularizers' gradients (recorded backward), times ``loss_scale``; returns their loss."""

        def regularization(loss_scale):
            with tf.GradientTape() as tape:
                loss = self._regularization_loss()
                scaled = loss * loss_scale
            return loss, tape.gradient(scaled, self.trainable_variables)

        loss, grads = self._program("regularization_gradients", regularization)(tf.constant(loss_scale, tf.float32))
        self.gradients.add(
            [tf.zeros(v.shape, v.dtype) if g is None else g for g, v in zip(grads, self.trainable_variables)]
        )
        return loss

    def regularization_loss(self) -> tf.Tensor:
        """The loss of this stage's weight regularizers (counted once per batch, as Keras does)."""
        return self._program("regularization", self._regularization_loss)()

    def _regularization_loss(self):
        loss = tf.constant(0.0, tf.float32)
        for layer in self.layers:
            for term in compat.weight_regularization_losses(layer):
                loss += tf.cast(term, tf.float32)
        return loss

    def _regularization_gradients(self):
        handles = [compat.variable_handle(v) for v in self.trainable_variables]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(handles)
            loss = self._regularization_loss()
        grads = tape.gradient(loss, handles)
        return [tf.zeros(v.shape, v.dtype) if g is None else g for g, v in zip(grads, self.trainable_variables)]

    def apply(self, optimizer, grads=None, scale: float | None = None) -> None:
        """One optimizer step with ``grads`` (summed over replicas) or this step's summed gradients.

        ``scale``: multiplies every gradient first (the whole model's ``global_clipnorm``).
        """
        if not self.trainable_variables:
            return
        given = grads is not None
        grads = list(grads) if given else self.gradients.result()

        def update(*grads):
            optimizer.apply(list(grads), self.trainable_variables)

        def scaled_update(scale, *grads):
            optimizer.apply([_scaled(g, scale) for g in grads], self.trainable_variables)

        if scale is None:
            self._program(("apply", id(optimizer)), update)(*grads)
        else:
            self._program(("scaled_apply", id(optimizer)), scaled_update)(tf.constant(scale, tf.float32), *grads)
        self.gradients.reset()

    def squared_norm(self, grads) -> float:
        """The sum of the squares of ``grads`` (this stage's share of the whole model's gradient norm)."""
        if not grads:
            return 0.0

        def squares(*grads):  # in float64: a large loss scale must not overflow the sum
            return tf.add_n([tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float64))) for g in grads])

        return float(self._program("squared_norm", squares)(*grads))

    def _random_state(self) -> list:
        return [tf.identity(v) for v in self._generator_states]

    def _rerun_backward(self, rerun: _Rerun, grad, activity_scale: float):
        """``B`` of a recomputed micro-batch, one compiled program: its forward again, then its backward.

        The forward reruns with the random state it first had (the same
        dropout masks); every other variable a forward may update (batch
        norm's moving statistics) is put back, so the rerun leaves no trace.
        The weight gradients go into the accumulators inside the program, so
        none is materialized beside them.
        """
        need_input = not self.is_first
        generators, others = self._generator_states, self._forward_updates

        def rerun_backward(x, args, states, grad, activity_scale):
            now = [tf.identity(v) for v in generators]
            before = [tf.identity(v) for v in others]
            for variable, value in zip(generators, states):
                variable.assign(value)
            inputs = _sources(x) if need_input else []
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                outputs = rerun.differentiated(rerun.program.python(x, *args))
            output_grads = (grad if isinstance(grad, list) else [grad]) + [activity_scale]
            grads = tape.gradient(outputs, inputs + self.trainable_variables, output_gradients=output_grads)
            for variable, value in zip(generators + others, now + before):
                variable.assign(value)
            dx = None
            if need_input:
                dx = _input_gradient(x, [tf.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)])
            return _or_empty(dx), self.gradients.add_in_graph(grads[len(inputs) :])

        self.gradients.prepare()
        dx, sparse = self._program(("rerun_backward", id(rerun.program), self.gradients.empty), rerun_backward)(
            rerun.x, rerun.args, rerun.states, grad, tf.constant(activity_scale, tf.float32)
        )
        self.gradients.added(sparse)
        return dx if need_input else None

    def begin_step(self) -> None:
        """Before a training step: deferred batch norms start summing the batch's statistics."""
        for norm in self._deferred_norms:
            norm.begin_batch()

    def end_step(self) -> None:
        """After a training step: deferred batch norms move their statistics by the whole batch's."""
        for norm in self._deferred_norms:
            norm.commit_batch()

    def forget_step(self) -> None:
        """Drops whatever a step left behind (after an error, or a replica with no share)."""
        self._kept.clear()
        self._for_weights.clear()
        self.gradients.reset()


RECOMPUTE = ("never", "except_last", "always")


class _Rerun(NamedTuple):
    """What a recomputed micro-batch keeps until its backward: its input and the random generators' state.

    Its forward runs again as ``program(x, *args)``; ``differentiated`` picks the outputs the backward seeds.
    """

    x: object
    states: list
    program: object
    args: tuple
    differentiated: object


def loss_denominator(mask, sample_weight, reduction: str):
    """What Keras divides the summed loss of a masked output by: its unmasked entries, or their weights.

    As ``keras.losses.Loss`` with a mask: ``sum_over_batch_size`` (and
    ``mean``) divides by the count of unmasked entries, ``mean_with_sample_weight``
    by the sum of their sample weights. (``sum`` divides by nothing: its
    micro-batches' losses add up, and never come here, see ``Engine.whole_batch_loss``.)
    """
    mask = tf.cast(mask, tf.float32)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weights = tf.cast(sample_weight, tf.float32)
        while weights.shape.rank < mask.shape.rank:  # one weight per row, over its entries
            weights = weights[..., None]
        return tf.reduce_sum(weights * mask)
    return tf.reduce_sum(mask)


def check_recompute(value) -> None:
    """Refuses an unknown ``recompute`` option, naming the accepted ones."""
    if value not in RECOMPUTE:
        from keras_pipe.errors import PipelineConfigError

        raise PipelineConfigError(
            f"recompute={value!r}: give one of {', '.join(map(repr, RECOMPUTE))} (as torchgpipe's checkpoint: "
            "'always' keeps only each micro-batch's input and reruns its forward during the backward)."
        )


def _sources(value) -> list:
    """The floating-point tensors of a stage's input or output, whose gradients cross the boundary.

    One tensor (a ``Masked`` one without its mask), or each floating-point
    tensor of a structure (integer tensors, token ids say, have no gradient).
    """
    if isinstance(value, Masked):
        return [value.tensor]
    if not _several(value):
        return [value]
    return [t for t in tf.nest.flatten(value) if t.dtype.is_floating]


def _input_gradient(x, grads: list):
    """What the previous stage receives: a tensor, or a list where its output is a structure."""
    return list(grads) if _several(x) else grads[0]


def _several(value) -> bool:
    """Whether a stage's input or output is a structure of tensors (a ``Masked`` tensor is one tensor)."""
    return isinstance(value, (tuple, list, dict)) and not isinstance(value, Masked)


def _prediction(y_pred):
    """The model's output, ``Masked`` where it carries a Keras mask: the metrics need the mask, as the loss does."""
    mask = compat.get_mask(y_pred)
    return y_pred if mask is None else Masked(y_pred, tf.cast(mask, tf.bool))


def _scaled(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)


def _weighted(loss, activity, scales):
    return tf.cast(loss, tf.float32) * scales[0] + activity * scales[1]


def _weighted_parts(steps, inputs, step_grads):
    """(inputs, output gradients) of the weighted steps only: what ``W`` needs."""
    kept = [k for k, s in enumerate(steps) if s.variables]
    return [inputs[k] for k in kept], [step_grads[k] for k in kept]


def _or_empty(tensor):
    return tf.zeros((0,)) if tensor is None else tensor
