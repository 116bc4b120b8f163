"""``PipelineModel``: a Keras model whose graph is cut into stages over MPI ranks.

A thin Keras façade: it does what a ``keras.Model`` does (arguments,
``compile``, ``fit``/``evaluate``/``predict``, the step methods, weights,
saving, ``summary``) and hands the pipeline to its
:class:`~keras_pipe.engine.engine.Engine`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.engine.engine import Engine
from keras_pipe.engine.logs import ModelLogs
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.errors import PipelineConfigError
from keras_pipe.model import compile_checks, hub
from keras_pipe.model import summary as summaries
from keras_pipe.model import weights as _weights
from keras_pipe.model.building import ModelBuilding
from keras_pipe.model.calls import CallPreparation, batch_size_of, python_step_function, stood_in, target_likes
from keras_pipe.model.datasets import DatasetStrategy
from keras_pipe.model.saving import SavingMethods
from keras_pipe.mpi.failure import collective
from keras_pipe.stage.compute import Masked
from keras_pipe.stage.losses import MicrobatchLoss


@keras.saving.register_keras_serializable(package="keras_pipe")
class PipelineModel(SavingMethods, ModelBuilding, keras.Model):
    """A Keras model trained with pipeline parallelism over MPI ranks.

    Write the model as for ``keras.Sequential`` (a list of layers) or as for
    ``keras.Model(inputs, outputs)``, and run the same script under
    ``mpirun -n P``: the ranks of ``MPI.COMM_WORLD`` are the stages, in
    order, each running a contiguous run of the model's nodes and holding
    the weights of those nodes only. Each batch is cut into
    ``num_microbatches`` micro-batches; activations travel forward and the
    gradients with respect to them travel backward between the stages.
    ``fit``, ``evaluate`` and ``predict`` give what the unsplit model gives,
    with the same logs on every rank. Under plain ``python`` the whole model
    runs in one process. Creating the model is collective: every rank
    creates it.

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

    # any Functional model: several inputs and outputs, skip edges, shared layers
    tokens = keras.Input((None,), dtype="int32")
    ...
    model = PipelineModel(inputs=tokens, outputs=logits, num_microbatches=4)
    ```

    Args:
        layers: the layers of a chain, in order; a leading ``keras.Input``
            fixes the input shape (otherwise it is taken from the first batch).
        inputs, outputs: instead of ``layers``, the model's graph, as
            ``keras.Model(inputs, outputs)`` takes it (``PipelineModel(inputs,
            outputs)`` too: given ``outputs``, the first argument is the inputs).
        num_microbatches: micro-batches per batch. ``None`` means
            ``2 * number of stages`` (1 on one rank); ``"auto"`` times
            ``P``, ``2P`` and ``4P`` (with each schedule ``"auto"`` times)
            in the first training steps and trains on with the fastest.
        balance: nodes per stage (e.g. ``[2, 3, 2]``; for a chain, layers);
            ``None`` balances the stages' parameter counts; ``"time"``
            measures each node's forward and backward time on a sample
            micro-batch and balances time.
        split_before: instead of ``balance``, the names of the nodes that
            start the second, third, ... stage (``summary()`` lists them).
        schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"zb-h1"`` (see
            :mod:`keras_pipe.schedules.schedule`) or ``"auto"``: the first ten training
            steps alternate 1F1B and ZB-H1 and time them, then every rank
            trains on with the faster (:mod:`keras_pipe.schedules.auto`; ``summary()``
            says which). All give the same training result. A
            model whose output carries a Keras mask, under a mean loss, trains
            in GPipe's order whatever this says (its loss is a mean over the
            whole batch's unmasked entries, counted before any backward).
            With several model chunks a rank: ``"interleaved-1f1b"``
            (Megatron's interleaved 1F1B: ``num_chunks`` chunks a rank, placed
            in a loop, the bubble ``num_chunks`` times smaller;
            ``num_microbatches`` a multiple of the ranks) or ``"zb-v"`` (two
            chunks a rank in a V, zero-bubble, 1F1B's memory); see
            :mod:`keras_pipe.schedules.virtual`. The model is then cut into
            ``num_stages * num_chunks`` virtual stages (``balance`` lists that
            many sizes). With replicas too, and with a layer called on several
            virtual stages (a weight two chunks hold takes one update).
        num_chunks: model chunks (virtual stages) a rank holds: ``None``
            (default) means two for ``"interleaved-1f1b"`` and ``"zb-v"``, one
            for the others.
        num_stages: stages per pipeline. With ``W`` ranks, ``W / num_stages``
            replicas of the pipeline each train on their share of every
            batch and sum their gradients before each update (data
            parallelism); ``None`` (default) means one pipeline over every
            rank.
        stall_timeout: seconds a rank may wait for another before the job
            is ended with a report; default ``KERAS_PIPE_STALL_TIMEOUT`` or 600.
            The first step's waits include the neighbours' tracing and XLA
            compilation: keep it well above the slowest stage's first step.
        recompute: activation recomputation, as torchgpipe's ``checkpoint``:
            ``"never"`` (default) keeps every node's activations of a
            micro-batch until its backward; ``"always"`` keeps only the
            stage's input and reruns the forward in the backward (same
            dropout masks), trading one more forward for activation memory;
            ``"except_last"`` does so for every micro-batch but the last.
            Results are the same.
        name: the model's name.
        trainable: whether the model's weights are trainable.
        dtype: the model's dtype policy, as ``keras.Model`` takes it (``"mixed_float16"``: compile
            wraps the optimizer in a ``LossScaleOptimizer``).
    """

    _keras_pipe_pipeline = True  # (what the engine looks for among a model's layers: a pipeline nested in one)

    def __init__(
        self,
        layers: Sequence[Any] | None = None,
        outputs=None,
        *,
        inputs=None,
        num_microbatches: int | None = PipelineOptions.num_microbatches,
        balance: Sequence[int] | str | None = PipelineOptions.balance,
        split_before: Sequence[str] | None = PipelineOptions.split_before,
        schedule: str = PipelineOptions.schedule,
        num_chunks: int | None = PipelineOptions.num_chunks,
        num_stages: int | None = PipelineOptions.num_stages,
        stall_timeout: float | None = PipelineOptions.stall_timeout,
        recompute: str = PipelineOptions.recompute,
        name: str | None = None,
        trainable: bool = True,
        dtype=None,
    ):
        super().__init__(name=name, trainable=trainable, dtype=dtype)
        options = PipelineOptions(
            num_microbatches=num_microbatches,
            balance=balance,
            split_before=split_before,
            schedule=schedule,
            num_chunks=num_chunks,
            num_stages=num_stages,
            stall_timeout=stall_timeout,
            recompute=recompute,
        )
        object.__setattr__(self, "_options", options)  # as given (get_config writes it)
        engine = Engine(options)  # (it resolves and checks them against the world, once)
        # Not tracked by Keras: only this rank's stage layers are (so that
        # `trainable_variables`, the optimizer and saving see this rank's).
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "_pipeline_layers", [])
        object.__setattr__(self, "_source", None)  # the Functional model the pipeline runs
        object.__setattr__(self, "_calls", CallPreparation(self))
        object.__setattr__(self, "_logs", ModelLogs(self))
        object.__setattr__(self, "_loss", None)
        object.__setattr__(self, "_from_graph", False)
        object.__setattr__(self, "_input_tensor", None)  # the user's keras.Input, kept as given
        object.__setattr__(self, "_stand_in_inputs", False)  # this call's x is a zero-width stand-in (calls.py)
        self._stage_layers = []  # tracked by Keras: this rank's layers, hence its weights (see building)
        self._pipeline_input = None
        self._pipeline_logs = None
        self._first_batch_size = None  # (the engine measures balance="time" on a micro-batch of it)
        self._call_dtypes = None
        if outputs is not None and inputs is None and layers is not None:
            inputs, layers = layers, None  # PipelineModel(inputs, outputs), as keras.Model(inputs, outputs)
        if inputs is not None or outputs is not None:
            if layers is not None:
                raise PipelineConfigError("give either a list of layers or inputs= and outputs=, not both.")
            if inputs is None or outputs is None:
                raise PipelineConfigError("a Functional PipelineModel needs both inputs= and outputs=.")
            self._use_model(keras.Model(inputs, outputs, name=name))
            # built as a Functional model is, once constructed: the cut and this rank's stage (collective,
            # as creating the model is); its weights are those of the layers the graph was made of
            self._build()
        for item in layers or []:
            self.add(item, rebuild=False)
        if layers:
            self._follow_layers()

    @property
    def trainable(self):
        return super().trainable

    @trainable.setter
    def trainable(self, value):
        # Keras sets the flag on the layers it tracks (this rank's stage): every rank's copy of every
        # layer takes it, so that the ranks still agree on the model (and its later stages, once built).
        keras.Model.trainable.fset(self, value)
        source = getattr(self, "_source", None)
        for layer in getattr(self, "_pipeline_layers", None) or (source.layers if source is not None else []):
            layer.trainable = bool(value)

    @property
    def output_names(self):
        """The names of the layers that make the outputs, as a Functional model's (``compile``'s dict keys).

        ``None`` until the model's graph is known (a chain before its first use), as a ``Sequential``'s.
        """
        source = getattr(self, "_source", None)
        return None if source is None or not self._from_graph else list(source.output_names)

    def _lock_state(self):
        # As Functional's: a pipeline's tracked stage layers change when a one-rank model is rebuilt.
        pass

    def _use_model(self, model) -> None:
        object.__setattr__(self, "_source", model)
        object.__setattr__(self, "_from_graph", True)

    num_stages = property(lambda self: self.engine.num_stages, doc="Stages per pipeline.")
    num_replicas = property(lambda self: self.engine.num_replicas, doc="Replicas of the pipeline.")
    stage_index = property(lambda self: self.engine.stage, doc="This rank's stage.")
    replica_index = property(lambda self: self.engine.replica, doc="This rank's replica.")
    num_microbatches = property(lambda self: self.engine.num_microbatches, doc="Micro-batches per batch.")
    schedule = property(lambda self: self.engine.schedule, doc="The training schedule's name.")
    balance = property(lambda self: self.engine.balance, doc="Nodes per stage, once built.")

    @property
    def distribute_strategy(self):
        """Keras' strategy; Keras' loop gets its datasets from it with tf.data's autotuning off (see datasets.py)."""
        return DatasetStrategy(super().distribute_strategy)

    @property
    def tracer(self):
        """A :class:`~keras_pipe.engine.tracing.Tracer` that receives every span of every step (``None``: off)."""
        return self.engine.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self.engine.tracer = tracer

    # -- compile ----------------------------------------------------------

    def compile(self, *args, **kwargs):
        """As ``keras.Model.compile``; refuses, on every rank, the options a pipeline cannot honour.

        ``jit_compile`` (default ``"auto"``) compiles each micro-batch's
        programs and the update with XLA where the layers allow it, except
        the training programs of a stage that draws random numbers (XLA's
        random streams differ from TensorFlow's, so its dropout masks would
        differ from the unsplit model's); ``True`` compiles those too,
        ``False`` nothing. ``run_eagerly=True`` runs every micro-batch op by
        op (for debugging).
        """
        arguments = inspect.signature(keras.Model.compile).bind(self, *args, **kwargs).arguments
        arguments.update(arguments.pop("kwargs", {}))
        jit = arguments.pop("jit_compile", "auto")
        compile_checks.check_no_strategy(self)
        compile_checks.check_arguments(dict(arguments, jit_compile=jit))
        arguments.pop("self")
        super().compile(**arguments, jit_compile=False)  # keras_pipe compiles its own programs
        self.engine.logs.forget()
        compile_checks.check_model(self)
        object.__setattr__(self, "_loss", None)
        self.engine.configure(jit=jit, eager=bool(self.run_eagerly), frozen=not self.trainable)

    def compile_from_config(self, config) -> None:
        """Compiles from ``get_compile_config()`` output, as ``keras.Model`` does (used when loading)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def _microbatch_loss(self, y) -> MicrobatchLoss:
        """The compiled loss term by term (built once per ``compile()``, from the first batch's labels)."""
        if self._loss is None:
            loss = MicrobatchLoss(compat.compiled_loss(self), self.engine.graph.output_structure(), [])
            loss.build(y)
            object.__setattr__(self, "_loss", loss)
        return self._loss

    # -- the steps ---------------------------------------------------------

    def train_step(self, data):
        """One pipelined training step on a batch; returns the same logs on every rank."""
        return self._step(data, "train")

    def test_step(self, data):
        """One pipelined forward pass computing loss and metrics on the last stage."""
        return self._step(data, "test")

    def predict_step(self, data):
        """One pipelined forward pass; every rank returns the whole batch's predictions."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        flat_x = self._inputs(x)  # (first: it checks the inputs' shapes, a scalar's among them, in Keras' words)
        batch_size = batch_size_of(data)
        _, _, flat = self.engine.run("predict", flat_x, batch_size)
        if flat is not None:
            flat = [p.tensor if isinstance(p, Masked) else p for p in flat]
        flat = self.engine.predictions.broadcast_predictions(flat, batch_size, self.engine.cut.graph)
        return keras.tree.pack_sequence_as(self.engine.graph.output_structure(), flat)

    def _inputs(self, x) -> list | None:
        """The first stage's model inputs, flat, as Keras' Functional model converts them; ``None`` elsewhere.

        Every rank checks the batch's shapes against the model's inputs (no
        conversion), so that data of the wrong shape is the same error on
        every rank, not the first stage's alone.
        """
        if self._stand_in_inputs:  # (checked once for the call: see calls.stand_in_inputs)
            return None
        self._build_for(x)
        given = compat.check_input_shapes(self._source, x)
        # (None for an optional=True input: the first stage's layers get None, as in Keras' Functional model;
        # one a later stage reads would have to cross, which None cannot)
        absent = []
        if any(value is None for value in given):  # (rare: the crossings are not looked through every step)
            crossing = {c.tensor for c in self.engine.cut.crossings}
            inputs = zip(self._source.inputs, self.engine.cut.graph.inputs, given)
            absent = [t.name for t, k, v in inputs if v is None and k in crossing]
        if absent:
            raise PipelineConfigError(
                f"the optional inputs {absent} were given None, and a later stage reads them: keras_pipe sends a "
                "tensor's rows between stages and cannot send None. Give them a tensor, or keep the layers that "
                "read them on the first stage (split_before=...)."
            )
        if not self.engine.is_first:
            return None
        return compat.standardize_inputs(self._source, x)

    def _step(self, data, phase: str):
        engine = self.engine
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if phase == "train" and y is None and compat.compiled_loss(self) is not None:
            # every rank was given the same kind of data
            raise PipelineConfigError("fit() was given no y: training a PipelineModel with a loss needs targets.")
        batch_size = batch_size_of(data)
        flat_x = self._inputs(x)
        y = _as_numpy(y)
        if self._stand_in_inputs and stood_in(y):  # (not with class_weight; not train_on_batch's y)
            y = target_likes(y)  # (no bytes: their shapes and dtypes only)
        sample_weight = _as_numpy(sample_weight)
        if engine.num_stages > 1 and any(
            isinstance(a, (tf.RaggedTensor, tf.SparseTensor)) for a in keras.tree.flatten((y, sample_weight))
        ):  # (every rank was given the same kind of data)
            raise PipelineConfigError(
                "ragged or sparse labels cannot travel from the first stage, which pairs them with the inputs, to the "
                "last, which computes the loss: give dense labels (padded, with sample weights), or train on one rank."
            )
        y, sample_weight = engine.predictions.exchange_targets(y, sample_weight, batch_size, engine.chunks)
        if phase == "train" and self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        loss = self._microbatch_loss(y)
        loss_part, terms, flat = engine.run(phase, flat_x, batch_size, y, sample_weight, loss, self.optimizer)
        self._pipeline_logs = self._logs.step_logs(phase, loss_part, terms, batch_size, y, flat, sample_weight)
        return self._pipeline_logs

    def _flatten_metrics_in_order(self, logs):
        # The logs are in the last stage's order on every rank (see _metric_results).
        order = self._logs.order
        if order is None or not set(order) <= set(logs):
            return super()._flatten_metrics_in_order(logs)
        values = [logs[name] for name in order] + [logs[name] for name in logs if name not in order]
        return values[0] if len(values) == 1 else values

    def get_metrics_result(self) -> dict:
        """The latest logs, identical on every rank (the last stage's metrics, all stages' loss)."""
        if self._pipeline_logs is not None:
            return dict(self._pipeline_logs)
        return super().get_metrics_result()

    @property
    def metrics(self) -> list:
        """As ``keras.Model.metrics``; on a rank without the last stage, the compiled metrics' names and directions.

        What a monitoring callback with ``mode="auto"`` asks (does
        ``val_accuracy`` go up?): every rank answers as the last stage,
        which holds the compiled metrics, once the first step has shared them.
        """
        metrics = super().metrics
        logs = self.__dict__.get("_logs")  # (None while keras.Model.__init__ runs)
        return metrics if logs is None else logs.answered(metrics)

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
                if len(outputs) == 1:
                    return outputs[0]
                return keras.tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

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
        """As ``keras.Model.evaluate``, pipelined; every rank returns the same values, in Keras' order."""
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
        """Every weight of the model, in the unsplit model's order, on every rank (collective)."""
        self.build()
        return _weights.gather(self.engine)

    @collective
    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets the whole model's weights from rank 0's list, in the unsplit model's order (collective)."""
        self.build()
        _weights.assign(self.engine, weights)

    @collective
    def count_params(self) -> int:
        """The whole model's parameters, every stage's, as ``keras.Model.count_params`` (collective if unbuilt).

        This rank's own: ``sum(v.numpy().size for v in model.weights)``:
        ``weights``, ``trainable_variables`` and the optimizer's variables are
        this rank's stage's.
        """
        self.build()
        return int(sum(np.prod(v.shape, dtype=np.int64) for v, _, _ in _weights.ordered(self.engine)))

    # -- keras_hub's task methods (keras_pipe.model.hub) ---------------------------------------

    @collective
    def save_to_preset(self, preset_dir) -> None:
        """As a keras_hub task's ``save_to_preset``: rank 0 writes the whole model's preset, trained weights and all."""
        hub.save_to_preset(self, preset_dir)

    @collective
    def save_lora_weights(self, filepath) -> None:
        """As keras_hub's ``backbone.save_lora_weights``: every stage's LoRA kernels in keras_hub's one file."""
        hub.save_lora_weights(self, filepath)

    @collective
    def load_lora_weights(self, filepath) -> None:
        """As keras_hub's ``backbone.load_lora_weights``; each rank reads its own stage's kernels."""
        hub.load_lora_weights(self, filepath)

    def generate(self, *args, **kwargs):
        """Refused on every rank, naming the route that works (see :func:`keras_pipe.model.hub.generate`)."""
        hub.generate(self)

    @collective
    def quantize(self, mode=None, config=None, filters=None, **kwargs) -> None:
        """As ``keras.Model.quantize``, where every rank holds the whole model (one stage); then built anew.

        The stage's compiled functions read the layers' old variables, so the
        pipeline is cut and built again over the quantized layers. With
        several stages each rank holds only some layers' weights and could
        quantize only those: refused on every rank; quantize the Keras model
        first and pipeline the quantized model (``PipelineModel.from_model``).
        """
        if self.engine.num_stages > 1:
            raise PipelineConfigError(
                f"quantize() on a PipelineModel cut into {self.engine.num_stages} stages: each rank holds only its "
                "stage's weights. Quantize the Keras model before pipelining it: model.quantize(mode), then "
                "PipelineModel.from_model(model, ...)."
            )
        super().quantize(mode, config=config, filters=filters, **kwargs)
        if self.engine.built:
            self._unbuild()
            self._build()

    @collective
    def summary(self, print_fn=None, **kwargs) -> None:
        """Prints, on rank 0, each node with its stage, output shape and parameters, and what crosses (collective).

        A model whose input is not known yet is listed unbuilt, as ``Sequential`` lists it.
        """
        print_fn = print_fn or (lambda line: print(line, file=sys.stdout))
        if not self.engine.built and self._source is None and self._pipeline_input is None:
            if self.engine.world.rank == 0:
                print_fn(f'PipelineModel "{self.name}": not built yet (its input shape is unknown); layers:')
                for layer in self._pipeline_layers:
                    print_fn(f"  {layer.name} ({type(layer).__name__})")
            return
        self.build()
        if self.engine.world.rank != 0:
            return
        for line in summaries.describe(self.engine, self.name):
            print_fn(line)


def _as_numpy(value):
    """Labels or sample weights as numpy arrays, in their structure (sparse and ragged tensors as they are)."""
    if value is None:
        return None

    def convert(array):
        if array is None or isinstance(array, (tf.SparseTensor, tf.RaggedTensor)):
            return array
        return np.asarray(array)

    return keras.tree.map_structure(convert, value)
