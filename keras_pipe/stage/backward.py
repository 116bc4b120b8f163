"""Internal: a stage's backward — split (``I`` then a batched ``W``) or recorded — and what it holds meanwhile.

The part of :class:`~keras_pipe.stage.compute.StageCompute` that differentiates
(a mixin: ``StageCompute`` provides the state):

- **split** (every node replayable, :mod:`keras_pipe.stage.replay`): ``F`` keeps
  each step's inputs, ``I`` computes the input gradients alone and keeps
  each weighted step's output gradients until ``W`` (:mod:`keras_pipe.stage.update`)
  computes the weight gradients of many micro-batches in one pass. What a
  micro-batch holds in flight and for its ``W`` is estimated from the graph's
  shapes, or measured on the first one, so that the schedule can bound it
  (:func:`keras_pipe.schedules.schedule.hold_for`);
- **recorded** (any other stage): ``F`` runs under an eager
  ``tf.GradientTape`` that records the compiled forward as one op, and ``B``
  runs TensorFlow's gradient of it, keeping the activations the forward
  kept; weight gradients are added to accumulators. With recomputation the
  forward keeps only its input and ``B`` reruns it (:class:`_Rerun`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.stage import replay
from keras_pipe.stage.gradients import lookup_form
from keras_pipe.stage.masked import Masked
from keras_pipe.stage.update import variable_nbytes


class StageBackward:
    """Backward methods of a stage's compute (a mixin: ``StageCompute`` provides the state)."""

    def _recorded(self, i: int, program, inputs, args: tuple, recompute: bool, differentiated):
        """Runs ``program(inputs, *args)`` for a recorded backward: under a tape, or keeping only its input.

        ``differentiated(outputs)`` picks the outputs the backward seeds.
        """
        if recompute:
            self._kept[i] = _Rerun(inputs, self._random_state(), program, args, differentiated)
            return program(inputs, *args)
        tape = tf.GradientTape()
        with tape:
            tape.watch(self._gradient_sources(inputs))
            self._watch_weights(tape)
            outputs = program(inputs, *args)
        self._kept[i] = (tape, inputs, differentiated(outputs))
        return outputs

    def _watch_weights(self, tape) -> None:
        """Watches the weights that train: a tape watches only variables whose ``tf.Variable`` is trainable, and
        one allocated while its layer was frozen (a model frozen before the pipeline gave it memory, then
        unfrozen) is not, whatever its Keras flag says now; Keras' flag decides (``compat.trained_weights``)."""
        tape.watch([compat.variable_handle(v) for v in self.trainable_variables])

    def _gradient_sources(self, inputs) -> list:
        """The input tensors whose gradients go back to earlier stages."""
        sources = []
        for t, value in zip(self.stage.inputs, inputs):
            if t in self.gradient_inputs:
                sources.append(value.tensor if isinstance(value, Masked) else value)
        return sources

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
                    self._watch_weights(tape)
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

    # -- backward -----------------------------------------------------------

    def forward_backward(self, i: int, loss, inputs, y, sample_weight, coefficients):
        """Last stage, ``FB`` or ``FI``: ``(weighted loss, term values, predictions, input gradients)``."""
        if self.split:

            def forward_input(inputs, y, sample_weight, coefficients):
                values, activity, kept, seeds = self._run(inputs, True, keep=True)
                terms_out = []

                def head(values):
                    terms, _ = self._head(loss, values, y, sample_weight)
                    terms_out.append(terms)
                    return tf.reduce_sum(terms * coefficients[:-1])

                dx, step_grads = replay.input_gradient(
                    self.steps,
                    kept,
                    seeds,
                    {},
                    coefficients[-1],
                    self.gradient_inputs,
                    head,
                    self._head_from,
                    values,
                    self.stage.outputs[self.num_sends :],
                )
                terms = terms_out[-1]
                total = tf.reduce_sum(terms * coefficients[:-1]) + activity * coefficients[-1]
                return total, terms, self._predictions(values), _filled(dx, inputs, self), self._parts(kept, step_grads)

            total, terms, predictions, dx, parts = self._program(
                ("forward_input", id(loss)), forward_input, random=True
            )(list(inputs), y, sample_weight, coefficients)
            self._hold(i, parts)
            return total, terms, predictions, dx

        def forward_backward(inputs, y, sample_weight, coefficients, first):
            sources_in = self._gradient_sources(inputs)
            with tf.GradientTape() as tape:
                tape.watch(sources_in)
                self._watch_weights(tape)
                values, activity, _, _ = self._run(inputs, True)
                terms, _ = self._head(loss, values, y, sample_weight)
                total = tf.reduce_sum(terms * coefficients[:-1]) + activity * coefficients[-1]
            grads = tape.gradient(total, sources_in + self.trainable_variables)
            dx = [tf.zeros_like(t) if g is None else g for g, t in zip(grads[: len(sources_in)], sources_in)]
            sparse = self.gradients.add_in_graph(grads[len(sources_in) :], first)
            return total, terms, self._predictions(values), dx, sparse

        first = self.gradients.prepare()
        total, terms, predictions, dx, sparse = self._program(
            ("forward_backward", id(loss)), forward_backward, random=True
        )(list(inputs), y, sample_weight, coefficients, first)
        self.gradients.added(sparse)
        return total, terms, predictions, dx

    def backward(self, i: int, grads: list, activity_scale: float):
        """``B`` (recorded) or ``I`` (split) of micro-batch ``i`` given its outputs' gradients; the input gradients.

        ``grads`` are the gradients of the stage's differentiated outputs, in
        order (or, last stage under a whole-batch loss, each term's seed).
        """
        if self.split:
            kept, seeds = self._kept.pop(i)
            outputs = dict(zip(self.gradient_outputs, grads))

            def input_grad(kept, seeds, outputs, activity_scale):
                dx, step_grads = replay.input_gradient(
                    self.steps, kept, seeds, outputs, activity_scale, self.gradient_inputs
                )
                return _filled_from_kept(dx, kept, self), self._parts(kept, step_grads)

            dx, parts = self._program("input_grad", input_grad, random=True)(
                kept, seeds, outputs, tf.constant(activity_scale)
            )
            self._hold(i, parts)
            return dx if self.gradient_inputs else None
        kept = self._kept.pop(i)
        if isinstance(kept, _Rerun):
            return self._rerun_backward(kept, grads, activity_scale)
        tape, inputs, outputs = kept
        sources_in = self._gradient_sources(inputs)
        sources = sources_in + self.trainable_variables
        output_grads = list(grads) + [tf.constant(activity_scale, tf.float32)]
        all_grads = tape.gradient(outputs, sources, output_gradients=output_grads)
        del tape, outputs  # the activations this micro-batch kept
        self.gradients.add(all_grads[len(sources_in) :])  # (None where a weight got no gradient, as in Keras)
        dx = [tf.zeros(s.shape, s.dtype) if g is None else g for g, s in zip(all_grads[: len(sources_in)], sources_in)]
        return dx if self.gradient_inputs else None

    def _hold(self, i: int, parts) -> None:
        """Keeps micro-batch ``i``'s ``parts`` for its ``W``; the first one's size says what holding costs."""
        self._for_weights[i] = parts
        if self.held_bytes is None:
            self.held_bytes = _distinct_bytes(t for part in parts if part is not None for side in part for t in side)

    def estimate_holding(self, rows: int) -> None:
        """What a micro-batch of ``rows`` holds in flight and for its ``W``, from the graph's shapes, if all known.

        The schedule then batches ``W`` from the first step on (else the first
        step runs each ``W`` at once and measures: see :meth:`_hold`).
        """
        if not self.split or self.held_bytes is not None:
            return
        tensors = self.graph.tensors

        def info(t: int, step):
            return tensors[t] if t < len(tensors) else tensors[step.call.outputs[0]]  # (a core's output)

        def nbytes(t: int, step) -> int | None:
            tensor = info(t, step)
            if any(d is None for d in tensor.shape[1:]):
                return None
            return rows * int(np.prod(tensor.shape[1:], dtype=np.int64)) * tf.as_dtype(tensor.dtype).size

        kept, held = {}, 0
        for step in self.steps:
            for t in step.outputs[:1] if step.from_output else step.inputs:
                kept[t] = nbytes(t, step)
            if step.variables:
                sizes = [nbytes(t, step) for t in step.inputs + step.outputs]
                if any(size is None for size in sizes):
                    return
                held += sum(sizes)
        if any(size is None for size in kept.values()):
            return
        last = self.output_structure is not None
        self.kept_bytes, self.held_bytes = (None if last else sum(kept.values())), held

    def _weight_bytes(self) -> int:
        """The bytes of the stage's trainable weights (what writing their gradients costs once)."""
        return sum(map(variable_nbytes, self.trainable_variables))

    def _parts(self, kept, step_grads):
        """(inputs, output gradients) of each weighted step that got a gradient: what ``W`` needs."""
        return [(kept[k], step_grads[k]) if step_grads[k] is not None else None for k in self._weighted]

    def _first_head_step(self) -> int:
        """Last stage: the first step that writes a model output (it and every later one replay with the loss)."""
        if self.output_structure is None:
            return len(self.steps)
        outputs = set(self.stage.outputs[self.num_sends :])
        positions = [k for k, step in enumerate(self.steps) if outputs & set(step.outputs)]
        return min(positions) if positions else len(self.steps)

    def _random_state(self) -> list:
        return [tf.identity(v) for v in self._generator_states]

    def _rerun_backward(self, rerun: _Rerun, grads, activity_scale: float):
        """``B`` of a recomputed micro-batch, one compiled program: its forward again, then its backward.

        The forward reruns with the random state it first had (the same
        dropout masks); every other variable a forward may update (batch
        norm's moving statistics) is put back, so the rerun leaves no trace.
        The weight gradients go into the accumulators inside the program, so
        none is materialized beside them.
        """
        generators, others = self._generator_states, self._forward_updates

        def rerun_backward(inputs, args, states, grads, activity_scale, first):
            now = [tf.identity(v) for v in generators]
            before = [tf.identity(v) for v in others]
            for variable, value in zip(generators, states):
                variable.assign(value)
            sources_in = self._gradient_sources(inputs)
            with tf.GradientTape() as tape:
                tape.watch(sources_in)
                self._watch_weights(tape)
                outputs = rerun.differentiated(rerun.program.python(inputs, *args))
            all_grads = tape.gradient(
                outputs, sources_in + self.trainable_variables, output_gradients=list(grads) + [activity_scale]
            )
            for variable, value in zip(generators + others, now + before):
                variable.assign(value)
            dx = [tf.zeros_like(t) if g is None else g for g, t in zip(all_grads, sources_in)]
            return dx, self.gradients.add_in_graph(all_grads[len(sources_in) :], first)

        first = self.gradients.prepare()
        dx, sparse = self._program(("rerun_backward", id(rerun.program)), rerun_backward, random=True)(
            rerun.inputs, rerun.args, rerun.states, list(grads), tf.constant(activity_scale, tf.float32), first
        )
        self.gradients.added(sparse)
        return dx if self.gradient_inputs else None


