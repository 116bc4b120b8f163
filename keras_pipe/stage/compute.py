"""Internal: one stage's compute — its nodes' forward and backward, as compiled programs.

Compute only: nothing here sends, receives or times. The executor
(:mod:`keras_pipe.engine.executor`) calls these methods in the order the schedule
gives, and moves tensors between ranks itself. A stage's forward takes its
inputs (:attr:`keras_pipe.graph.cut.Stage.inputs`: model inputs on the first
stage, received tensors elsewhere) as a list, runs its nodes
(:class:`~keras_pipe.graph.graph.NodeCall`) in order, and returns its outputs
(:attr:`~keras_pipe.graph.cut.Stage.outputs`); a tensor that carries a Keras mask
travels as a :class:`Masked` pair.

Each method runs one compiled program per micro-batch (or per batch, for
``W``; see :mod:`keras_pipe.stage.programs`). The forward is here; a
:class:`StageCompute` holds two members it makes in :meth:`StageCompute._prepare`,
each given what it needs: its backward (split, ``I`` then a batched ``W``, or
recorded under a tape: :class:`~keras_pipe.stage.backward.StageBackward`) and
its update (the batched ``W``, regularization, norms, the optimizer:
:class:`~keras_pipe.stage.update.StageUpdate`). The executor calls the
compute's methods only; those of the backward and the update delegate.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.stage import replay
from keras_pipe.stage.backward import Forward, StageBackward, unbatched_spec
from keras_pipe.stage.batchnorm import DeferredBatchNormalization
from keras_pipe.stage.gradients import GradientSum, lookup_form, watch_weights
from keras_pipe.stage.masked import Masked
from keras_pipe.stage.programs import StageProgram
from keras_pipe.stage.update import StageUpdate, variable_nbytes


class StageCompute:
    """The nodes one rank runs and the compiled programs that run them; its backward and its update as members.

    Args:
        stage: this rank's :class:`~keras_pipe.graph.cut.Stage`.
        calls: its nodes' :class:`~keras_pipe.graph.graph.NodeCall`\\ s, in order.
        graph: the whole :class:`~keras_pipe.graph.cut.Graph` (tensor names, masks).
        layers: the layers whose weights the stage holds.
        jit: compile programs with XLA where the layers allow it.
        eager: run everything op by op (``compile(run_eagerly=True)``).
        recompute: ``"never"``, ``"except_last"`` or ``"always"`` (checked with the pipeline's options:
            :meth:`keras_pipe.engine.options.PipelineOptions.resolve`).
        output_structure: last stage: the model's outputs as ``KerasTensor``s (to pack predictions).
        regularized: the layers whose weight regularizers this stage counts (default: all of ``layers``;
            a layer several stages hold is counted by one).
    """

    def __init__(
        self,
        stage,
        calls,
        graph,
        layers,
        *,
        jit: bool = True,
        eager: bool = False,
        recompute: str = "never",
        output_structure=None,
        regularized=None,
        frozen: bool = False,
    ):
        self.stage = stage
        self.calls = list(calls)
        self.graph = graph
        self.layers = list(layers)
        self.recompute = recompute
        self.jit, self.eager, self.frozen = jit, eager, frozen
        self.is_first = stage.index == 0
        self.output_structure = output_structure
        self.gradient_inputs = [c.tensor for c in stage.receives if c.gradient]
        self.gradient_outputs = [c.tensor for c in stage.sends if c.gradient]
        self.num_sends = len(stage.sends)
        self._programs: dict = {}
        self._checks: list | None = None  # while a checked program traces: (note, [min, max]) to verify
        self._input_specs: list | None = None  # a training micro-batch's inputs, without a batch size
        self.regularized_layers = list(layers) if regularized is None else list(regularized)
        # what a recomputed forward reads (the random generators' state) and updates (the rest)
        self._generator_states = _unique(
            compat.variable_handle(g.state) for layer in self.layers for g in compat.seed_generators(layer)
        )
        self._deferred_norms = [
            sub
            for layer in self.layers
            for sub in compat.sublayers(layer)
            if isinstance(sub, DeferredBatchNormalization)
        ]
        stateful = [compat.variable_handle(v) for layer in self.layers for v in layer.non_trainable_variables]
        stateful += [v for norm in self._deferred_norms for v in norm.step_variables()]
        self._forward_updates = _unique(v for v in stateful if all(v is not g for g in self._generator_states))
        self.set_masks({t: graph.tensors[t].mask for t in set(stage.inputs) | set(stage.outputs)})

    def set_masks(self, masks: dict) -> None:
        """The Keras mask each input and output carries (``None``: none), as measured on real tensors."""
        self.masks = {t: masks.get(t) for t in set(self.stage.inputs) | set(self.stage.outputs)}
        self._prepare()

    def _prepare(self) -> None:
        """What follows from the layers, their trainable flags and the masks: variables, split, steps."""
        # (a frozen model, trainable=False, trains nothing, whatever its layers' flags say: Keras' Model does so)
        weights = () if self.frozen else (v for layer in self.layers for v in compat.trained_weights(layer))
        self.trainable_variables = _unique(weights)
        self.weight_bytes = sum(map(variable_nbytes, self.trainable_variables))
        self.gradients = GradientSum(self.trainable_variables, self._program, self.sparse_forms)
        self._sparse_forms: dict | None = None
        self.has_weight_regularizers = not self.frozen and any(
            v.regularizer is not None for layer in self.regularized_layers for v in compat.trained_weights(layer)
        )
        reasons = [r for r in map(replay.why_not_replayable, self.calls) if r]
        if any(m is not None for m in self.masks.values()):
            reasons.insert(0, "a Keras mask travels into or out of the stage")
        if self.recompute != "never":
            reasons.insert(0, f"recompute={self.recompute!r} reruns the recorded forward")
        self.split = not reasons
        self.why_recorded = reasons[0] if reasons else None
        first_free = len(self.graph.tensors)
        self.steps = replay.steps_of(self.calls, first_free) if self.split else []
        self._weighted = [k for k, step in enumerate(self.steps) if step.variables]
        self._programs.clear()
        # the members, made again from what changed (what they held of a step is gone, as between steps)
        self._backward = StageBackward(
            Forward(self._run, self._head, self._predictions),
            self.stage,
            num_sends=self.num_sends,
            last=self.output_structure is not None,
            tensors=self.graph.tensors,
            split=self.split,
            steps=self.steps,
            variables=self.trainable_variables,
            gradients=self.gradients,
            program=self._program,
            generators=self._generator_states,
            forward_updates=self._forward_updates,
        )
        self._update = StageUpdate(
            self.trainable_variables,
            self.steps,
            self.regularized_layers,
            self.gradients,
            self._program,
            self.weight_bytes,
        )

    def configure(self, jit, eager: bool, frozen: bool = False) -> None:
        """Changes how programs compile (after ``compile()``); forgets the compiled ones.

        ``jit``: ``True`` (XLA wherever it compiles), ``"auto"`` (XLA except
        for the training programs of a stage that draws random numbers:
        XLA's random streams are not TensorFlow's, so dropout would draw
        other masks than the unsplit model's), ``False`` (never).
        """
        self.jit, self.eager, self.frozen = jit, eager, frozen
        self._prepare()  # (after model.trainable = False, say: Keras asks for compile() again)

    def forget_optimizer(self, optimizer) -> None:
        """Drops the programs that update with ``optimizer`` (``schedule="auto"``'s timing copy), which they hold."""
        # (a program's key is a name, or a flat tuple of a name and ids: the optimizer's, where it updates with it)
        self._programs = {k: p for k, p in self._programs.items() if not (isinstance(k, tuple) and id(optimizer) in k)}
        self._update.forget_optimizer(optimizer)

    @property
    def draws_random(self) -> bool:
        """Whether the stage's layers hold random generators (dropout, noise, random augmentation)."""
        return bool(self._generator_states)

    def _program(self, key, function, random: bool = False) -> StageProgram:
        """The compiled program ``key`` of ``function``; ``random``: it runs the layers in training."""
        if key not in self._programs:
            self._programs[key] = StageProgram(self, key, function, random)
        return self._programs[key]

    # -- running the nodes ------------------------------------------------

    def _bind(self, inputs) -> dict:
        """The stage's input list as tensor values, each with its Keras mask attached."""
        values = {}
        for t, value in zip(self.stage.inputs, inputs):
            if isinstance(value, Masked):
                tensor = tf.identity(value.tensor)  # a tensor of this trace's own, to carry the mask
                compat.set_mask(tensor, value.mask)
                value = tensor
            values[t] = value
        return values

    def _run(self, inputs, training: bool, keep: bool = False):
        """``(values, activity loss, kept inputs, seeds)`` of one forward of the stage's nodes."""
        if training and self._input_specs is None:
            self._input_specs = [unbatched_spec(v) for v in inputs]
        values = self._bind(inputs)
        if self.split:
            self._check_ids(values, self.calls)
            activity, kept, seeds = replay.forward(self.steps, values, training, keep)
            return values, activity, kept, seeds
        self._check_ids(values, self.calls)
        activity = tf.constant(0.0, tf.float32)
        for call in self.calls:
            values.update(zip(call.outputs, call(values, training)))
            layer = call.layer
            if layer is not None:
                for sub in compat.sublayers(layer):
                    for loss in compat.own_losses(sub):
                        activity += tf.cast(tf.reduce_sum(loss), tf.float32)
        return values, activity, [], []

    def _sends(self, values) -> list:
        """What the stage sends on, checked against the masks measured when the pipeline was built."""
        return [self._crossing(t, values[t]) for t in self.stage.outputs[: self.num_sends]]

    def _crossing(self, t: int, value):
        mask = compat.get_mask(value)
        expected = self.masks.get(t)
        if (mask is None) != (expected is None):
            tensor = self.graph.tensors[t].name
            raise PipelineConfigError(
                f"{tensor!r} {'carries' if mask is not None else 'carries no'} Keras mask at run time, but "
                f"{'did not' if mask is not None else 'did'} when the pipeline was built from real tensors; a "
                "stage boundary cannot carry a mask that comes and goes. Make the mask the same for every batch."
            )
        return value if mask is None else Masked(value, tf.cast(mask, tf.bool))

    def _model_outputs(self, values) -> list:
        return [values[t] for t in self.stage.outputs[self.num_sends :]]

    def _pack(self, flat):
        return keras.tree.pack_sequence_as(self.output_structure, flat)

    def _head(self, loss, values, y, sample_weight):
        """Last stage: ``(values, divisors)`` of each loss term on the micro-batch's model outputs."""
        y_pred = self._pack(self._model_outputs(values))
        if self._checks is not None:
            self._checks += loss.label_ranges(y, y_pred)
        return loss.values(y, y_pred, sample_weight)

    def _check_ids(self, values, calls) -> None:
        """Under XLA: the range of every id an ``Embedding`` looks up (XLA reads past the table silently)."""
        if self._checks is None:
            return
        for call in calls:
            layer = call.layer
            if isinstance(layer, keras.layers.Embedding) and not call.node.arguments.kwargs and call.inputs:
                ids = values.get(call.inputs[0])
                if ids is None:
                    continue  # (an id computed inside the stage: checked by its own node's turn)
                ids = tf.cast(ids, tf.int64)
                note = f"{layer.name!r} ({type(layer).__name__} of input_dim={layer.input_dim}) looked up id"
                self._checks.append(
                    ((note, 0, int(layer.input_dim)), tf.stack([tf.reduce_min(ids), tf.reduce_max(ids)]))
                )

    def _predictions(self, values) -> list:
        """The model outputs, ``Masked`` where one carries a Keras mask (the metrics need it)."""
        result = []
        for t, value in zip(self.stage.outputs[self.num_sends :], self._model_outputs(values)):
            mask = compat.get_mask(value)
            if (mask is None) != (self.masks.get(t) is None):
                self._crossing(t, value)  # raises
            result.append(value if mask is None else Masked(value, tf.cast(mask, tf.bool)))
        return result

    # -- forward ----------------------------------------------------------

    def recomputes(self, i: int, num_microbatches: int) -> bool:
        """Whether micro-batch ``i``'s forward keeps only its input, its backward rerunning the forward."""
        return self.recompute == "always" or (self.recompute == "except_last" and i != num_microbatches - 1)

    def forward(self, i: int, inputs, training: bool, recompute: bool = False):
        """``F``: ``(outputs, activity loss)`` of micro-batch ``i``; when training, keeps what its backward needs."""
        if not training:

            def infer(inputs):
                values, activity, _, _ = self._run(inputs, False)
                return self._sends(values) + self._predictions(values), activity

            return self._program(("forward", False), infer)(list(inputs))
        if self.split and not recompute:

            def keep(inputs):
                values, activity, kept, seeds = self._run(inputs, True, keep=True)
                return self._sends(values) + self._predictions(values), activity, kept, seeds

            outputs, activity, kept, seeds = self._program(("forward", True), keep, random=True)(list(inputs))
            self._backward.keep(i, kept, seeds)
            return outputs, activity

        def train(inputs):
            values, activity, _, _ = self._run(inputs, True)
            return self._sends(values) + self._predictions(values), activity

        program = self._program(("forward", True), train, random=True)
        return self._backward.record(i, program, list(inputs), (), recompute, self._differentiated_sends)

    def _differentiated_sends(self, out):
        outputs, activity = out
        kept = [o for o, t in zip(outputs, self.stage.outputs) if t in self.gradient_outputs]
        return [o.tensor if isinstance(o, Masked) else o for o in kept] + [activity]

    def forward_loss(self, loss, inputs, y, sample_weight, coefficients):
        """Last stage, evaluation: ``(weighted loss, term values, predictions)``."""

        def evaluate(inputs, y, sample_weight, coefficients):
            values, activity, _, _ = self._run(inputs, False)
            terms, _ = self._head(loss, values, y, sample_weight)
            total = tf.reduce_sum(terms * coefficients[:-1]) + activity * coefficients[-1]
            return total, terms, self._predictions(values)

        return self._program(("forward_loss", id(loss)), evaluate)(list(inputs), y, sample_weight, coefficients)

    def forward_head(self, i: int, loss, inputs, y, sample_weight, training: bool, recompute: bool = False):
        """Last stage, a loss whose divisors only every forward knows: ``(sums, divisors, predictions, activity)``.

        ``sums`` is each term's value times its divisor (the micro-batch's
        summed entries); the backward (recorded) seeds it with each term's
        weight over the whole batch's divisor, known once every micro-batch
        ran its forward (see :func:`keras_pipe.schedules.schedule.gpipe`'s
        ``whole_batch_loss``).
        """

        def head(inputs, y, sample_weight):
            values, activity, _, _ = self._run(inputs, training)
            terms, divisors = self._head(loss, values, y, sample_weight)
            return terms * divisors, divisors, self._predictions(values), activity

        program = self._program(("forward_head", id(loss), training), head, random=training)
        if not training:
            return program(list(inputs), y, sample_weight)
        return self._backward.record(
            i, program, list(inputs), (y, sample_weight), recompute, lambda out: [out[0], out[3]]
        )

    # -- the backward and the update: the members' -------------------------------

    def forward_backward(self, i: int, loss, inputs, y, sample_weight, coefficients):
        """Last stage, ``FB`` or ``FI``: ``(weighted loss, term values, predictions, input gradients)``."""
        return self._backward.forward_backward(i, loss, inputs, y, sample_weight, coefficients)

    def backward(self, i: int, grads: list, activity_scale: float):
        """``B`` (recorded) or ``I`` (split) of micro-batch ``i`` given its outputs' gradients; the input gradients."""
        return self._backward.backward(i, grads, activity_scale)

    def estimate_holding(self, rows: int) -> None:
        """What a micro-batch of ``rows`` holds in flight and for its ``W``, from the graph's shapes, if all known."""
        self._backward.estimate_holding(rows)

    @property
    def kept_bytes(self) -> int | None:
        """What one micro-batch holds from its ``F`` to its ``I`` (estimated or measured; ``None``: not yet)."""
        return self._backward.kept_bytes

    @property
    def held_bytes(self) -> int | None:
        """What one micro-batch holds from its ``I`` to its ``W`` (estimated or measured; ``None``: not yet)."""
        return self._backward.held_bytes

    def weights(
        self,
        microbatches,
        activity_scale: float,
        regularize: bool,
        optimizer=None,
        loss_scale: float = 1.0,
        counts: bool = True,
    ) -> None:
        """``W`` over ``microbatches`` (:meth:`StageUpdate.weights <keras_pipe.stage.update.StageUpdate.weights>`)."""
        parts = self._backward.take_held(microbatches)
        self._update.weights(parts, activity_scale, regularize, optimizer, loss_scale, counts)

    def add_regularization(self, loss_scale: float = 1.0) -> tf.Tensor:
        """Adds the weight regularizers' gradients (recorded backward), times ``loss_scale``; returns their loss."""
        return self._update.add_regularization(loss_scale)

    def regularization_loss(self) -> tf.Tensor:
        """The loss of this stage's weight regularizers (counted once per batch, as Keras does)."""
        return self._update.regularization_loss()

    def apply(self, optimizer, grads=None, scale: float | None = None) -> None:
        """One optimizer step with ``grads`` (summed over replicas) or this step's summed gradients."""
        self._update.apply(optimizer, grads, scale)

    def squared_norm(self, grads, counted=None) -> float:
        """This stage's share of the whole model's squared gradient norm, as Keras' ``global_norm`` counts it."""
        return self._update.squared_norm(grads, counted)

    def sparse_forms(self) -> dict:
        """``{position: form}`` of the sparse gradients of the trainable variables (:mod:`keras_pipe.stage.gradients`).

        Read once from the stage's forward and gradient traced (never run)
        on inputs without a batch size: the count of a lookup's slices is
        then known only where its ids do not come from the batch.
        """
        if self._sparse_forms is None:
            if self._input_specs is None:
                raise PipelineConfigError("a sparse gradient before any training forward (a bug in keras_pipe)")
            forms = {}

            def trace(inputs):
                with tf.GradientTape() as tape:
                    watch_weights(tape, self.trainable_variables)
                    values, total, _, _ = self._run(inputs, True)
                    for t in self.stage.outputs:
                        if values[t].dtype.is_floating:
                            total += tf.reduce_sum(tf.cast(values[t], tf.float32))
                grads = tape.gradient(total, self.trainable_variables)
                sparse = [(i, g) for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
                forms.update({i: lookup_form(g.indices) for i, g in sparse})
                return tf.constant(0)

            try:
                tf.function(trace, autograph=False).get_concrete_function(self._input_specs)
            except Exception as error:  # noqa: BLE001 (any layer's error while tracing without a batch size)
                raise PipelineConfigError(
                    f"stage {self.stage.index} gives an embedding a sparse gradient over several micro-batches, and "
                    "how its slices add up is read from the stage traced without a batch size, which failed "
                    f"({type(error).__name__}: {str(error)[:300]}). Use num_microbatches=1."
                ) from error
            self._sparse_forms = forms
        return self._sparse_forms

    # -- the step's bounds -----------------------------------------------------

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
        self._backward.forget()
        self.gradients.reset()


def _unique(items) -> list:
    seen, result = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            result.append(item)
    return result
