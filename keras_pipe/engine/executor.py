"""Internal: walking one stage's schedule for one batch.

The executor takes the stage's lowered list of actions (:mod:`keras_pipe.schedules.lowering`:
the schedule's computations with its sends and receives as actions of their
own) and runs each through a table of handlers, one a kind: a computation on
the stage's :class:`~keras_pipe.stage.compute.StageCompute`, a message on its
:class:`~keras_pipe.engine.links.Links`. A computing action takes what the
receive before it received and leaves what it computed for the send after
it; no handler does both, and every span goes to the tracer. After the
actions, the :class:`~keras_pipe.engine.step_end.StepEnd` it holds ends the
step: weight regularization, the sums over replicas and over the stages that
hold one weight, the update::

    # 1F1B, 2 stages, 4 micro-batches, lowered (what each rank runs):
    # stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 F3 SEND_F3 RECV_B2 B2 RECV_B3 B3 [update]
    # stage 1: RECV_F0 FB0 SEND_B0 RECV_F1 FB1 SEND_B1 RECV_F2 FB2 SEND_B2 RECV_F3 FB3 SEND_B3 [update]
    # with a split backward, activations small beside the weights (messages left out):
    # stage 0: F0 F1 I0 F2 I1 F3 I2 I3 W0-3 [update]
    # stage 1:    FI0 FI1 FI2 FI3 W0-3 [update]
    # and where they dominate (1F1B's bound: stage s holds P - s micro-batches until their W):
    # stage 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 I3 W2-3 [update]
    # stage 1:    FI0 W0 FI1 W1 FI2 W2 FI3 W3 [update]

The last stage's forwards say what they compute: ``FB``/``FI`` in training,
``FL`` (the loss too) in evaluation, ``FH`` where a loss over the whole
batch sums each micro-batch's terms and divisors; its backwards there are
seeded by ``SEED`` where another stage's receive their gradients.

A rank that holds several virtual stages (:mod:`keras_pipe.engine.chunks`) has one
compute and one set of links a chunk; each action names its chunk, and the
step still ends with one optimizer step (each chunk's last ``W`` updating
its own weights where the optimizer allows, one of them counting the step)::

    # ZB-V on 2 ranks, rank 1 (virtual stages 1 and 2; "@1": chunk 1, the V's way back):
    # RECV_F0 F0 SEND_F0 RECV_F0@1 F0@1 SEND_F0@1 ... RECV_B0@1 I0@1 SEND_B0@1 RECV_B0 I0 SEND_B0 W0@1 ...
    # ... W3@1 [update chunk 1] W3 [update chunk 0, counted]

Example (any compute and links with the same methods will do; the tests
replay schedules with fakes):

>>> executor = Executor(compute, links, reducer=None)          # doctest: +SKIP
>>> result = executor.run(lower(schedule)[stage], batch)         # doctest: +SKIP
"""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.engine.batch import Batch, StepResult
from keras_pipe.engine.chunks import Chunk
from keras_pipe.engine.step_end import StepEnd, StepPlan
from keras_pipe.schedules.actions import Action, Kind


