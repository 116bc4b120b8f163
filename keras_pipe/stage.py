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

import numpy as np
import tensorflow as tf

from keras_pipe import schedule as schedules
from keras_pipe.comm import TAG_ACTIVATION, TAG_GRADIENT, TAG_TARGETS, Communicator
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
        comm: the communicator.
    """

    def __init__(self, layers, index, num_stages, input_spec, output_spec, comm: Communicator):
        self.layers = list(layers)
        self.index = index
        self.num_stages = num_stages
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.comm = comm
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.trainable_variables = [v for layer in self.layers for v in layer.trainable_weights]
        self._has_weight_regularizers = any(v.regularizer is not None for v in self.trainable_variables)
        self._functions: dict = {}
        self.step = 0

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
        """``x -> (y, activity_loss)`` for a middle or first stage, compiled once."""
        key = ("forward", training)
        if key not in self._functions:

            def forward(x):
                return self._run_layers(x, training)

            self._functions[key] = tf.function(forward, input_signature=[self._input_signature()])
        return self._functions[key]

    def forward_loss_fn(self, model, training: bool, target_specs):
        """Last stage: ``(x, y, sample_weight, scale) -> (scale * (loss + activity), y_pred, activity)``.

        Keras normalises the data loss and activity regularization by the
        batch size; ``scale = microbatch_size / batch_size`` turns each
        micro-batch's mean into its share of the batch mean.
        """
        key = ("forward_loss", training, target_specs)
        if key not in self._functions:
            y_spec, sw_spec = target_specs

            def forward_loss(x, y, sample_weight, scale):
                y_pred, activity = self._run_layers(x, training)
                loss = model._compile_loss(y, y_pred, sample_weight)
                loss = (tf.cast(loss, tf.float32) + activity) * scale
                return loss, y_pred, activity

            signature = [
                self._input_signature(),
                tf.TensorSpec(*y_spec),
                tf.TensorSpec(*sw_spec) if sw_spec else None,
                tf.TensorSpec((), tf.float32),
            ]
            if sw_spec is None:
                fn = tf.function(
                    lambda x, y, s: forward_loss(x, y, None, s),
                    input_signature=[signature[0], signature[1], signature[3]],
                )
                self._functions[key] = lambda x, y, sw, s: fn(x, y, s)
            else:
                self._functions[key] = tf.function(forward_loss, input_signature=signature)
        return self._functions[key]

    def _compiled(self, key, python_fn, **kwargs):
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

    def _accumulate(self, total, grads):
        def add(total, grads):
            return [t + g for t, g in zip(total, grads)]

        return self._compiled("accumulate", add)(total, grads)

    def update_metrics(self, compile_metrics, y, y_pred, sample_weight):
        """Last stage: updates the compiled metrics once with the whole batch, as ``Sequential`` does."""

        def update(y, y_pred, sample_weight):
            compile_metrics.update_state(y, y_pred, sample_weight)

        self._compiled(("metrics", id(compile_metrics)), update, reduce_retracing=True)(y, y_pred, sample_weight)

    def reset_functions(self):
        """Forgets the compiled functions (after ``compile()`` changed the loss, metrics or optimizer)."""
        self._functions.clear()

    def apply_gradients(self, optimizer, grads):
        if not self.trainable_variables:
            return

        def apply(grads):
            optimizer.apply(grads, self.trainable_variables)

        self._compiled(("apply", id(optimizer)), apply)(grads)

    # -- one batch ------------------------------------------------------

    def run_batch(self, model, x, targets, batch_size, num_microbatches, schedule_name, training, with_loss=True):
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

        Returns:
            ``(loss_part, y_pred)``: this stage's share of the batch loss (data loss
            on the last stage, regularization everywhere) and, on the last stage,
            the predictions of the whole batch.
        """
        bounds = microbatch_bounds(batch_size, num_microbatches)
        m = len(bounds)
        if training:
            actions = schedules.make_schedule(schedule_name, self.num_stages, m)[self.index]
        else:
            actions = schedules.forward_only(self.num_stages, m)[self.index]

        y = sample_weight = None
        forward_loss = None
        if self.is_last and targets is not None:
            y, sample_weight = targets
            target_specs = (
                ((None,) + tuple(y.shape[1:]), tf.as_dtype(y.dtype)),
                ((None,) + tuple(sample_weight.shape[1:]), tf.as_dtype(sample_weight.dtype))
                if sample_weight is not None
                else None,
            )
            forward_loss = self.forward_loss_fn(model, training, target_specs)
        forward = None if forward_loss else self.forward_fn(training)

        loss_part = 0.0
        predictions = [None] * m
        tapes: dict[int, tuple] = {}
        grad_total = None
        for action in actions:
            i = action.microbatch
            start, stop = bounds[i]
            scale_value = (stop - start) / batch_size
            self.comm.activity = f"step {self.step}, {'forward' if action.kind == 'F' else 'backward'} micro-batch {i}"
            if action.kind == schedules.FORWARD:
                inputs = (
                    x[start:stop]
                    if self.is_first
                    else self._receive(self.index - 1, TAG_ACTIVATION, self.input_spec, stop - start)
                )
                tape = tf.GradientTape() if training else None
                if tape is not None:
                    tape.__enter__()
                    if not self.is_first:
                        tape.watch(inputs)
                try:
                    if forward_loss is not None:
                        scale = tf.constant(scale_value, tf.float32)
                        sw = sample_weight[start:stop] if sample_weight is not None else None
                        out, y_pred, _ = forward_loss(inputs, y[start:stop], sw, scale)
                        predictions[i] = y_pred
                        loss_part += float(out)
                        differentiate = [out]
                    else:
                        out, activity = forward(inputs)
                        loss_part += float(activity) * scale_value
                        differentiate = [out, activity]
                        if self.is_last:
                            predictions[i] = out
                finally:
                    if tape is not None:
                        tape.__exit__(None, None, None)
                if not self.is_last:
                    self.comm.send(out.numpy(), self.index + 1, TAG_ACTIVATION)
                if tape is not None:
                    tapes[i] = (tape, inputs, differentiate)
                self.comm.progress()
            else:
                tape, inputs, differentiate = tapes.pop(i)
                sources = ([] if self.is_first else [inputs]) + self.trainable_variables
                if self.is_last:
                    output_grads = None
                else:
                    upstream = self._receive(self.index + 1, TAG_GRADIENT, self.output_spec, stop - start)
                    output_grads = [upstream, tf.constant(scale_value, tf.float32)]
                grads = _zeros_for_none(tape.gradient(differentiate, sources, output_gradients=output_grads), sources)
                if not self.is_first:
                    self.comm.send(grads[0].numpy(), self.index - 1, TAG_GRADIENT)
                    grads = grads[1:]
                grad_total = grads if grad_total is None else self._accumulate(grad_total, grads)
                self.comm.progress()

        if self._has_weight_regularizers and with_loss:
            if training:
                reg_loss, reg_grads = self.weight_regularization_and_gradients()
                grad_total = self._accumulate(grad_total, reg_grads) if grad_total is not None else reg_grads
            else:
                reg_loss = self.weight_regularization()
            loss_part += float(reg_loss)
        if training and grad_total is not None:
            self.comm.activity = f"step {self.step}, optimizer update"
            self.apply_gradients(model.optimizer, grad_total)
        self.step += 1
        y_pred = tf.concat(predictions, axis=0) if self.is_last else None
        return loss_part, y_pred

    def _receive(self, source, tag, spec, rows):
        shape, dtype = spec
        array = self.comm.recv(source, tag, tuple(shape[1:]), tf.as_dtype(dtype).as_numpy_dtype)
        if array.shape[0] != rows:
            raise RankMismatchError(
                f"rank {self.comm.rank} expected a micro-batch of {rows} samples from rank {source} but got "
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
                    f"rank {self.comm.rank} has a batch of {batch_size} samples but rank 0 sent targets for "
                    f"{array.shape[0]}: the ranks were given different data. Give every rank the same data "
                    "sizes and batch_size."
                )
            received.append(array)
        return tuple(received)


def _zeros_for_none(grads, sources):
    """Zeros where a source does not affect the target (a frozen path, an unused weight)."""
    return [tf.zeros(s.shape, s.dtype) if g is None else g for g, s in zip(grads, sources)]
