"""Internal: a stage's backward — split (``I`` then a batched ``W``) or recorded — and what it holds meanwhile.

:class:`StageBackward` is the backward of one stage's compute
(:class:`~keras_pipe.stage.compute.StageCompute` holds one, made again
whenever what trains or what splits changes); everything it reads is given
to its constructor:

- **split** (every node replayable, :mod:`keras_pipe.stage.replay`): ``F`` keeps
  each step's inputs (:meth:`StageBackward.keep`), ``I`` computes the input
  gradients alone and holds each weighted step's inputs and output gradients
  until ``W`` (:mod:`keras_pipe.stage.update`) computes the weight gradients of
  many micro-batches in one pass (:meth:`StageBackward.take_held`). What a
  micro-batch holds in flight and for its ``W`` is estimated from the graph's
  shapes, or measured on the first one, so that the schedule can bound it
  (:func:`keras_pipe.schedules.schedule.hold_for`);
- **recorded** (any other stage): ``F`` runs under an eager
  ``tf.GradientTape`` that records the compiled forward as one op
  (:meth:`StageBackward.record`), and ``B`` runs TensorFlow's gradient of it,
  keeping the activations the forward kept; weight gradients are added to the
  :class:`~keras_pipe.stage.gradients.GradientSum`. With recomputation the
  forward keeps only its input and ``B`` reruns it (:class:`_Rerun`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import tensorflow as tf

from keras_pipe.stage import replay
from keras_pipe.stage.gradients import watch_weights
from keras_pipe.stage.masked import Masked


class Forward(NamedTuple):
    """The pieces of a stage's forward its backward runs again (``StageCompute``'s methods)."""

    run: Callable
    """``(inputs, training, keep=False) -> (values, activity loss, kept step inputs, seeds)``: the nodes."""
    head: Callable
    """``(loss, values, y, sample_weight) -> (term values, divisors)``: last stage, the loss on the outputs."""
    predictions: Callable
    """``values -> [model output]``: last stage, the model outputs (``Masked`` where one carries a mask)."""


class StageBackward:
    """The backward of one stage: split (``I``, then ``W`` of many micro-batches) or recorded (``B``).

    Args:
        forward: the stage's :class:`Forward`.
        stage: the stage's :class:`~keras_pipe.graph.cut.Stage` (``index``, ``inputs``, ``outputs``).
        num_sends: how many of ``stage.outputs`` go to later stages (the rest are model outputs).
        last: whether the stage computes the loss.
        tensors: the graph's tensors (their shapes: :meth:`estimate_holding`).
        split: whether the backward is split (every node replayable); ``steps``: then the replayed steps.
        variables: the weights that train (``compat.trained_weights``).
        gradients: the :class:`~keras_pipe.stage.gradients.GradientSum` the weight gradients go into.
        program: ``(key, function, random=False) -> program``, the stage's compiled programs.
        generators: the random generators' state variables (a recomputed forward draws the same numbers).
        forward_updates: every other variable a forward updates (a recomputed forward puts them back).
    """

    def __init__(
        self,
        forward: Forward,
        stage,
        *,
        num_sends: int,
        last: bool,
        tensors,
        split: bool,
        steps: list,
        variables: list,
        gradients,
        program,
        generators: list,
        forward_updates: list,
    ):
        self.forward = forward
        self.stage = stage
        self.num_sends = num_sends
        self.last = last
        self.tensors = tensors
        self.split = split
        self.steps = steps
        self.variables = variables
        self.gradients = gradients
        self._program = program
        self._generators = generators
        self._forward_updates = forward_updates
        self.gradient_inputs = [c.tensor for c in stage.receives if c.gradient]
        self.gradient_outputs = [c.tensor for c in stage.sends if c.gradient]
        self._weighted = [k for k, step in enumerate(steps) if step.variables]
        self._head_from = self._first_head_step() if split else 0
        self._kept: dict = {}  # micro-batch -> what its backward needs
        self._held: dict = {}  # micro-batch -> (inputs, output gradients) of weighted steps, until its W
        # what one micro-batch holds from its F to its I, and from its I to its W (measured on the first)
        self.kept_bytes: int | None = None
        self.held_bytes: int | None = None

    def forget(self) -> None:
        """Drops what the step's micro-batches kept (after an error, or a replica with no share)."""
        self._kept.clear()
        self._held.clear()

    # -- what the forward keeps ---------------------------------------------------

    def keep(self, i: int, kept, seeds) -> None:
        """Split: keeps micro-batch ``i``'s steps' inputs and seeds for its ``I``; the first one's size is measured."""
        self._kept[i] = (kept, seeds)
        if self.kept_bytes is None:
            self.kept_bytes = _distinct_bytes(t for step_inputs in kept for t in step_inputs)

    def record(self, i: int, program, inputs, args: tuple, recompute: bool, differentiated):
        """Runs ``program(inputs, *args)`` for a recorded backward: under a tape, or keeping only its input.

        ``differentiated(outputs)`` picks the outputs the backward seeds.
        """
        if recompute:
            self._kept[i] = _Rerun(inputs, self._random_state(), program, args, differentiated)
            return program(inputs, *args)
        tape = tf.GradientTape()
        with tape:
            tape.watch(self._gradient_sources(inputs))
            watch_weights(tape, self.variables)
            outputs = program(inputs, *args)
        self._kept[i] = (tape, inputs, differentiated(outputs))
        return outputs

    def take_held(self, microbatches) -> list:
        """What ``W`` of ``microbatches`` needs: each one's weighted steps' (inputs, output gradients), let go here."""
        return [self._held.pop(i) for i in microbatches]

    def _gradient_sources(self, inputs) -> list:
        """The input tensors whose gradients go back to earlier stages."""
        sources = []
        for t, value in zip(self.stage.inputs, inputs):
            if t in self.gradient_inputs:
                sources.append(value.tensor if isinstance(value, Masked) else value)
        return sources

    # -- backward -----------------------------------------------------------

    def forward_backward(self, i: int, loss, inputs, y, sample_weight, coefficients):
        """Last stage, ``FB`` or ``FI``: ``(weighted loss, term values, predictions, input gradients)``."""
        if self.split:

            def forward_input(inputs, y, sample_weight, coefficients):
                values, activity, kept, seeds = self.forward.run(inputs, True, keep=True)
                terms_out = []

                def head(values):
                    terms, _ = self.forward.head(loss, values, y, sample_weight)
                    terms_out.append(terms)
                    return tf.reduce_sum(terms * coefficients[:-1])

                dx, step_grads = replay.input_gradient(
                    self.steps,
                    kept,
                    seeds,
                    {},
                    coefficients[-1],
                    wanted=self.gradient_inputs,
                    head=head,
                    head_from=self._head_from,
                    values=values,
                    reads=self.stage.outputs[self.num_sends :],
                )
                terms = terms_out[-1]
                total = tf.reduce_sum(terms * coefficients[:-1]) + activity * coefficients[-1]
                return (
                    total,
                    terms,
                    self.forward.predictions(values),
                    _filled(dx, inputs, self),
                    self._parts(kept, step_grads),
                )

            total, terms, predictions, dx, parts = self._program(
                ("forward_input", id(loss)), forward_input, random=True
            )(list(inputs), y, sample_weight, coefficients)
            self._hold(i, parts)
            return total, terms, predictions, dx

        def forward_backward(inputs, y, sample_weight, coefficients, first):
            sources_in = self._gradient_sources(inputs)
            with tf.GradientTape() as tape:
                tape.watch(sources_in)
                watch_weights(tape, self.variables)
                values, activity, _, _ = self.forward.run(inputs, True)
                terms, _ = self.forward.head(loss, values, y, sample_weight)
                total = tf.reduce_sum(terms * coefficients[:-1]) + activity * coefficients[-1]
            grads = tape.gradient(total, sources_in + self.variables)
            dx = [tf.zeros_like(t) if g is None else g for g, t in zip(grads[: len(sources_in)], sources_in)]
            sparse = self.gradients.add_in_graph(grads[len(sources_in) :], first)
            return total, terms, self.forward.predictions(values), dx, sparse

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
                    self.steps, kept, seeds, outputs, activity_scale, wanted=self.gradient_inputs
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
        sources = sources_in + self.variables
        output_grads = list(grads) + [tf.constant(activity_scale, tf.float32)]
        all_grads = tape.gradient(outputs, sources, output_gradients=output_grads)
        del tape, outputs  # the activations this micro-batch kept
        self.gradients.add(all_grads[len(sources_in) :])  # (None where a weight got no gradient, as in Keras)
        dx = [tf.zeros(s.shape, s.dtype) if g is None else g for g, s in zip(all_grads[: len(sources_in)], sources_in)]
        return dx if self.gradient_inputs else None

    def _hold(self, i: int, parts) -> None:
        """Keeps micro-batch ``i``'s ``parts`` for its ``W``; the first one's size says what holding costs."""
        self._held[i] = parts
        if self.held_bytes is None:
            self.held_bytes = _distinct_bytes(t for part in parts if part is not None for side in part for t in side)

    def estimate_holding(self, rows: int) -> None:
        """What a micro-batch of ``rows`` holds in flight and for its ``W``, from the graph's shapes, if all known.

        The schedule then batches ``W`` from the first step on (else the first
        step runs each ``W`` at once and measures: see :meth:`_hold`).
        """
        if not self.split or self.held_bytes is not None:
            return
        tensors = self.tensors

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
        self.kept_bytes, self.held_bytes = (None if self.last else sum(kept.values())), held

    def _parts(self, kept, step_grads):
        """(inputs, output gradients) of each weighted step that got a gradient: what ``W`` needs."""
        return [(kept[k], step_grads[k]) if step_grads[k] is not None else None for k in self._weighted]

    def _first_head_step(self) -> int:
        """Last stage: the first step that writes a model output (it and every later one replay with the loss)."""
        if not self.last:
            return len(self.steps)
        outputs = set(self.stage.outputs[self.num_sends :])
        positions = [k for k, step in enumerate(self.steps) if outputs & set(step.outputs)]
        return min(positions) if positions else len(self.steps)

    def _random_state(self) -> list:
        return [tf.identity(v) for v in self._generators]

    def _rerun_backward(self, rerun: _Rerun, grads, activity_scale: float):
        """``B`` of a recomputed micro-batch, one compiled program: its forward again, then its backward.

        The forward reruns with the random state it first had (the same
        dropout masks); every other variable a forward may update (batch
        norm's moving statistics) is put back, so the rerun leaves no trace.
        The weight gradients go into the accumulators inside the program, so
        none is materialized beside them.
        """
        generators, others = self._generators, self._forward_updates

        def rerun_backward(inputs, args, states, grads, activity_scale, first):
            now = [tf.identity(v) for v in generators]
            before = [tf.identity(v) for v in others]
            for variable, value in zip(generators, states):
                variable.assign(value)
            sources_in = self._gradient_sources(inputs)
            with tf.GradientTape() as tape:
                tape.watch(sources_in)
                watch_weights(tape, self.variables)
                outputs = rerun.differentiated(rerun.program.python(inputs, *args))
            all_grads = tape.gradient(
                outputs, sources_in + self.variables, output_gradients=list(grads) + [activity_scale]
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


def _filled(dx, inputs, backward: StageBackward) -> list:
    """Input gradients with zeros where nothing in the stage read an input."""
    like = dict(zip(backward.stage.inputs, inputs))
    return [_zeros_like(like[t]) if g is None else g for g, t in zip(dx, backward.gradient_inputs)]


def _filled_from_kept(dx, kept, backward: StageBackward) -> list:
    like = {}
    for step, step_inputs in zip(backward.steps, kept):
        like.update(zip(step.inputs, step_inputs))
    return [_zeros_like(like[t]) if g is None else g for g, t in zip(dx, backward.gradient_inputs)]


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
