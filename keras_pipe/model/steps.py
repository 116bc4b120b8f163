"""Internal: one pipelined step of a ``PipelineModel``, as Keras' loop calls it.

:class:`ModelSteps` is what the model's ``train_step``, ``test_step`` and
``predict_step`` delegate to: every rank checks the batch's inputs and the
first stage converts them, the labels travel to the last stage, the engine
runs the step, and every rank gets the same logs (or predictions).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.engine.batch import StepInputs
from keras_pipe.errors import PipelineConfigError
from keras_pipe.model.calls import batch_size_of, stood_in, target_likes
from keras_pipe.model.feeding import Drawn
from keras_pipe.stage.losses import MicrobatchLoss


class ModelSteps:
    """A ``PipelineModel``'s steps: its batches' inputs and labels, the engine's run, the logs.

    Not a Keras object: the model holds it untracked.

    Args:
        model: the ``PipelineModel``, for Keras' side of a step: its compiled
            loss, its optimizer and trainable variables.
        builder: its :class:`~keras_pipe.model.building.ModelBuilder` (the
            graph the inputs are checked against, built for the first batch).
        engine: its :class:`~keras_pipe.engine.engine.Engine`, which runs the step.
        logs: its :class:`~keras_pipe.model.logs.ModelLogs` (a step's logs, the same on every rank).

    Attributes:
        loss: the compiled loss term by term (a :class:`MicrobatchLoss`), made
            from the first batch's labels after each ``compile()`` (which sets it
            to ``None``).
        stand_in_inputs: whether this call's ``x`` is a zero-width stand-in
            (set for the call by :class:`~keras_pipe.model.calls.CallPreparation`).
        last_logs: the latest step's logs; ``None`` after ``reset_metrics()``.
    """

    def __init__(self, model, builder, engine, logs):
        self.model = model
        self.builder = builder
        self.engine = engine
        self.logs = logs
        self.loss: MicrobatchLoss | None = None
        self.stand_in_inputs = False
        self.last_logs: dict | None = None
        self.drawn: Drawn | None = None  # the step's batch as Keras' loop drew it (None: train_on_batch's)

    def run(self, data, phase: str) -> dict:
        """One pipelined ``"train"`` or ``"test"`` step on a batch; returns the same logs on every rank."""
        model, engine = self.model, self.engine
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if phase == "train" and y is None and compat.compiled_loss(model) is not None:
            # every rank was given the same kind of data
            raise PipelineConfigError("fit() was given no y: training a PipelineModel with a loss needs targets.")
        batch_size, shares = self._place(data)
        flat_x = self.inputs(x)
        y = _as_numpy(y)
        if self.stand_in_inputs and stood_in(y):  # (not with class_weight; not train_on_batch's y)
            y = target_likes(y)  # (no bytes: their shapes and dtypes only)
        sample_weight = _as_numpy(sample_weight)
        if engine.num_stages > 1 and any(
            isinstance(a, (tf.RaggedTensor, tf.SparseTensor)) for a in keras.tree.flatten((y, sample_weight))
        ):  # (every rank was given the same kind of data)
            raise PipelineConfigError(
                "ragged or sparse labels cannot travel from the first stage, which pairs them with the inputs, to the "
                "last, which computes the loss: give dense labels (padded, with sample weights), or train on one rank."
            )
        optimizer = model.optimizer
        inputs = StepInputs(
            phase=phase,
            x=flat_x,
            batch_size=batch_size,
            y=y,
            sample_weight=sample_weight,
            optimizer=optimizer,
            shares=shares,
        )

        def ready(picked: bool) -> None:
            if picked:  # (schedule="auto" timed its candidates on this batch: this rank may hold other layers)
                self.builder.follow_engine()
            if phase == "train" and optimizer is not None and not optimizer.built:
                optimizer.build(model.trainable_variables)

        done = engine.step(inputs, self.microbatch_loss, ready)
        self.last_logs = self.logs.step_logs(
            phase, done.loss_part, done.terms, batch_size, done.y, done.predictions, done.sample_weight
        )
        return self.last_logs

    def predict(self, data):
        """One pipelined forward pass; every rank returns the whole batch's predictions."""
        engine = self.engine
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        flat_x = self.inputs(x)  # (first: it checks the inputs' shapes, a scalar's among them, in Keras' words)
        batch_size, shares = self._place(data)
        flat = engine.step(StepInputs(phase="predict", x=flat_x, batch_size=batch_size, shares=shares))
        return keras.tree.pack_sequence_as(engine.graph.output_structure(), flat)

    def _place(self, data) -> tuple[int, tuple | None]:
        """The step's global batch size, and each replica's rows of it where each replica's first stage read its
        own (``distribute_datasets_from_function``: ``data``'s inputs are this replica's alone), else ``None``."""
        drawn, self.drawn = self.drawn, None
        if drawn is not None and drawn.shares is not None:
            return sum(drawn.shares), drawn.shares
        return batch_size_of(data), None

    def microbatch_loss(self, y) -> MicrobatchLoss:
        """The compiled loss term by term (built once per ``compile()``, from the first batch's labels)."""
        if self.loss is None:
            loss = MicrobatchLoss(compat.compiled_loss(self.model), self.engine.graph.output_structure(), [])
            loss.build(y)
            self.loss = loss
        return self.loss

    def inputs(self, x) -> list | None:
        """The first stage's model inputs, flat, as Keras' Functional model converts them; ``None`` elsewhere.

        Every rank checks the batch's shapes against the model's inputs (no
        conversion), so that data of the wrong shape is the same error on
        every rank, not the first stage's alone.
        """
        if self.stand_in_inputs:  # (checked once for the call: see calls.stand_in_inputs)
            return None
        engine = self.engine
        self.builder.build_for(x)
        source = self.builder.source
        given = compat.check_input_shapes(source, x)
        # (None for an optional=True input: the first stage's layers get None, as in Keras' Functional model;
        # one a later stage reads would have to cross, which None cannot)
        absent = []
        if any(value is None for value in given):  # (rare: the crossings are not looked through every step)
            crossing = {c.tensor for c in engine.cut.crossings}
            inputs = zip(source.inputs, engine.cut.graph.inputs, given)
            absent = [t.name for t, k, v in inputs if v is None and k in crossing]
        if absent:
            raise PipelineConfigError(
                f"the optional inputs {absent} were given None, and a later stage reads them: keras_pipe sends a "
                "tensor's rows between stages and cannot send None. Give them a tensor, or keep the layers that "
                "read them on the first stage (split_before=...)."
            )
        if not engine.is_first:
            return None
        return compat.standardize_inputs(source, x)

    def predict_function(self, digest):
        """Keras' ``predict_function``: the model's ``predict_step`` on each batch, after the ranks agree on it.

        ``digest``: the batch's digest, compared between replicas (``CallPreparation.digest``).
        """
        model, engine = self.model, self.engine

        def predict_function(data):
            outputs = []
            for step_data in data:
                if isinstance(step_data, Drawn):  # (Keras' loop's batches: agreed as they were drawn)
                    self.drawn, step_data = step_data, step_data.data
                else:  # (predict_on_batch's)
                    self.drawn = None
                    engine.steps.agree("predict", True, batch_size_of(step_data), digest(step_data))
                outputs.append(model.predict_step(step_data))
            if len(outputs) == 1:
                return outputs[0]
            return keras.tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

        return predict_function


def _as_numpy(value):
    """Labels or sample weights as numpy arrays, in their structure (sparse and ragged tensors as they are)."""
    if value is None:
        return None

    def convert(array):
        if array is None or isinstance(array, (tf.SparseTensor, tf.RaggedTensor)):
            return array
        return np.asarray(array)

    return keras.tree.map_structure(convert, value)
