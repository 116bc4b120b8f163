"""``PipelineModel``: a ``keras.Sequential``-like model whose layers are split over MPI ranks.

A thin Keras façade: it does what a ``keras.Model`` does (arguments,
``compile``, ``fit``/``evaluate``/``predict``, the step methods, weights,
saving, ``summary``) and hands the pipeline to its
:class:`~keras_pipe.engine.Engine`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat, compile_checks, partition
from keras_pipe import weights as _weights
from keras_pipe.calls import CallPreparation, batch_size_of, python_step_function
from keras_pipe.engine import Engine
from keras_pipe.errors import PipelineConfigError
from keras_pipe.failure import collective
from keras_pipe.logs import ModelLogs
from keras_pipe.saving import SavingMethods


class PipelineModel(SavingMethods, keras.Model):
    """A chain of layers trained with pipeline parallelism over MPI ranks.

    Write the model as for ``keras.Sequential`` and run the same script under
    ``mpirun -n P``: the ranks of ``MPI.COMM_WORLD`` are the stages, in
    order, each owning a contiguous slice of the layers and creating weights
    for those layers only. Each batch is cut into ``num_microbatches``
    micro-batches; activations travel forward and the gradients with respect
    to them travel backward between neighbouring ranks. ``fit``,
    ``evaluate`` and ``predict`` give what ``keras.Sequential`` gives, with the
    same logs on every rank. Under plain ``python`` the whole model runs in
    one process. Creating the model is collective: every rank creates it.

    Example:

    ```python
    model = PipelineModel([
        keras.Input((28, 28)),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], num_microbatches=4)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=3)
    ```

    Args:
        layers: the layers, in order; a leading ``keras.Input`` fixes the
            input shape (otherwise it is taken from the first batch).
        num_microbatches: micro-batches per batch. ``None`` means
            ``2 * number of stages`` (1 on one rank).
        balance: layers per stage (e.g. ``[2, 3, 2]``); ``None`` balances the
            stages' parameter counts; ``"time"`` measures each layer's forward
            and backward time on a sample micro-batch and balances time.
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"zb-h1"`` (see
            :mod:`keras_pipe.schedule`). All give the same training result. A
            model whose output carries a Keras mask, under a mean loss, trains
            in GPipe's order whatever this says (its loss is a mean over the
            whole batch's unmasked entries, counted before any backward).
        num_stages: stages per pipeline. With ``W`` ranks, ``W / num_stages``
            replicas of the pipeline each train on their share of every
            batch and sum their gradients before each update (data
            parallelism); ``None`` (default) means one pipeline over every
            rank.
        stall_timeout: seconds a rank may wait for a neighbour before the job
            is ended with a report; default ``KERAS_PIPE_STALL_TIMEOUT`` or 600.
        recompute: activation recomputation, as torchgpipe's ``checkpoint``:
            ``"never"`` (default) keeps every layer's activations of a
            micro-batch until its backward; ``"always"`` keeps only the
            stage's input and reruns the forward in the backward (same
            dropout masks), trading one more forward for activation memory;
            ``"except_last"`` does so for every micro-batch but the last.
            Results are the same.
        name: the model's name.
        trainable: whether the model's weights are trainable.
    """

    def __init__(
        self,
        layers: Sequence[Any] | None = None,
        *,
        num_microbatches: int | None = None,
        balance: Sequence[int] | str | None = None,
        schedule: str = "1f1b",
        num_stages: int | None = None,
        stall_timeout: float | None = None,
        recompute: str = "never",
        name: str | None = None,
        trainable: bool = True,
    ):
        super().__init__(name=name, trainable=trainable)
        engine = Engine(num_stages, stall_timeout, num_microbatches, schedule, balance, recompute)
        # Not tracked by Keras: only this rank's stage layers are (so that
        # `trainable_variables`, the optimizer and saving see this rank's).
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "_pipeline_layers", [])
        object.__setattr__(self, "_calls", CallPreparation(self))
        object.__setattr__(self, "_logs", ModelLogs(self))
        self._pipeline_input = None
        self._pipeline_logs = None
        self._loss_reduction = None
        for item in layers or []:
            self.add(item)

    num_stages = property(lambda self: self.engine.num_stages, doc="Stages per pipeline.")
    num_replicas = property(lambda self: self.engine.num_replicas, doc="Replicas of the pipeline.")
    stage_index = property(lambda self: self.engine.stage, doc="This rank's stage.")
    replica_index = property(lambda self: self.engine.replica, doc="This rank's replica.")
    num_microbatches = property(lambda self: self.engine.num_microbatches, doc="Micro-batches per batch.")
    schedule = property(lambda self: self.engine.schedule, doc="The training schedule's name.")
    balance = property(lambda self: self.engine.balance, doc="Layers per stage, once built.")

    @property
    def tracer(self):
        """A :class:`~keras_pipe.tracing.Tracer` that receives every span of every step (``None``: off)."""
        return self.engine.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self.engine.tracer = tracer

    # -- building the model ---------------------------------------------

    def add(self, layer) -> None:
        """Appends a layer (or, first, a ``keras.Input``), as ``Sequential.add``."""
        if isinstance(layer, (keras.KerasTensor, keras.layers.InputLayer)):
            if self._pipeline_layers or self._pipeline_input is not None:
                raise PipelineConfigError("keras.Input can only be the first item of a PipelineModel's layer list.")
            tensor = layer if isinstance(layer, keras.KerasTensor) else layer.output
            self._pipeline_input = (tuple(tensor.shape), str(tensor.dtype))
            return
        if not isinstance(layer, keras.layers.Layer):
            raise PipelineConfigError(f"PipelineModel takes Keras layers, got {type(layer).__name__}: {layer!r}.")
        if any(layer is other for other in self._pipeline_layers):
            raise PipelineConfigError(
                f"layer {layer.name!r} appears twice in the layer list; a pipeline is a chain in which "
                "every layer is used once. Create a second layer instead of reusing it."
            )
        if self.engine.built:
            raise PipelineConfigError(
                "layers cannot be added after the model was built (it is already split over the ranks); "
                "add every layer before compile()/fit()."
            )
        self._pipeline_layers.append(layer)

    @property
    def layers(self) -> list:
        """Every layer of the model, in order, on every rank (built only on its own stage)."""
        return list(self._pipeline_layers)

    @property
    def stage_layers(self) -> list:
        """The layers this rank owns (once built: see :meth:`build`)."""
        if not self.engine.built:
            raise PipelineConfigError("the model is not built yet; call model.build() on every rank first.")
        return list(self.engine.compute.layers)

    def build(self, input_shape=None, input_dtype=None) -> None:
        """Splits the layers over the ranks and builds this rank's stage (collective: call it on every rank).

        Happens by itself on the first ``fit``/``evaluate``/``predict`` (or
        on ``get_weights``, ``summary``, ...), all of which every rank calls.
        """
        if self.engine.built:
            return
        if self._pipeline_input is not None:
            input_shape, input_dtype = self._pipeline_input
        elif input_shape is None:
            raise PipelineConfigError(
                "the input shape is unknown; start the layer list with keras.Input(shape) or call fit()."
            )
        input_dtype = input_dtype or keras.config.floatx()
        rows = getattr(self, "_probe_rows", None) or 32
        own = self.engine.build(self._pipeline_layers, tuple(input_shape), input_dtype, rows)
        self._pipeline_input = (tuple(input_shape), str(input_dtype))
        self._stage_layers = list(own)  # tracked: these are this rank's weights
        self.built = True
        _weights.copy_from_first_replica(self.engine)

    def _build_for(self, x) -> None:
        if not self.engine.built:
            self._probe_rows = max(1, int(x.shape[0]) // self.engine.num_microbatches)
            self.build((None,) + tuple(x.shape[1:]), x.dtype.name)

    def call(self, inputs, training=None):
        """Runs the whole model on ``inputs``; only possible on a single rank (use ``predict``)."""
        self._build_for(inputs)
        if self.num_stages > 1:
            raise PipelineConfigError(
                f"calling a PipelineModel directly is not possible on {self.num_stages} ranks, as each rank "
                "holds only its stage's layers; use model.predict(x), which runs the pipeline."
            )
        for layer in self.engine.compute.layers:
            inputs = layer(inputs, training=training)
        return inputs

    # -- compile ----------------------------------------------------------

    def compile(self, *args, **kwargs):
        """As ``keras.Model.compile``; refuses, on every rank, the options a pipeline cannot honour.

        ``jit_compile`` (default ``"auto"``: on) compiles each micro-batch's
        programs and the update with XLA where the layers allow it;
        ``run_eagerly=True`` runs every micro-batch op by op (for debugging).
        """
        arguments = inspect.signature(keras.Model.compile).bind(self, *args, **kwargs).arguments
        arguments.update(arguments.pop("kwargs", {}))
        jit = arguments.pop("jit_compile", "auto")
        compile_checks.check_arguments(dict(arguments, jit_compile=jit))
        arguments.pop("self")
        super().compile(**arguments, jit_compile=False)  # keras_pipe compiles its own programs
        self.engine.logs.forget()
        compile_checks.check_model(self)
        # Once per compile, not per step: how each micro-batch's loss enters the batch's.
        self._loss_reduction = compile_checks.loss_reduction(self.loss) if self.loss is not None else None
        self.engine.configure(jit=jit is not False, eager=bool(self.run_eagerly))

    def compile_from_config(self, config) -> None:
        """Compiles from ``get_compile_config()`` output, as ``keras.Model`` does (used when loading)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    # -- the steps ---------------------------------------------------------

    def train_step(self, data):
        """One pipelined training step on a batch; returns the same logs on every rank."""
        return self._step(data, "train")

    def test_step(self, data):
        """One pipelined forward pass computing loss and metrics on the last stage."""
        return self._step(data, "test")

    def predict_step(self, data):
        """One pipelined forward pass; every rank returns the whole batch's predictions."""
        x = self._inputs(data)
        _, y_pred = self.engine.run("predict", x, None, None)
        return self.engine.broadcast_predictions(y_pred, int(x.shape[0]))

    def _inputs(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        x = tf.convert_to_tensor(x)
        if self._pipeline_input is not None and x.dtype.name != self._pipeline_input[1]:
            x = tf.cast(x, self._pipeline_input[1])  # as Keras converts inputs to the declared dtype
        self._build_for(x)
        return x

    def _step(self, data, phase: str):
        engine = self.engine
        x = self._inputs(data)
        _, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if phase == "train" and y is None:  # every rank was given the same kind of data
            raise PipelineConfigError("fit() was given no y: training a PipelineModel needs targets.")
        batch_size = int(x.shape[0])
        y = None if y is None else np.asarray(y)
        sample_weight = None if sample_weight is None else np.asarray(sample_weight)
        y, sample_weight = engine.exchange_targets(y, sample_weight, batch_size)
        if phase == "train" and self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        loss_part, y_pred = engine.run(
            phase, x, y, sample_weight, compat.compiled_loss(self), self._loss_reduction, self.optimizer
        )
        self._pipeline_logs = self._logs.step_logs(phase, loss_part, batch_size, y, y_pred, sample_weight)
        return self._pipeline_logs

    def _flatten_metrics_in_order(self, logs):
        # The logs are in the last stage's order on every rank (see _metric_results).
        order = self._logs.order
        if order is None or not set(order) <= set(logs):
            return super()._flatten_metrics_in_order(logs)
        values = [logs[name] for name in order]
        return values[0] if len(values) == 1 else values

    def get_metrics_result(self) -> dict:
        """The latest logs, identical on every rank (the last stage's metrics, all stages' loss)."""
        if self._pipeline_logs is not None:
            return dict(self._pipeline_logs)
        return super().get_metrics_result()

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._logs.reset()
        self._pipeline_logs = None

    # -- the step functions Keras calls -------------------------------------

    def make_train_function(self, force=False):
        if self.train_function is None or force:
            self.train_function = python_step_function(self, self.train_step, "train")
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = python_step_function(self, self.test_step, "test")
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:

            def predict_function(data):
                outputs = []
                for step_data in data:
                    self.engine.steps.agree("predict", True, batch_size_of(step_data), self._calls.digest(step_data))
                    outputs.append(self.predict_step(step_data))
                return outputs[0] if len(outputs) == 1 else tf.concat(outputs, axis=0)

            self.predict_function = predict_function
        return self.predict_function

    # -- fit / evaluate / predict ---------------------------------------------

    @collective
    def fit(self, *args, **kwargs):
        """As ``keras.Model.fit``, pipelined; every rank gets the same ``History``."""
        with self._calls.prepare("fit", keras.Model.fit, args, kwargs) as arguments:
            return super().fit(**arguments)

    @collective
    def evaluate(self, *args, **kwargs):
        """As ``keras.Model.evaluate``, pipelined; every rank returns the same values, in ``Sequential``'s order."""
        with self._calls.prepare("evaluate", keras.Model.evaluate, args, kwargs) as arguments:
            return super().evaluate(**arguments)

    @collective
    def predict(self, *args, **kwargs):
        """As ``keras.Model.predict``, pipelined; every rank returns the whole array of predictions."""
        with self._calls.prepare("predict", keras.Model.predict, args, kwargs) as arguments:
            return super().predict(**arguments)

    # -- weights ------------------------------------------------------------

    @collective
    def get_weights(self) -> list[np.ndarray]:
        """Every layer's weights, in layer order, on every rank (as ``Sequential.get_weights``; collective)."""
        self.build()
        return _weights.gather(self.engine)

    @collective
    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets the whole model's weights from rank 0's ``Sequential``-ordered ``weights`` (collective)."""
        self.build()
        _weights.assign(self.engine, weights)

    # -- construction from Keras models ---------------------------------------

    @classmethod
    def from_sequential(cls, model: keras.Sequential, **pipeline_options) -> PipelineModel:
        """The same model as a pipeline: one line changes in an existing script (collective).

        Layers with weights are re-created (so that other stages' weights
        are not kept on every rank; where a layer cannot be copied, its own
        object is used), layers without are used as they are, and, if ``model`` is built,
        rank 0's weights are copied: an unseeded script trains rank 0's model.

        Example:

        ```python
        seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model = PipelineModel.from_sequential(seq, num_microbatches=4)
        ```
        """
        if not isinstance(model, keras.Sequential):
            raise PipelineConfigError(
                f"from_sequential takes a keras.Sequential, got a {type(model).__name__} ({model.name!r}). A "
                "pipeline is a chain of layers: write it as PipelineModel([keras.Input(...), layer, ...]), keeping "
                "any branch or skip connection inside one custom layer."
            )
        items = []
        if model.built:
            first = model.inputs[0] if getattr(model, "inputs", None) else None
            shape = first.shape if first is not None else model.input_shape
            items.append(keras.Input(batch_shape=tuple(shape), dtype=first.dtype if first is not None else None))
        items += [partition.copy_unless_weightless(layer) for layer in model.layers]
        pipeline_options.setdefault("name", model.name)
        pipeline = cls(items, **pipeline_options)
        if model.built:
            pipeline.set_weights(model.get_weights())
        return pipeline

    @collective
    def count_params(self) -> int:
        """The whole model's parameters, every stage's, as ``Sequential.count_params`` (collective if unbuilt).

        This rank's own: ``sum(v.numpy().size for v in model.weights)``:
        ``weights``, ``trainable_variables`` and the optimizer's variables are
        this rank's stage's.
        """
        self.build()
        return sum(spec.num_params for spec in self.engine.specs)

    @collective
    def summary(self, print_fn=None, **kwargs) -> None:
        """Prints one table, on rank 0: each layer with its stage, output shape and parameters (collective)."""
        self.build()
        if self.engine.world.rank != 0:
            return
        print_fn = print_fn or (lambda line: print(line, file=sys.stdout))
        replicas = f" x {self.num_replicas} replicas" if self.num_replicas > 1 else ""
        print_fn(
            f'PipelineModel "{self.name}": {self.num_stages} stages{replicas}, '
            f"{self.num_microbatches} micro-batches, schedule {self.schedule}"
        )
        for line in partition.summary_lines(self.engine.specs, self.balance):
            print_fn(line)
        if self.engine.world.size > 1:
            print_fn("Ranks:")
            for line in self.engine.layout.describe():
                print_fn("  " + line)