class Executor:
    """Runs a stage's lowered actions for a batch: each a receive, a computation or a send; traced.

    Args:
        compute: the stage's :class:`~keras_pipe.stage.compute.StageCompute`.
        links: its :class:`~keras_pipe.engine.links.Links` (``None`` with one stage).
        reducer: sums gradients over the stage's replicas (``None`` with one replica).
        is_first, is_last: the stage's place in the pipeline.
        status: an object whose ``doing`` attribute stall reports read (the world communicator).
        where: how this rank's place is named in those reports.
        pipeline_sum: sums a float64 vector over the stages of this pipeline (the whole
            model's gradient norm, the loss scale's finiteness check); identity with one stage.
        tied: sums the gradients of weights other stages hold too (``None`` where there are none).
        chunks: where the rank holds several virtual stages (:mod:`keras_pipe.engine.chunks`), each one's
            :class:`~keras_pipe.engine.chunks.Chunk`, in the order of the actions' ``chunk``; they take the
            place of ``compute``, ``links``, ``is_first`` and ``is_last``.
    """

    def __init__(
        self,
        compute,
        links,
        reducer,
        *,
        is_first: bool,
        is_last: bool,
        status,
        where: str,
        pipeline_sum=None,
        tied=None,
        chunks: list | None = None,
    ):
        self.chunks = list(chunks) if chunks else [Chunk(compute, links, is_first, is_last)]
        self.compute, self.links = self.chunks[0].compute, self.chunks[0].links
        self.is_first = any(chunk.is_first for chunk in self.chunks)
        self.is_last = any(chunk.is_last for chunk in self.chunks)
        self.status = status
        self.where = where
        self.tracer = None
        self.step = 0
        pipeline_sum = pipeline_sum or (lambda values: values)
        self.step_end = StepEnd(self.chunks, reducer, tied, pipeline_sum, status, where, self._span)
        self._plan: StepPlan | None = None  # the running step's (its loss scale, which W updates)
        self._handlers = {  # every kind of a lowered list (:mod:`keras_pipe.schedules.lowering`)
            Kind.FORWARD: self._forward,
            Kind.FORWARD_LOSS: self._forward_loss,
            Kind.FORWARD_HEAD: self._forward_head,
            Kind.FORWARD_BACKWARD: self._forward_backward,
            Kind.FORWARD_INPUT: self._forward_backward,
            Kind.BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward,
            Kind.BACKWARD_WEIGHT: self._weights,
            Kind.RECV_F: self._receive_activations,
            Kind.SEND_F: self._send_activations,
            Kind.RECV_B: self._receive_gradients,
            Kind.SEND_B: self._send_gradients,
            Kind.SEED: self._seed,
        }
        # What a message action hands a computing one, or takes from it: (chunk, micro-batch) -> tensors.
        self._received: dict = {}  # RECV_F -> the forward's inputs
        self._output_gradients: dict = {}  # RECV_B or SEED -> the backward's output gradients
        self._outputs: dict = {}  # forward -> SEND_F: the activations other stages read
        self._input_gradients: dict = {}  # backward -> SEND_B: the gradients of the stage's inputs

    def run(self, actions: list[Action], batch: Batch) -> StepResult:
        """Runs ``actions`` (lowered: with their messages) on ``batch``, then ends the step (update when training)."""
        terms = 0 if batch.loss is None else batch.loss.size
        result = StepResult(
            predictions=[None] * len(batch.bounds),
            terms=np.zeros(terms),
            sums=np.zeros(terms),
            divisors=np.zeros(terms),
        )
        plan = self._plan = self.step_end.plan(actions, batch, self.step, traced=self.tracer is not None)
        of_chunk = " of chunk {}" if len(self.chunks) > 1 else ""
        doing = f"{batch.phase} step {self.step}, {self.where}: "
        try:
            if batch.phase == "train":
                for chunk in self.chunks:
                    chunk.compute.begin_step()
            for chunk in self.chunks:
                self.step_end.count_regularization(chunk.compute, batch, result, plan, before_actions=True)
            self.status.in_step = True
            for position, action in enumerate(actions):
                self.status.doing = (
                    f"{doing}{_NAMES[action.kind]} of micro-batch {action.microbatch}" + of_chunk.format(action.chunk)
                )
                self._handlers[action.kind](self.chunks[action.chunk], action, position, batch, result)
            self.step_end.finish(batch, result, plan)
            self.status.in_step = False
            if batch.phase == "train":
                for chunk in self.chunks:
                    chunk.compute.end_step()
        except BaseException:
            for chunk in self.chunks:
                chunk.compute.forget_step()
            raise
        finally:
            self.step += 1
            for held in (self._received, self._output_gradients, self._outputs, self._input_gradients):
                held.clear()  # (empty, but for a failed step's, and the first stage's input gradients)
        return result

    # -- the computing actions: what each reads and leaves for the messages ----------------

    def _forward(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        start, stop = batch.bounds[i]
        inputs = self._inputs(chunk, action, batch)
        began = time.perf_counter()
        compute = chunk.compute
        training = batch.phase == "train"
        recompute = training and compute.recomputes(i, len(batch.bounds))
        outputs, activity = compute.forward(i, inputs, training, recompute)
        if batch.phase != "predict":
            result.loss_part += float(activity) * (stop - start) / batch.batch_size
        self._span("forward", i, began)
        if chunk.is_last:  # (predict: the outputs are the predictions)
            result.predictions[i] = outputs
        else:
            self._outputs[(action.chunk, i)] = outputs
        self._progress(chunk)

    def _forward_loss(self, chunk: Chunk, action, position, batch, result):
        """Last stage, evaluation: the forward and the loss of a micro-batch."""
        i = action.microbatch
        inputs = self._inputs(chunk, action, batch)
        began = time.perf_counter()
        total, terms, predictions = chunk.compute.forward_loss(
            batch.loss, inputs, *self._targets(batch, i), self._coefficients(batch, i)
        )
        result.loss_part += float(total)
        result.terms += np.asarray(terms, np.float64) * batch.shares[i]
        result.predictions[i] = predictions
        self._span("forward", i, began)
        self._progress(chunk)

    def _forward_head(self, chunk: Chunk, action, position, batch, result):
        """Last stage, ``whole_batch_loss``: a forward that sums the micro-batch's terms and counts their divisors."""
        i = action.microbatch
        start, stop = batch.bounds[i]
        inputs = self._inputs(chunk, action, batch)
        began = time.perf_counter()
        compute = chunk.compute
        training = batch.phase == "train"
        recompute = training and compute.recomputes(i, len(batch.bounds))
        sums, divisors, predictions, activity = compute.forward_head(
            i, batch.loss, inputs, *self._targets(batch, i), training, recompute
        )
        result.sums += np.asarray(sums, np.float64)
        result.divisors += np.asarray(divisors, np.float64)
        result.loss_part += float(activity) * (stop - start) / batch.batch_size
        result.predictions[i] = predictions
        self._span("forward", i, began)
        self._progress(chunk)

    def _forward_backward(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        inputs = self._inputs(chunk, action, batch)
        began = time.perf_counter()
        scale = self._plan.loss_scale
        coefficients = self._coefficients(batch, i) * scale
        total, terms, predictions, dx = chunk.compute.forward_backward(
            i, batch.loss, inputs, *self._targets(batch, i), coefficients
        )
        result.loss_part += float(total) / scale
        result.terms += np.asarray(terms, np.float64) * batch.shares[i]
        result.predictions[i] = predictions
        self._span("forward+backward", i, began)
        if dx:
            self._input_gradients[(action.chunk, i)] = dx
        self._progress(chunk)

    def _backward(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        start, stop = batch.bounds[i]
        grads = self._output_gradients.pop((action.chunk, i))
        began = time.perf_counter()
        dx = chunk.compute.backward(i, grads, (stop - start) / batch.batch_size * self._plan.loss_scale)
        self._span("backward", i, began)
        if dx:
            self._input_gradients[(action.chunk, i)] = dx
        self._progress(chunk)

    def _weights(self, chunk: Chunk, action, position, batch, result):
        began = time.perf_counter()
        plan = self._plan
        rows = sum(batch.bounds[i][1] - batch.bounds[i][0] for i in action.microbatches)
        final = position == plan.last_weights.get(action.chunk)
        fused = final and action.chunk in plan.fused
        compute = chunk.compute
        compute.weights(
            action.microbatches,
            rows / batch.batch_size * plan.loss_scale,
            regularize=final and batch.regularize,
            loss_scale=plan.loss_scale,
            optimizer=batch.optimizer if fused else None,
            counts=position == plan.counting,
        )
        if self.tracer is not None and compute.trainable_variables:
            compute.trainable_variables[0].numpy()  # wait for it, so that the span shows its cost
        self._span("weights", -1 if len(action.microbatches) > 1 else action.microbatch, began)
        self._progress(chunk)

    # -- the messages, and the last stage's seed ---------------------------------------------

    def _receive_activations(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        start, stop = batch.bounds[i]
        began = time.perf_counter()
        self._received[(action.chunk, i)] = chunk.links.receive_activations(stop - start)
        self._span("receive activation", i, began)

    def _send_activations(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        began = time.perf_counter()
        chunk.links.send_activations(self._outputs.pop((action.chunk, i)))
        self._span("send activation", i, began)

    def _receive_gradients(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        start, stop = batch.bounds[i]
        began = time.perf_counter()
        self._output_gradients[(action.chunk, i)] = chunk.links.receive_gradients(stop - start)
        self._span("receive gradient", i, began)

    def _send_gradients(self, chunk: Chunk, action, position, batch, result):
        i = action.microbatch
        dx = self._input_gradients.pop((action.chunk, i), None)
        if not dx:  # (the stage reads no floating-point tensor of another: no gradient goes back)
            return
        began = time.perf_counter()
        chunk.links.send_gradients(dx)
        self._span("send gradient", i, began)

    def _seed(self, chunk: Chunk, action, position, batch, result):
        """Last stage, ``whole_batch_loss``: each term's seed, its weight over the whole batch's divisor."""
        i = action.microbatch
        began = time.perf_counter()
        divisors = self.step_end.batch_divisors(batch, result, self.step)
        seeds = np.where(divisors > 0, np.asarray(batch.term_weights) / np.where(divisors > 0, divisors, 1), 0.0)
        self._output_gradients[(action.chunk, i)] = [tf.constant(seeds * self._plan.loss_scale, tf.float32)]
        self._span("receive gradient", i, began)

    # -- helpers -------------------------------------------------------------------

    def _inputs(self, chunk: Chunk, action: Action, batch: Batch) -> list:
        """A forward's inputs: the model's (first stage), or what its ``RECV_F`` received."""
        if not chunk.is_first:
            return self._received.pop((action.chunk, action.microbatch))
        start, stop = batch.bounds[action.microbatch]
        if (start, stop) == (0, batch.batch_size):
            return list(batch.x)
        start, stop = start - batch.x_first, stop - batch.x_first  # (x: this replica's rows alone, if it read them)
        return [rows(x, start, stop) for x in batch.x]

    @staticmethod
    def _progress(chunk: Chunk) -> None:
        """Lets MPI move this rank's pending sends along, after a computation."""
        if chunk.links is not None:
            chunk.links.progress()

    def _targets(self, batch: Batch, i: int):
        start, stop = batch.bounds[i]  # the last stage holds the whole global batch's targets
        if (start, stop) == (0, batch.batch_size):
            return batch.y, batch.sample_weight
        return _rows(batch.y, start, stop), _rows(batch.sample_weight, start, stop)

    def _coefficients(self, batch: Batch, i: int) -> tf.Tensor:
        """Each loss term's weight in micro-batch ``i``'s share of the batch's loss, then the activity losses'."""
        start, stop = batch.bounds[i]
        terms = np.asarray(batch.shares[i], np.float64) * np.asarray(batch.term_weights, np.float64)
        return tf.constant(np.append(terms, (stop - start) / batch.batch_size), tf.float32)

    def _span(self, name: str, microbatch: int, began: float) -> None:
        if self.tracer is not None:
            self.tracer.span(name, self.step, microbatch, began, time.perf_counter())


_NAMES = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.BACKWARD_INPUT: "input gradient",
    Kind.BACKWARD_WEIGHT: "weight gradients",
    Kind.FORWARD_BACKWARD: "forward and backward",
    Kind.FORWARD_INPUT: "forward and input gradient",
    Kind.FORWARD_LOSS: "forward and loss",
    Kind.FORWARD_HEAD: "forward and loss terms",
    Kind.SEND_F: "sending the activations",
    Kind.RECV_F: "receiving the activations",
    Kind.SEND_B: "sending the input gradients",
    Kind.RECV_B: "receiving the output gradients",
    Kind.SEED: "seeding the backward (the whole batch counted)",
}


def _rows(value, start: int, stop: int):
    """Rows ``start:stop`` of every array of a structure (labels, sample weights), ``None`` kept."""
    if value is None:
        return None
    return keras.tree.map_structure(lambda a: rows(a, start, stop), value)


def rows(value, start: int, stop: int):
    """Rows ``start:stop`` of an array or tensor, a ``tf.SparseTensor``'s too; ``None`` (an optional input) kept."""
    if value is None:
        return None
    if isinstance(value, tf.SparseTensor):
        size = tf.concat([[stop - start], tf.shape(value, out_type=tf.int64)[1:]], 0)
        begin = tf.concat([[start], tf.zeros_like(size[1:])], 0)
        return tf.sparse.slice(value, begin, size)
    return value[start:stop]
