"""One rank's stage: compiled per-micro-batch compute, driven through a schedule.

The step is driven from Python around compiled TensorFlow functions, one
call per micro-batch and pass. A forward pass runs under an eager
``tf.GradientTape`` that records the compiled call as a single op; its
backward later runs TensorFlow's compiled gradient of that function, reusing
the activations the forward kept (no recomputation). Between compute calls
the stage sends and receives raw buffers through :class:`Communicator`,
so communication never sits inside a graph and a plain mpi4py call runs on
every step, not once at trace time.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from keras_pipe import schedule as schedules
from keras_pipe.comm import TAG_ACTIVATION, TAG_GRADIENT, TAG_TARGETS, Communicator, aligned_empty
from keras_pipe.errors import RankMismatchError
from keras_pipe.microbatch import microbatch_bounds


class Stage:
    """The layers one rank owns and the compiled functions that run them.

    Args:
        layers: this stage's layers, built.
        index: the stage number (= rank).
        num_stages: how many stages the pipeline has.
        input_spec: ``(shape, dtype)`` of the stage input, batch dimension ``None``.
        output_spec: ``(shape, dtype)`` of the stage output.
        comm: the pipeline's communicator (rank = stage index).
        replicas: the communicator of this stage's replicas (rank = replica
            index), over which gradients are summed before each update;
            ``None`` with one replica.
    """

    def __init__(
        self,
        layers,
        index,
        num_stages,
        input_spec,
        output_spec,
        comm: Communicator,
        replicas: Communicator | None = None,
    ):
        self.layers = list(layers)
        self.index = index
        self.num_stages = num_stages
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.comm = comm
        self.replicas = replicas
        self.replica_index = replicas.rank if replicas is not None else 0
        # How stall reports name this rank's place.
        self.where = f"stage {index}" + (f" of replica {self.replica_index}" if replicas is not None else "")
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.trainable_variables = [v for layer in self.layers for v in layer.trainable_weights]
        self._has_weight_regularizers = any(v.regularizer is not None for v in self.trainable_variables)
        self._functions: dict = {}
        self.step = 0
        # A list to append (name, microbatch, start, end) spans to while a
        # timeline is recorded; None otherwise, so recording costs nothing.
        self.recorder: list | None = None
        self.eager = False  # compile(run_eagerly=True): run everything op by op
        self.loss_reduction = None  # the compiled loss's reduction (None: Keras' sum_over_batch_size)

    def _span(self, name: str, microbatch: int, start: float) -> None:
        if self.recorder is not None:
            self.recorder.append((name, self.step, microbatch, start, time.perf_counter()))

    # -- compiled pieces ------------------------------------------------

    def _run_layers(self, x, training):
        activity = tf.constant(0.0, tf.float32)
        for layer in self.layers:
            x = layer(x, training=training)
            for sub in layer._flatten_layers():
                for loss in sub._get_own_losses():
                    activity += tf.cast(tf.reduce_sum(loss), tf.float32)
        return x, activity

    def _input_signature(self):
        shape, dtype = self.input_spec
        return tf.TensorSpec((None,) + tuple(shape[1:]), dtype)

    def forward_fn(self, training: bool):
        """``x -> (y, activity_loss)`` for a first or middle stage (or predict), compiled once."""
        key = ("forward", training)

        def forward(x):
            return self._run_layers(x, training)

        if self.eager:
            return forward
        if key not in self._functions:
            self._functions[key] = tf.function(forward, input_signature=[self._input_signature()])
        return self._functions[key]

    def _microbatch_loss(self, model, x, y, sample_weight, scales, training):
        """This micro-batch's share of the batch loss, and its predictions.

        ``scales = (data, activity)`` turn the micro-batch's loss into its
        share of the batch's: Keras normalises activity regularization by the
        batch size (share ``n_i / B``) and the data loss as its reduction says
        (see ``_loss_scales``).
        """
        y_pred, activity = self._run_layers(x, training)
        loss = model._compile_loss(y, y_pred, sample_weight)
        return tf.cast(loss, tf.float32) * scales[0] + activity * scales[1], y_pred

    def evaluate_loss_fn(self, model):
        """Last stage, evaluation: ``(x, y, sample_weight, scales) -> (loss share, y_pred)``."""

        def evaluate_loss(x, y, sample_weight, scales):
            return self._microbatch_loss(model, x, y, sample_weight, scales, training=False)

        return self._compiled("evaluate_loss", evaluate_loss, reduce_retracing=True)

    def fused_step_fn(self, model):
        """Last stage, forward and backward of one micro-batch in one graph.

        ``(x, y, sample_weight, scales, first) -> (loss share, y_pred, input
        gradient)``, adding the weight gradients to the accumulators (or
        setting them, for the ``first`` micro-batch). The last stage runs each
        micro-batch's backward right after its forward, so fusing them saves
        keeping activations across calls, and accumulating in the same graph
        saves a pass over the gradients.
        """

        def fused(x, y, sample_weight, scales, first):
            with tf.GradientTape() as tape:
                if not self.is_first:
                    tape.watch(x)
                loss, y_pred = self._microbatch_loss(model, x, y, sample_weight, scales, True)
            sources = ([] if self.is_first else [x]) + self.trainable_variables
            grads = _zeros_for_none(tape.gradient(loss, sources), sources)
            input_grad = grads.pop(0) if not self.is_first else tf.zeros((0,))
            self._add_to_accumulators(grads, first)
            return loss, y_pred, input_grad

        return self._compiled("fused", fused, reduce_retracing=True)

    def _compiled(self, key, python_fn, **kwargs):
        if self.eager:
            return python_fn
        if key not in self._functions:
            self._functions[key] = tf.function(python_fn, **kwargs)
        return self._functions[key]

    def _regularization_loss(self):
        loss = tf.constant(0.0, tf.float32)
        for layer in self.layers:
            for term in layer._get_regularization_losses():
                loss += tf.cast(term, tf.float32)
        return loss

    def weight_regularization(self):
        """The loss of this stage's weight regularizers (counted once per batch, as Keras does)."""
        return self._compiled("regularization", self._regularization_loss)()

    def weight_regularization_and_gradients(self):
        """``(loss, gradients)`` of this stage's weight regularizers."""

        def regularization():
            with tf.GradientTape() as tape:
                loss = self._regularization_loss()
            return loss, _zeros_for_none(tape.gradient(loss, self.trainable_variables), self.trainable_variables)

        return self._compiled("regularization_gradients", regularization)()

    def _add_to_accumulators(self, grads, first: bool):
        # In place, in a fixed order (g0, then + g1, + g2, ...): both schedules
        # sum identically, and no second copy of the gradients is ever alive.
        for accumulator, grad in zip(self._accumulators(), grads):
            if first:
                accumulator.assign(tf.cast(grad, accumulator.dtype))
            else:
                accumulator.assign_add(tf.cast(grad, accumulator.dtype))

    def _accumulators(self) -> list:
        """One variable per trainable weight that sums its gradient over a batch's micro-batches."""
        if getattr(self, "_accumulator_variables", None) is None:
            with tf.init_scope():  # created eagerly, even on a first call inside tf.function
                self._accumulator_variables = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="gradient_sum")
                    for v in self.trainable_variables
                ]
        return self._accumulator_variables

    def accumulate(self, grads, first: bool) -> None:
        """Adds weight gradients computed outside a graph to the accumulators."""
        self._accumulators()
        self._compiled(("accumulate", first), lambda grads: self._add_to_accumulators(grads, first))(grads)

    def update_metrics(self, compile_metrics, y, y_pred, sample_weight):
        """Last stage: updates the compiled metrics once with the whole batch, as ``Sequential`` does."""

        def update(y, y_pred, sample_weight):
            compile_metrics.update_state(y, y_pred, sample_weight)

        self._compiled(("metrics", id(compile_metrics)), update, reduce_retracing=True)(y, y_pred, sample_weight)

    def reset_functions(self):
        """Forgets the compiled functions (after ``compile()`` changed the loss, metrics or optimizer)."""
        self._functions.clear()

    def apply_gradients(self, optimizer, grads=None):
        """One optimizer step on this stage's weights, XLA-compiled where the optimizer allows.

        The update is memory-bound element-wise work over every weight; XLA
        fuses it into few passes (Adam runs about twice as fast on CPU) and
        it never touches communication, so it is always safe to compile.
        ``grads`` (arrays summed over the replicas) replace the accumulators:
        handed to the compiled update as they are, they are read once, in
        the fused update, instead of being copied back first.
        """
        if not self.trainable_variables:
            return

        def apply(*given):
            summed = given or [accumulator.read_value() for accumulator in self._accumulators()]
            optimizer.apply(list(summed), self.trainable_variables)

        arguments = () if grads is None else tuple(grads)
        key = ("apply", id(optimizer), grads is None)
        if self.eager:
            return apply(*arguments)
        if key not in self._functions:
            self._functions[key] = tf.function(apply, jit_compile=True)
            try:
                self._functions[key](*arguments)
                return
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, NotImplementedError):
                self._functions[key] = tf.function(apply)  # an optimizer XLA cannot compile
        self._functions[key](*arguments)

    # -- one batch ------------------------------------------------------

    def run_batch(
        self, model, x, targets, batch_size, num_microbatches, schedule_name, training, with_loss=True, rows=None
    ):
        """Runs one batch through this stage following the schedule.

        Args:
            model: the ``PipelineModel`` (for the compiled loss and optimizer).
            x: the batch input (used by the first stage only).
            targets: ``(y, sample_weight)`` as numpy arrays or ``None`` (used by the last stage).
            batch_size: the number of samples in the batch.
            num_microbatches: the requested number of micro-batches.
            schedule_name: ``"1f1b"``/``"gpipe"`` when training, ignored otherwise.
            training: run backward passes and accumulate gradients.
            with_loss: compute this stage's loss share (``False`` for predict).
            rows: ``(start, stop)``, this replica's share of the batch (all of it by default).

        Returns:
            ``(loss_part, y_pred)``: this stage's share of the batch loss (data loss
            on the last stage, regularization everywhere) and, on the last stage,
            the predictions of this replica's share of the batch.
        """
        first_row, last_row = rows if rows is not None else (0, batch_size)
        bounds = (
            [(first_row + a, first_row + b) for a, b in microbatch_bounds(last_row - first_row, num_microbatches)]
            if last_row > first_row
            else []  # a replica with no share of a batch smaller than the number of replicas
        )
        m = len(bounds)
        if m == 0:
            actions = []
        elif training:
            actions = schedules.make_schedule(schedule_name, self.num_stages, m)[self.index]
        else:
            actions = schedules.forward_only(self.num_stages, m)[self.index]
        y, sample_weight = targets if targets is not None else (None, None)
        phase = "train" if training else ("test" if with_loss else "predict")
        with_targets = self.is_last and targets is not None
        if training and not with_targets and self.is_last:
            raise ValueError("training needs targets on the last stage; fit() was given no y")

        loss_part = 0.0
        predictions = [None] * m
        saved: dict[int, tuple] = {}  # micro-batch -> (tape, input, outputs) between its F and B
        accumulated = False  # whether the accumulators hold this batch's gradients yet
        position = 0
        while position < len(actions):
            action = actions[position]
            i = action.microbatch
            start, stop = bounds[i]
            scale = (stop - start) / batch_size
            pass_name = "forward" if action.kind == "F" else "backward"
            self.comm.activity = f"{phase} step {self.step}, {self.where}: {pass_name} of micro-batch {i}"
            if action.kind == schedules.FORWARD:
                inputs = self._stage_input(x, i, start, stop)
                began = time.perf_counter()
                if with_targets:
                    targets_i = (y[start:stop], None if sample_weight is None else sample_weight[start:stop])
                if training and with_targets:
                    # The last stage's B_i follows its F_i (see keras_pipe.schedule): one graph for both.
                    assert actions[position + 1] == schedules.Action(schedules.BACKWARD, i), actions
                    self._accumulators()  # created eagerly, before the graph that adds to them is traced
                    loss, y_pred, input_grad = self.fused_step_fn(model)(
                        inputs, *targets_i, self._loss_scales(sample_weight, start, stop, batch_size), not accumulated
                    )
                    accumulated = True
                    loss_part += float(loss)
                    predictions[i] = y_pred
                    self._span("forward+backward", i, began)
                    if not self.is_first:
                        self._send_gradient(input_grad, i)
                    position += 2
                    continue
                tape = tf.GradientTape() if training else None
                if tape is not None:
                    tape.__enter__()
                    if not self.is_first:
                        tape.watch(inputs)
                try:
                    if with_targets:
                        scales = self._loss_scales(sample_weight, start, stop, batch_size)
                        out, y_pred = self.evaluate_loss_fn(model)(inputs, *targets_i, scales)
                        loss_part += float(out)
                        predictions[i] = y_pred
                    else:
                        out, activity = self.forward_fn(training)(inputs)
                        loss_part += float(activity) * scale
                        if self.is_last:
                            predictions[i] = out
                finally:
                    if tape is not None:
                        tape.__exit__(None, None, None)
                self._span("forward", i, began)
                if not self.is_last:
                    began = time.perf_counter()
                    self.comm.send(out.numpy(), self.index + 1, TAG_ACTIVATION)
                    self._span("send activation", i, began)
                if tape is not None:
                    saved[i] = (tape, inputs, [out, activity])
            else:
                tape, inputs, outputs = saved.pop(i)
                began = time.perf_counter()
                upstream = self._receive(self.index + 1, TAG_GRADIENT, self.output_spec, stop - start)
                self._span("receive gradient", i, began)
                began = time.perf_counter()
                sources = ([] if self.is_first else [inputs]) + self.trainable_variables
                output_grads = [upstream, tf.constant(scale, tf.float32)]
                grads = _zeros_for_none(tape.gradient(outputs, sources, output_gradients=output_grads), sources)
                if not self.is_first:
                    input_grad = grads.pop(0)
                    input_grad.numpy()
                    self._span("backward", i, began)
                    self._send_gradient(input_grad, i)
                    began = time.perf_counter()
                self.accumulate(grads, first=not accumulated)
                accumulated = True
                # Drop the tape (which holds this micro-batch's activations and
                # reads of the weights) and the gradients now: alive during the
                # optimizer update they would double this stage's memory.
                del tape, outputs, grads
                if self.recorder is not None and self.trainable_variables:
                    self._accumulators()[0].numpy()  # wait for the weight gradients, so the span shows their cost
                self._span("backward", i, began)
            self.comm.progress()
            position += 1

        if self._has_weight_regularizers and with_loss and self.replica_index == 0:
            # Counted once per batch: by the first replica (the others' share is 0).
            if training:
                reg_loss, reg_grads = self.weight_regularization_and_gradients()
                self.accumulate(reg_grads, first=not accumulated)
                accumulated = True
            else:
                reg_loss = self.weight_regularization()
            loss_part += float(reg_loss)
        if training and self.replicas is not None and self.trainable_variables:
            if not accumulated:  # no share of this batch: contribute zeros
                self.accumulate([tf.zeros(v.shape, v.dtype) for v in self.trainable_variables], first=True)
                accumulated = True
            summed = self.sum_over_replicas()
        else:
            summed = None
        if training and accumulated:
            self.comm.activity = f"train step {self.step}, {self.where}: optimizer update"
            began = time.perf_counter()
            self.apply_gradients(model.optimizer, summed)
            del summed
            if self.recorder is not None:
                self.trainable_variables[0].numpy()
            self._span("optimizer", -1, began)
        self.step += 1
        y_pred = None
        if self.is_last:
            shape, dtype = self.output_spec
            y_pred = tf.concat(predictions, axis=0) if predictions else tf.zeros((0,) + tuple(shape[1:]), dtype)
        return loss_part, y_pred

    def sum_over_replicas(self) -> list:
        """This stage's gradients summed over its replicas, as tensors in weight order.

        Every replica scaled its micro-batches' losses by their share of the
        global batch, so the sum is the global batch's gradient, as
        ``Sequential`` computes it. Called as soon as this stage's last
        backward is done: the last stage reduces while the stages before it
        still run their final backwards. No copies are made on the way: MPI
        reads each accumulator's memory through a read-only view and writes
        the sums into 64-byte-aligned buffers (kept from step to step) that
        TensorFlow then reads as tensors without copying (DLPack). The last
        layers' all-reduces start first.
        """
        self.comm.activity = f"train step {self.step}, {self.where}: summing gradients over replicas"
        began = time.perf_counter()
        accumulators = self._accumulators()
        if getattr(self, "_summed_buffers", None) is None:
            self._summed_buffers = [aligned_empty(a.shape, a.dtype.as_numpy_dtype) for a in accumulators]
        sources = [_host_view(a) for a in reversed(accumulators)]
        requests = self.replicas.start_allreduce_sum(sources, self._summed_buffers[::-1])
        self.replicas.wait_all(requests, "the other replicas of this stage (gradient allreduce)")
        del sources
        self._span("allreduce", -1, began)
        return [tf.experimental.dlpack.from_dlpack(buffer.__dlpack__()) for buffer in self._summed_buffers]

    def _loss_scales(self, sample_weight, start, stop, batch_size):
        """``(data, activity)`` weights of micro-batch ``[start, stop)`` in the batch's loss."""
        share = (stop - start) / batch_size
        if self.loss_reduction == "sum":
            data = 1.0
        elif self.loss_reduction == "mean_with_sample_weight" and sample_weight is not None:
            total = float(np.sum(sample_weight))
            data = float(np.sum(sample_weight[start:stop])) / total if total else 0.0
        else:
            data = share
        return tf.constant([data, share], tf.float32)

    def _stage_input(self, x, i, start, stop):
        """Micro-batch ``i``'s input: a slice of the batch on the first stage, else from the previous rank."""
        if self.is_first:
            return x[start:stop]
        began = time.perf_counter()
        inputs = self._receive(self.index - 1, TAG_ACTIVATION, self.input_spec, stop - start)
        self._span("receive activation", i, began)
        return inputs

    def _send_gradient(self, input_grad, i):
        began = time.perf_counter()
        self.comm.send(input_grad.numpy(), self.index - 1, TAG_GRADIENT)
        self._span("send gradient", i, began)

    def _receive(self, source, tag, spec, rows):
        shape, dtype = spec
        array = self.comm.recv(source, tag, tuple(shape[1:]), tf.as_dtype(dtype).as_numpy_dtype)
        if array.shape[0] != rows:
            raise RankMismatchError(
                f"rank {self.comm.world_rank} expected a micro-batch of {rows} samples from rank "
                f"{self.comm.world_rank_of(source)} but got "
                f"{array.shape[0]}: the ranks were given batches of different sizes. Give every rank the same "
                "data sizes and batch_size."
            )
        return tf.convert_to_tensor(array)

    # -- targets --------------------------------------------------------

    def send_targets(self, y, sample_weight) -> None:
        """First stage: labels and sample weights go straight to the last stage."""
        if y is not None:
            self.comm.send(np.asarray(y), self.num_stages - 1, TAG_TARGETS)
        if sample_weight is not None:
            self.comm.send(np.asarray(sample_weight), self.num_stages - 1, TAG_TARGETS)

    def receive_targets(self, y_like, sample_weight_like, batch_size):
        """Last stage: the labels and sample weights the first stage paired with its inputs."""
        received = []
        for like in (y_like, sample_weight_like):
            if like is None:
                received.append(None)
                continue
            like = np.asarray(like)
            array = self.comm.recv(0, TAG_TARGETS, like.shape[1:], like.dtype)
            if array.shape[0] != batch_size:
                raise RankMismatchError(
                    f"rank {self.comm.world_rank} has a batch of {batch_size} samples but rank "
                    f"{self.comm.world_rank_of(0)} sent targets for "
                    f"{array.shape[0]}: the ranks were given different data. Give every rank the same data "
                    "sizes and batch_size."
                )
            received.append(array)
        return tuple(received)


def _host_view(variable) -> np.ndarray:
    """A read-only numpy view of a variable in host memory, or a copy where it lives on a device."""
    value = variable.read_value()
    try:
        return np.from_dlpack(value)
    except (BufferError, TypeError, RuntimeError, ValueError):  # an accelerator's memory: copy to the host
        return value.numpy()


def _zeros_for_none(grads, sources):
    """Zeros where a source does not affect the target (a frozen path, an unused weight)."""
    return [tf.zeros(s.shape, s.dtype) if g is None else g for g, s in zip(grads, sources)]