class _Rerun(NamedTuple):
    """What a recomputed micro-batch keeps until its backward: its inputs and the random generators' state.

    Its forward runs again as ``program(inputs, *args)``; ``differentiated`` picks the outputs the backward seeds.
    """

    inputs: object
    states: list
    program: object
    args: tuple
    differentiated: object


def _filled(dx, inputs, compute) -> list:
    """Input gradients with zeros where nothing in the stage read an input."""
    like = dict(zip(compute.stage.inputs, inputs))
    return [_zeros_like(like[t]) if g is None else g for g, t in zip(dx, compute.gradient_inputs)]


def _filled_from_kept(dx, kept, compute) -> list:
    like = {}
    for step, step_inputs in zip(compute.steps, kept):
        like.update(zip(step.inputs, step_inputs))
    return [_zeros_like(like[t]) if g is None else g for g, t in zip(dx, compute.gradient_inputs)]


def unbatched_spec(value):
    """The type of a micro-batch's input without its batch size (a tensor, a sparse one, a masked one)."""
    if value is None:  # (an optional input not given)
        return None
    if isinstance(value, Masked):
        return Masked(unbatched_spec(value.tensor), unbatched_spec(value.mask))
    if isinstance(value, tf.SparseTensor):
        return tf.SparseTensorSpec([None] + list(value.shape[1:]), value.dtype)
    if isinstance(value, tf.RaggedTensor):
        return tf.RaggedTensorSpec([None] + list(value.shape[1:]), value.dtype, value.ragged_rank)
    value = tf.convert_to_tensor(value)
    return tf.TensorSpec([None] + list(value.shape[1:]) if value.shape.rank else [], value.dtype)


def _distinct_bytes(tensors) -> int:
    """The bytes of ``tensors``, each once (a program returns a tensor once, as one object: see ``programs``)."""
    sizes = {}
    for value in tensors:
        value = value.tensor if isinstance(value, Masked) else value
        if isinstance(value, (tf.IndexedSlices, tf.SparseTensor)):
            value = value.values
        if value is not None:
            sizes[id(value)] = int(value.shape.num_elements() or 0) * value.dtype.size
    return sum(sizes.values())


def _zeros_like(value):
    return tf.zeros_like(value.tensor if isinstance(value, Masked) else value)
