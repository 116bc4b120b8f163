"""``PipelineModel``: a Keras model whose graph is cut into stages over MPI ranks.

A thin Keras façade: it does what a ``keras.Model`` does (arguments,
``compile``, ``fit``/``evaluate``/``predict``, the step methods, weights,
saving, ``summary``) and hands the pipeline to its
:class:`~keras_pipe.engine.engine.Engine`. ``keras.Model`` is its one base;
its building, saving and step methods delegate to members it holds, out of
Keras' tracking: a :class:`~keras_pipe.model.building.ModelBuilder`, a
:class:`~keras_pipe.model.saving.ModelSaver` and
:class:`~keras_pipe.model.steps.ModelSteps`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from keras_pipe.engine.engine import Engine
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.model import building, compile_checks, generation, hub, saving
from keras_pipe.model import summary as summaries
from keras_pipe.model import weights as _weights
from keras_pipe.model.calls import CallPreparation, python_step_function
from keras_pipe.model.datasets import DatasetStrategy
from keras_pipe.model.logs import ModelLogs
from keras_pipe.model.steps import ModelSteps
from keras_pipe.mpi.failure import collective


def _graph_property(what: str, attribute: str, doc: str | None = None) -> property:
    """A property of the model's graph (``inputs``, ``output_shape``...); Keras' error while the graph is unknown."""
    return property(lambda self: getattr(self._builder.graph_or_raise(what), attribute), doc=doc)


@keras.saving.register_keras_serializable(package="keras_pipe")
class PipelineModel(keras.Model):
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

    _keras_pipe_pipeline = True  # (what the engine looks for among a model's layers, and from_model in the model given)

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
        engine = Engine(options)  # (it resolves and checks them against the world, once)
        # Not tracked by Keras: only this rank's stage layers are (so that
        # `trainable_variables`, the optimizer and saving see this rank's).
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "_builder", building.ModelBuilder(self, engine))  # (its layers or graph)
        object.__setattr__(self, "_saver", saving.ModelSaver(self, self._builder, engine, options))
        object.__setattr__(self, "_calls", CallPreparation(self))
        object.__setattr__(self, "_logs", ModelLogs(self))
        object.__setattr__(self, "_steps", ModelSteps(self, self._builder, engine, self._logs))
        self._stage_layers = []  # tracked by Keras: this rank's layers, hence its weights (see building)
        self._builder.start(layers, inputs, outputs, name)

    @property
    def trainable(self):
        return super().trainable

    @trainable.setter
    def trainable(self, value):
        # Keras sets the flag on the layers it tracks (this rank's stage): every rank's copy of every
        # layer takes it, so that the ranks still agree on the model (and its later stages, once built).
        keras.Model.trainable.fset(self, value)
        builder = self.__dict__.get("_builder")  # (None while keras.Model.__init__ runs)
        for layer in builder.all_layers() if builder is not None else []:
            layer.trainable = bool(value)

    @property
    def output_names(self):
        """The names of the layers that make the outputs, as a Functional model's (``compile``'s dict keys).

        ``None`` until the model's graph is known (a chain before its first use), as a ``Sequential``'s.
        """
        builder = self._builder
        return None if builder.source is None or not builder.from_graph else list(builder.source.output_names)

    def _lock_state(self):
        # As Functional's: a pipeline's tracked stage layers change when a one-rank model is rebuilt.
        pass

    num_stages = property(lambda self: self.engine.num_stages, doc="Stages per pipeline.")
    num_replicas = property(lambda self: self.engine.num_replicas, doc="Replicas of the pipeline.")
    stage_index = property(lambda self: self.engine.stage, doc="This rank's stage.")
    replica_index = property(lambda self: self.engine.replica, doc="This rank's replica.")
    num_microbatches = property(lambda self: self.engine.num_microbatches, doc="Micro-batches per batch.")
    schedule = property(lambda self: self.engine.schedule, doc="The training schedule's name.")
    balance = property(lambda self: self.engine.balance, doc="Nodes per stage, once built.")

    # -- the layers, the graph, building (model/building.py's ModelBuilder) ------------------

    def add(self, layer, rebuild: bool = True) -> None:
        """Appends a layer (or, first, a ``keras.Input``), as ``Sequential.add``."""
        self._builder.add(layer, rebuild)

    def pop(self, rebuild: bool = True):
        """Removes and returns the last layer, as ``Sequential.pop``."""
        return self._builder.pop(rebuild)

    @property
    def layers(self) -> list:
        """Every layer of the model, in order, on every rank (weights only on the stages that hold them)."""
        return self._builder.all_layers()

    @layers.setter
    def layers(self, _):
        raise self._builder.layers_reserved()

    @property
    def stage_layers(self) -> list:
        """The layers this rank holds weights of (once built: see :meth:`build`)."""
        return self._builder.stage_layers()

    @property
    def _functional(self):
        """The Functional model behind the pipeline (``Sequential._functional``'s counterpart), or ``None``."""
        return self._builder.source

    inputs = _graph_property("inputs", "inputs", "The model's inputs (KerasTensors).")
    outputs = _graph_property("outputs", "outputs", "The model's outputs.")
    input_shape = _graph_property("input shape", "input_shape", "The input shape.")
    output_shape = _graph_property("output shape", "output_shape", "The output shape.")
    input = _graph_property("input", "input")
    output = _graph_property("output", "output")

    def build(self, input_shape=None) -> None:
        """Cuts the model over the ranks and builds this rank's stage (collective: call it on every rank).

        Happens by itself on the first ``fit``/``evaluate``/``predict`` or
        call (or on ``get_weights``, ``summary``, ...), all of which every
        rank calls. ``input_shape`` (batch dimension included) is needed
        only where neither a ``keras.Input`` nor data gave it.
        """
        self._builder.build(input_shape)

    def __call__(self, *args, **kwargs):
        self._builder.called_with(args)
        return super().__call__(*args, **kwargs)

    @collective  # (eager, on several ranks: agreed on entry; one rank's error is raised on all or ends the job)
    def call(self, inputs, training=None):
        """The whole model on ``inputs``: in one process as the unsplit model; on several, pipelined (collective).

        Several ranks run ``predict``'s pipeline on the batch and every rank
        returns the outputs; a call inside a compiled function, or with
        ``training=True``, is possible on one rank only (use ``fit``).
        """
        return self._builder.call(inputs, training, pipelined=self.predict_step)

    def compute_output_spec(self, inputs, training=None, mask=None):
        """The outputs' shapes and dtypes for symbolic ``inputs``, from the graph (no rank communicates)."""
        return self._builder.compute_output_spec(inputs)

    def compute_output_shape(self, input_shape):
        """The output shape for ``input_shape``, from the graph (no rank communicates)."""
        return self._builder.compute_output_shape(input_shape)

    @classmethod
    def from_model(cls, model: keras.Model, inputs=None, **pipeline_options):
        """Any built Keras model (Sequential, Functional, keras_hub's, subclassed) as a pipeline (collective).

        Nested models are expanded into their nodes. A subclassed model's
        ``call()`` is traced on symbolic tensors (see :mod:`keras_pipe.graph.trace`)
        and checked against ``call()`` on a small real batch, or refused,
        naming the line it cannot trace; its input shapes are those it was
        built or called with, or ``inputs`` (``keras.Input``s, as ``call``
        takes them) where it was neither. Each rank keeps the
        weights of its own stage and frees the others' (the model handed in
        is consumed: use the pipeline from then on); rank 0's weights are
        the pipeline's, as for :meth:`from_sequential`. A model created
        inside :func:`keras_pipe.unallocated` holds no weights anywhere until
        each rank allocates its own stage's.

        Example:

        ```python
        lm = keras_hub.models.GPT2CausalLM(backbone=keras_hub.models.GPT2Backbone(...), preprocessor=None)
        model = PipelineModel.from_model(lm, num_microbatches=8)
        ```
        """
        return building.pipeline_of(cls, model, inputs, pipeline_options)

    @classmethod
    def from_sequential(cls, model: keras.Sequential, **pipeline_options):
        """The same model as a pipeline: one line changes in an existing script (collective).

        The layers are the model's own; if it is built, rank 0's weights are
        copied to the stages that hold them and every rank frees the others
        (use the pipeline from then on): an unseeded script trains rank 0's
        model. A Functional model goes to :meth:`from_model`.

        Example:

        ```python
        seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model = PipelineModel.from_sequential(seq, num_microbatches=4)
        ```
        """
        return building.pipeline_of_sequential(cls, model, pipeline_options)

    @property
    def distribute_strategy(self):
        """Keras' strategy; Keras' loop gets its datasets from it with tf.data's autotuning off (see datasets.py)."""
        calls = self.__dict__.get("_calls")  # (None while keras.Model.__init__ runs)
        return DatasetStrategy(super().distribute_strategy, None if calls is None else calls.feeding)

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
        arguments, jit = compile_checks.checked_arguments(self, args, kwargs)
        super().compile(**arguments, jit_compile=False)  # keras_pipe compiles its own programs
        self.engine.logs.forget()
        compile_checks.check_model(self)
        self._steps.loss = None
        self.engine.configure(jit=jit, eager=bool(self.run_eagerly), frozen=not self.trainable)

    def compile_from_config(self, config) -> None:
        """Compiles from ``get_compile_config()`` output, as ``keras.Model`` does (used when loading)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    # -- the steps (model/steps.py's ModelSteps) ----------------------------------------------

    def train_step(self, data):
        """One pipelined training step on a batch; returns the same logs on every rank."""
        return self._steps.run(data, "train")

    def test_step(self, data):
        """One pipelined forward pass computing loss and metrics on the last stage."""
        return self._steps.run(data, "test")

    def predict_step(self, data):
        """One pipelined forward pass; every rank returns the whole batch's predictions."""
        return self._steps.predict(data)

    def _flatten_metrics_in_order(self, logs):
        flat = self._logs.flatten_in_order(logs)  # (in the last stage's order on every rank)
        return super()._flatten_metrics_in_order(logs) if flat is None else flat

    def get_metrics_result(self) -> dict:
        """The latest logs, identical on every rank (the last stage's metrics, all stages' loss)."""
        if self._steps.last_logs is not None:
            return dict(self._steps.last_logs)
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
        self._steps.last_logs = None

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
            self.predict_function = self._steps.predict_function(self._calls.digest)
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

    # -- saving and loading (model/saving.py's ModelSaver) -----------------------------------

    def get_config(self) -> dict:
        """The model's configuration: its layers (or its graph's model) and the pipeline's options.

        ``from_config`` re-creates it, as ``keras.Sequential``'s does, so that
        ``pickle``, ``keras.models.clone_model`` and Keras' serialization work.
        """
        return self._saver.config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A model from :meth:`get_config` output (collective, as creating any ``PipelineModel`` is)."""
        return saving.from_config(cls, config, custom_objects)

    def save_own_variables(self, store):
        """Keras' ``saving_lib`` (``keras.saving.save_model(model, path)``): refused with several stages, which
        ``model.save`` writes; with one, as Keras."""
        self._saver.refuse_one_process_writer("keras.saving.save_model(model, ...)")
        super().save_own_variables(store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """TensorFlow's object graph (``tf.train.Checkpoint``, ``tf.saved_model.save``): refused with several
        stages, as :meth:`save_own_variables`."""
        self._saver.refuse_one_process_writer("tf.train.Checkpoint or tf.saved_model.save of the pipeline")
        return super()._trackable_children(save_type, **kwargs)

    @collective
    def __reduce__(self):
        """``pickle.dumps(model)``: the whole model, on every rank (collective), as Keras pickles a model.

        Rank 0 gathers the whole model (weights and optimizer state) and
        writes it as Keras' own pickle does (``.keras`` bytes); every rank
        gets those bytes, so each rank's pickle is the whole model, and
        ``pickle.loads`` (collective too, on any number of ranks) makes a
        pipeline of it with this one's options.
        """
        return self._saver.reduce()

    @classmethod
    def _unpickled(cls, data: bytes, options: dict):
        """The pipeline of a pickled model (collective): every rank reads the bytes; rank 0's weights are taken."""
        return saving.unpickled(cls, data, options)

    @collective
    def to_keras(self) -> keras.Model | None:
        """The whole model, weights and optimizer state, as one Keras model on rank 0 (``None`` elsewhere).

        A chain is a ``keras.Sequential``; a graph its model's own class. Rank 0
        holds the whole model: where its host has not the memory for it, every
        rank raises first, naming the sharded checkpoint
        (``save_weights("ck.weights.json")``), which needs no rank to hold it.
        """
        return self._saver.to_keras()

    to_sequential = to_keras

    @collective
    def save(self, filepath, overwrite: bool = True, zipped=None, **kwargs) -> None:
        """Writes one standard ``.keras`` file, from rank 0: the equivalent ``Sequential``.

        Rank 0 writes each layer's values as its stage sends them, holding its
        own stage and one layer. Plain ``keras.models.load_model`` opens the
        file in one process, without MPI or keras_pipe;
        :func:`keras_pipe.load_model` opens it on any number of ranks.
        """
        self._saver.save(filepath, overwrite, zipped, **kwargs)

    @collective
    def save_weights(self, filepath, overwrite: bool = True, **kwargs) -> None:
        """Writes the whole model's weights (and optimizer state) to one ``.weights.h5`` file, from rank 0, each
        stage sending its layers' values; a ``.weights.json`` path (or ``max_shard_size=``): Keras' sharded layout,
        every stage writing its own shard files, rank 0 the index last."""
        self._saver.save_weights(filepath, overwrite, **kwargs)

    @collective
    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs) -> None:
        """As ``keras.Model.export``, from rank 0: the whole model's serving artifact (a SavedModel by default).

        What Keras exports for the equivalent unsplit model; it serves in one
        process without MPI or keras_pipe (``tf.saved_model.load``). Rank 0
        holds the whole model to export it (checked against its host's memory
        first, as :meth:`to_keras`).
        """
        self._saver.export(filepath, format, verbose, input_signature, **kwargs)

    @collective
    def load_weights(self, filepath, skip_mismatch: bool = False, **kwargs) -> None:
        """Reads a ``.weights.h5`` or ``.keras`` file of this model (or its ``Sequential``) on rank 0, entry by entry,
        each stage getting its part; a ``.weights.json`` (sharded) is read by every rank, each its own values."""
        self._saver.load_weights(filepath, skip_mismatch, **kwargs)

    # -- keras_hub's task methods (keras_pipe.model.hub) ---------------------------------------

    @collective
    def save_to_preset(self, preset_dir, max_shard_size=10) -> None:
        """As a keras_hub task's ``save_to_preset``: rank 0 writes the preset, trained weights and all, each stage
        sending its layers' values as keras_hub's walk reaches them (no rank holds the whole model)."""
        hub.save_to_preset(self, preset_dir, max_shard_size)

    @collective
    def save_lora_weights(self, filepath) -> None:
        """As keras_hub's ``backbone.save_lora_weights``: every stage's LoRA kernels in keras_hub's one file."""
        hub.save_lora_weights(self, filepath)

    @collective
    def load_lora_weights(self, filepath) -> None:
        """As keras_hub's ``backbone.load_lora_weights``; each rank reads its own stage's kernels."""
        hub.load_lora_weights(self, filepath)

    @collective
    def generate(
        self,
        inputs,
        max_length: int | None = None,
        stop_token_ids="auto",
        strip_prompt: bool = False,
        *,
        num_groups: int | None = None,
    ):
        """As a keras_hub ``*CausalLM``'s ``generate()``, pipelined: every rank returns the unsplit model's result.

        The prompts' prefill runs through the stages, then each token; each
        stage runs its own decoder layers with their key/value cache, the
        last samples with the task's sampler (``compile(sampler=...)`` of the
        task before ``from_model``, or ``task.sampler``). The batch is cut
        into ``num_groups`` groups in flight together (default: the number
        of stages). See :mod:`keras_pipe.model.generation`.

        Example:

        ```python
        lm = keras_hub.models.LlamaCausalLM(backbone=..., preprocessor=None)
        model = PipelineModel.from_model(lm)
        out = model.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=[2])
        ```
        """
        return generation.generate(self, inputs, max_length, stop_token_ids, strip_prompt, num_groups)

    @collective
    def quantize(self, mode=None, config=None, filters=None, **kwargs) -> None:
        """As ``keras.Model.quantize``, where every rank holds the whole model (one stage); then built anew.

        The stage's compiled functions read the layers' old variables, so the
        pipeline is cut and built again over the quantized layers. With
        several stages each rank holds only some layers' weights and could
        quantize only those: refused on every rank; quantize the Keras model
        first and pipeline the quantized model (``PipelineModel.from_model``).
        """
        self._builder.check_quantize()
        super().quantize(mode, config=config, filters=filters, **kwargs)
        self._builder.rebuild()

    @collective
    def summary(self, print_fn=None, **kwargs) -> None:
        """Prints, on rank 0, each node with its stage, output shape and parameters, and what crosses (collective).

        A model whose input is not known yet is listed unbuilt, as ``Sequential`` lists it.
        """
        summaries.print_summary(self, self._builder, print_fn or (lambda line: print(line, file=sys.stdout)))
