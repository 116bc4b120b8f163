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
``W``; see :mod:`keras_pipe.stage.programs`). The forward is here; the backward,
split (``I`` then a batched ``W``) or recorded under a tape, is
:mod:`keras_pipe.stage.backward`; the batched ``W`` and the update are
:mod:`keras_pipe.stage.update`.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.stage import replay
from keras_pipe.stage.backward import StageBackward, _distinct_bytes, unbatched_spec
from keras_pipe.stage.batchnorm import DeferredBatchNormalization
from keras_pipe.stage.gradients import GradientSum
from keras_pipe.stage.masked import Masked
from keras_pipe.stage.programs import StageProgram
from keras_pipe.stage.update import StageUpdate

RECOMPUTE = ("never", "except_last", "always")


class StageCompute(StageBackward, StageUpdate):
    """The nodes one rank runs and the compiled programs that run them.

    Args:
        stage: this rank's :class:`~keras_pipe.graph.cut.Stage`.
        calls: its nodes' :class:`~keras_pipe.graph.graph.NodeCall`\\ s, in order.
        graph: the whole :class:`~keras_pipe.graph.cut.Graph` (tensor names, masks).
        layers: the layers whose weights the stage holds.
        jit: compile programs with XLA where the layers allow it.
        eager: run everything op by op (``compile(run_eagerly=True)``).
        recompute: ``"never"``, ``"except_last"`` or ``"always"``.
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
        jit: bool = True,
        eager: bool = False,
        recompute: str = "never",
        output_structure=None,
        regularized=None,
        frozen: bool = False,
    ):
        check_recompute(recompute)
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
        self._groups: dict = {}  # optimizer id -> how its update is cut (update.py)
        self._checks: list | None = None  # while a checked program traces: (note, [min, max]) to verify
        self._input_specs: list | None = None  # a training micro-batch's inputs, without a batch size
        self._kept: dict = {}  # micro-batch -> what its backward needs
        self._for_weights: dict = {}  # micro-batch -> (inputs, output gradients) of weighted steps
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
        self.weight_bytes = self._weight_bytes()
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
        self._head_from = self._first_head_step() if self.split else 0
        self._weighted = [k for k, step in enumerate(self.steps) if step.variables]
        # what one micro-batch holds from its F to its I, and from its I to its W (measured on the first)
        self.kept_bytes: int | None = None
        self.held_bytes: int | None = None
        self._programs.clear()
        self._groups.clear()

    def configure(self, jit, eager: bool, frozen: bool = False) -> None:
        """Changes how programs compile (after ``compile()``); forgets the compiled ones.

        ``jit``: ``True`` (XLA wherever it compiles), ``"auto"`` (XLA except
        for the training programs of a stage that draws random numbers:
        XLA's random streams are not TensorFlow's, so dropout would draw
        other masks than the unsplit model's), ``False`` (never).
        """
        self.jit, self.eager, self.frozen = jit, eager, frozen
        self._prepare()  # (after model.trainable = False, say: Keras asks for compile() again)

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
            self._kept[i] = (kept, seeds)
            if self.kept_bytes is None:
                self.kept_bytes = _distinct_bytes(t for step_inputs in kept for t in step_inputs)
            return outputs, activity

        def train(inputs):
            values, activity, _, _ = self._run(inputs, True)
            return self._sends(values) + self._predictions(values), activity

        program = self._program(("forward", True), train, random=True)
        return self._recorded(i, program, list(inputs), (), recompute, self._differentiated_sends)

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
        return self._recorded(i, program, list(inputs), (y, sample_weight), recompute, lambda out: [out[0], out[3]])

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
        self._kept.clear()
        self._for_weights.clear()
        self.gradients.reset()


def check_recompute(value) -> None:
    """Refuses an unknown ``recompute`` option, naming the accepted ones."""
    if value not in RECOMPUTE:
        raise PipelineConfigError(
            f"recompute={value!r}: give one of {', '.join(map(repr, RECOMPUTE))} (as torchgpipe's checkpoint: "
            "'always' keeps only each micro-batch's input and reruns its forward during the backward)."
        )


def _unique(items) -> list:
    seen, result = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            result.append(item)
    return result
