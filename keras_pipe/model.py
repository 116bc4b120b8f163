"""``PipelineModel``: a ``keras.Sequential``-like model whose layers are split over MPI ranks."""

from __future__ import annotations

import inspect
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters.data_adapter_utils import unpack_x_y_sample_weight

from keras_pipe import compile_checks, partition, saving
from keras_pipe import weights as _weights
from keras_pipe.callbacks import adapt_callbacks
from keras_pipe.consistency import (
    COMPARED_ARGUMENTS,
    StepAgreement,
    batch_digest,
    check_same_everywhere,
    describe_argument,
    model_fingerprint,
)
from keras_pipe.errors import PipelineConfigError
from keras_pipe.failure import fail_fast, install_excepthook, mark_collective
from keras_pipe.microbatch import replica_bounds
from keras_pipe.profile import balance_by_time
from keras_pipe.schedule import SCHEDULES
from keras_pipe.stage import Stage
from keras_pipe.threads import configure_threads
from keras_pipe.topology import connect

# At import, before the script creates any tensor: TensorFlow's thread pools
# can only be sized before its first op, and an uncaught exception on any
# rank must end the job rather than leave the others waiting.
configure_threads()
install_excepthook()


class PipelineModel(keras.Model):
    """A chain of layers trained with pipeline parallelism over MPI ranks.

    Write the model as for ``keras.Sequential`` and run the same script under
    ``mpirun -n P``: the ranks of ``MPI.COMM_WORLD`` are the stages, in
    order, each owning a contiguous slice of the layers and creating weights
    for those layers only. Each batch is cut into ``num_microbatches``
    micro-batches; activations travel forward and the gradients with respect
    to them travel backward between neighbouring ranks. ``fit``,
    ``evaluate`` and ``predict`` give what ``keras.Sequential`` gives, with the
    same logs on every rank. Under plain ``python`` the whole model runs in
    one process.

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
        schedule: ``"1f1b"`` (default; at most ``P - s`` micro-batches of
            activations alive on stage ``s``) or ``"gpipe"`` (all forwards,
            then all backwards). Both give the same training result.
        num_stages: stages per pipeline. With ``W`` ranks, ``W / num_stages``
            replicas of the pipeline each train on their share of every
            batch and sum their gradients before each update (data
            parallelism); ``None`` (default) means one pipeline over every
            rank. Each pipeline's ranks sit on one host where possible (see
            :mod:`keras_pipe.layout`).
        stall_timeout: seconds a rank may wait for a neighbour before the job
            is ended with a report; default ``KERAS_PIPE_STALL_TIMEOUT`` or 600.
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
        name: str | None = None,
        trainable: bool = True,
    ):
        super().__init__(name=name, trainable=trainable)
        topology = connect(num_stages, stall_timeout)
        comm, layout = topology.world, topology.layout
        # Bookkeeping that Keras must not track as sub-layers: only this
        # rank's stage layers are tracked, so `weights`, the optimizer and
        # saving see this rank's variables only. `_comm` spans every rank,
        # `_pipe` this rank's pipeline (rank = stage), `_replicas` the ranks
        # holding the same stage (rank = replica; None with one replica).
        object.__setattr__(self, "_pipeline_layers", [])
        object.__setattr__(self, "_comm", comm)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_pipe", topology.pipeline)
        object.__setattr__(self, "_replicas", topology.replicas)
        object.__setattr__(self, "_stage", None)
        object.__setattr__(self, "_specs", None)
        self._input_shape_dtype = None
        self._balance_option = balance
        self.num_stages = layout.num_stages
        self.stage_index = topology.stage
        self.num_replicas = layout.num_replicas
        self.replica_index = topology.replica
        if num_microbatches is None:
            num_microbatches = 1 if self.num_stages == 1 else 2 * self.num_stages
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise mark_collective(
                PipelineConfigError(
                    f"num_microbatches={num_microbatches!r}: it must be a positive integer (1 means no micro-batching)."
                )
            )
        if schedule not in SCHEDULES:
            raise mark_collective(
                PipelineConfigError(
                    f"schedule={schedule!r} is not known; use one of {', '.join(map(repr, SCHEDULES))}."
                )
            )
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self._pipeline_logs = None
        self._last_batch_size = None
        self._loss_reduction = None
        self._log_layouts: dict = {}
        first_stages = [pipeline[0] for pipeline in layout.pipelines] if layout.num_replicas > 1 else []
        object.__setattr__(self, "_steps", StepAgreement(comm, data_ranks=first_stages))
        for item in layers or []:
            self.add(item)

    # -- building the model ---------------------------------------------

    def add(self, layer) -> None:
        """Appends a layer (or, first, a ``keras.Input``), as ``Sequential.add``."""
        if isinstance(layer, keras.KerasTensor) or isinstance(layer, keras.layers.InputLayer):
            if self._pipeline_layers or self._input_shape_dtype is not None:
                raise mark_collective(
                    PipelineConfigError("keras.Input can only be the first item of a PipelineModel's layer list.")
                )
            tensor = layer if isinstance(layer, keras.KerasTensor) else layer.output
            self._input_shape_dtype = (tuple(tensor.shape), str(tensor.dtype))
            return
        if not isinstance(layer, keras.layers.Layer):
            raise mark_collective(
                PipelineConfigError(f"PipelineModel takes Keras layers, got {type(layer).__name__}: {layer!r}.")
            )
        if any(layer is other for other in self._pipeline_layers):
            raise mark_collective(
                PipelineConfigError(
                    f"layer {layer.name!r} appears twice in the layer list; a pipeline is a chain in which "
                    "every layer is used once. Create a second layer instead of reusing it."
                )
            )
        if self._stage is not None:
            raise mark_collective(
                PipelineConfigError(
                    "layers cannot be added after the model was built (it is already split over the ranks); "
                    "add every layer before compile()/fit()."
                )
            )
        self._pipeline_layers.append(layer)

    @property
    def layers(self) -> list:
        """Every layer of the model, in order, on every rank (built only on its own stage)."""
        return list(self._pipeline_layers)

    @property
    def stage_layers(self) -> list:
        """The layers this rank owns."""
        self._require_built()
        return list(self._stage.layers)

    @property
    def balance(self) -> list[int] | None:
        """Layers per stage, once the model is built."""
        return getattr(self, "_balance", None)

    def build(self, input_shape=None):
        self._ensure_partitioned(input_shape=input_shape)

    def _ensure_partitioned(self, x=None, input_shape=None, input_dtype=None) -> None:
        if self._stage is not None:
            return
        if self._input_shape_dtype is not None:
            input_shape, input_dtype = self._input_shape_dtype
        elif x is not None:
            input_shape, input_dtype = (
                (None,) + tuple(x.shape[1:]),
                x.dtype.name if hasattr(x.dtype, "name") else str(x.dtype),
            )
        elif input_shape is not None:
            input_shape, input_dtype = tuple(input_shape), input_dtype or keras.config.floatx()
        else:
            raise mark_collective(
                PipelineConfigError(
                    "the input shape is unknown; start the layer list with keras.Input(shape) or call fit()."
                )
            )
        layers = self._pipeline_layers
        if not layers:
            raise mark_collective(PipelineConfigError("the PipelineModel has no layers; pass a list of layers."))
        try:
            partition.check_num_stages(len(layers), self.num_stages)
            specs = partition.infer_specs(layers, input_shape, input_dtype)
            if self._balance_option is None:
                balance = partition.balance_by_params(specs, self.num_stages)
            elif isinstance(self._balance_option, str) and self._balance_option == "time":
                rows = max(1, int(x.shape[0]) // self.num_microbatches) if x is not None else 32
                balance = balance_by_time(layers, specs, self.num_stages, self._comm, self.stage_index, rows)
            else:
                balance = partition.check_balance(self._balance_option, len(layers), self.num_stages)
        except PipelineConfigError as error:
            raise mark_collective(error) from None
        if self.num_microbatches > 1 and self._comm.rank == 0:
            # (with replicas, statistics are also per replica, as in any data-parallel Keras)
            normalising = [layer.name for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]
            if normalising:
                warnings.warn(
                    f"BatchNormalization layers {normalising} compute their statistics per micro-batch "
                    f"({self.num_microbatches} per batch), so training differs from Sequential; use "
                    "num_microbatches=1 or a normalisation without batch statistics (LayerNormalization).",
                    stacklevel=3,
                )
        start, stop = partition.stage_bounds(balance)[self.stage_index]
        own = layers[start:stop]
        x_spec = keras.KerasTensor(specs[start].input_shape, specs[start - 1].output_dtype if start else input_dtype)
        out = x_spec
        for layer in own:
            out = layer(out)
        object.__setattr__(self, "_specs", specs)
        self._balance = balance
        self._input_shape_dtype = (tuple(input_shape), str(input_dtype))
        self._stage_layers = list(own)  # tracked: these are this rank's weights
        stage = Stage(
            own,
            self.stage_index,
            self.num_stages,
            input_spec=(x_spec.shape, x_spec.dtype),
            output_spec=(out.shape, out.dtype),
            comm=self._pipe,
            replicas=self._replicas,
        )
        object.__setattr__(self, "_stage", stage)
        self.built = True
        self._sync_replicas()

    def _sync_replicas(self, optimizer: bool = False) -> None:
        _weights.copy_from_first_replica(self, optimizer)

    def _require_built(self) -> None:
        if self._stage is None:
            self._ensure_partitioned()

    def call(self, inputs, training=None):
        """Runs the whole model on ``inputs``; only possible on a single rank (use ``predict``)."""
        self._ensure_partitioned(x=inputs)
        if self.num_stages > 1:
            raise PipelineConfigError(
                f"calling a PipelineModel directly is not possible on {self.num_stages} ranks, as each rank "
                "holds only its stage's layers; use model.predict(x), which runs the pipeline."
            )
        for layer in self._stage.layers:
            inputs = layer(inputs, training=training)
        return inputs

    # -- compile ----------------------------------------------------------

    def compile(self, *args, **kwargs):
        """As ``keras.Model.compile``; refuses, on every rank, the options a pipeline cannot honour.

        ``run_eagerly=True`` runs every micro-batch op by op (for debugging);
        ``jit_compile=True`` is refused, as a step that communicates between
        micro-batches cannot be one XLA program (keras_pipe compiles each
        micro-batch's compute with ``tf.function`` and the optimizer update
        with XLA instead); ``jit_compile="auto"`` is accepted.
        """
        arguments = inspect.signature(keras.Model.compile).bind(self, *args, **kwargs).arguments
        arguments.update(arguments.pop("kwargs", {}))
        compile_checks.check_arguments(arguments)
        super().compile(*args, **kwargs)
        self._log_layouts = {}
        compile_checks.check_model(self)
        # Once per compile, not per step: how each micro-batch's loss enters the batch's.
        self._loss_reduction = compile_checks.loss_reduction(self.loss) if self.loss is not None else None
        if self._stage is not None:
            self._stage.reset_functions()

    def compile_from_config(self, config) -> None:
        """Compiles from ``get_compile_config()`` output, as ``keras.Model`` does (used when loading)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    # -- the steps ---------------------------------------------------------

    def train_step(self, data):
        """One pipelined training step on a batch; returns the same logs on every rank."""
        return self._pipeline_step(data, training=True)

    def test_step(self, data):
        """One pipelined forward pass computing loss and metrics on the last stage."""
        return self._pipeline_step(data, training=False)

    def predict_step(self, data):
        """One pipelined forward pass; every rank returns the whole batch's predictions."""
        x, _, _ = unpack_x_y_sample_weight(data)
        x = tf.convert_to_tensor(x)
        self._ensure_partitioned(x=x)
        stage = self._stage
        batch_size = int(x.shape[0])
        _, y_pred = stage.run_batch(
            self,
            x,
            None,
            batch_size,
            self.num_microbatches,
            None,
            training=False,
            with_loss=False,
            rows=self._replica_rows(batch_size),
        )
        if stage.is_last:
            y_pred = self._gather_replicas(y_pred, batch_size)
        if self.num_stages == 1:
            return y_pred
        shape, dtype = self._final_output_spec()  # known on every rank, from the layer specs
        buffer = (
            y_pred.numpy()
            if stage.is_last
            else np.empty((batch_size,) + tuple(shape[1:]), tf.as_dtype(dtype).as_numpy_dtype)
        )
        return tf.convert_to_tensor(self._pipe.bcast_array(buffer, root=self.num_stages - 1))

    def _replica_rows(self, batch_size: int) -> tuple[int, int]:
        """This replica's share of a global batch."""
        return replica_bounds(batch_size, self.num_replicas)[self.replica_index]

    def _gather_replicas(self, y_pred, batch_size: int):
        """Last stage: the whole global batch's predictions, from every replica's share, in order."""
        if self._replicas is None:
            return y_pred
        counts = [stop - start for start, stop in replica_bounds(batch_size, self.num_replicas)]
        return tf.convert_to_tensor(self._replicas.allgather_rows(y_pred.numpy(), counts))

    def _final_output_spec(self):
        last = self._specs[-1]
        return last.output_shape, last.output_dtype

    def _pipeline_step(self, data, training: bool):
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        x = tf.convert_to_tensor(x)
        self._ensure_partitioned(x=x)
        stage = self._stage
        batch_size = int(x.shape[0])
        self._last_batch_size = batch_size
        y = None if y is None else np.asarray(y)
        sample_weight = None if sample_weight is None else np.asarray(sample_weight)
        if stage.is_first and not stage.is_last:
            stage.send_targets(y, sample_weight)
        if stage.is_last and not stage.is_first:
            # The first stage's labels, so that inputs and labels stay paired
            # whatever order the other ranks read their data in.
            y, sample_weight = stage.receive_targets(y, sample_weight, batch_size)
        if training and self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        targets = (y, sample_weight) if stage.is_last else None
        stage.eager = self.run_eagerly
        stage.loss_reduction = self._loss_reduction
        loss_part, y_pred = stage.run_batch(
            self,
            x,
            targets,
            batch_size,
            self.num_microbatches,
            self.schedule,
            training=training,
            with_loss=True,
            rows=self._replica_rows(batch_size),
        )
        metrics = {}
        if stage.is_last and self._compile_metrics is not None:
            # Every replica's last stage updates its metrics with the whole
            # global batch, so metrics are exact (not averages of averages)
            # and the same on every replica.
            y_pred = self._gather_replicas(y_pred, batch_size)
            stage.update_metrics(self._compile_metrics, y, y_pred, sample_weight)
            metrics = self._metric_results()
        return self._sync_logs("train" if training else "test", loss_part, batch_size, metrics)

    def _metric_results(self) -> dict:
        results = {}
        for metric in self.metrics:
            if metric is self._loss_tracker:
                continue
            value = metric.result()
            if isinstance(value, dict):
                results.update(value)
            else:
                results[metric.name] = value
        return results

    def _sync_logs(self, kind: str, loss_part: float, batch_size: int, metrics: dict) -> dict:
        """Sums every rank's loss share and spreads the last stage's metrics, so all ranks log the same.

        Each replica's loss shares are already weighted by their samples'
        share of the global batch, so the sum over every rank is the global
        batch's loss; the metrics come from the first replica's last stage.
        """
        last = self._layout.rank_of(0, self.num_stages - 1)
        is_last = self._comm.rank == last
        if kind not in self._log_layouts:
            layout = [[name, list(np.shape(value))] for name, value in metrics.items()]
            self._log_layouts[kind] = self._comm.bcast_json(layout if is_last else None, root=last)
        layout = self._log_layouts[kind]
        values = [loss_part, float(batch_size) if self._comm.rank == 0 else 0.0]
        for name, shape in layout:
            size = int(np.prod(shape, dtype=np.int64))
            values.extend(np.ravel(metrics[name]).tolist() if is_last else [0.0] * size)
        self._comm.activity = f"{kind} step {self._stage.step - 1}: sharing the logs"
        began = time.perf_counter()
        summed = self._comm.allreduce_sum(np.asarray(values, np.float64))
        self._stage._span("share logs", -1, began)
        self._loss_tracker.update_state(np.float32(summed[0]), sample_weight=summed[1])
        logs = {"loss": float(self._loss_tracker.result())}
        offset = 2
        for name, shape in layout:
            size = int(np.prod(shape, dtype=np.int64))
            chunk = summed[offset : offset + size]
            logs[name] = float(chunk[0]) if not shape else chunk.reshape(shape)
            offset += size
        self._pipeline_logs = logs
        return logs

    def get_metrics_result(self) -> dict:
        """The latest logs, identical on every rank (the last stage's metrics, all stages' loss)."""
        if self._pipeline_logs is not None:
            return dict(self._pipeline_logs)
        return super().get_metrics_result()

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._pipeline_logs = None

    # -- the step functions Keras calls -------------------------------------

    def make_train_function(self, force=False):
        if self.train_function is None or force:
            self.train_function = self._python_step_function(self.train_step, "train")
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = self._python_step_function(self.test_step, "test")
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:

            def predict_function(data):
                outputs = []
                for step_data in data:
                    self._steps.agree("predict", True, _batch_size(step_data), self._digest(step_data))
                    outputs.append(self.predict_step(step_data))
                return outputs[0] if len(outputs) == 1 else tf.concat(outputs, axis=0)

            self.predict_function = predict_function
        return self.predict_function

    def _python_step_function(self, step, phase: str):
        # The step runs in Python so that every step communicates; the compute
        # inside it runs in compiled graphs (see keras_pipe.stage). Before each
        # step the ranks agree that all of them have a batch of the same size.
        def function(iterator):
            logs = None
            for _ in range(self.steps_per_execution):
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    data = None
                self._steps.agree(phase, data is not None, 0 if data is None else _batch_size(data), self._digest(data))
                if data is None:
                    if logs is None:
                        raise StopIteration from None
                    break
                logs = step(data)
            return logs

        return function

    def _digest(self, data) -> int:
        """With replicas, a first stage's digest of its batch (compared between replicas); else 0."""
        if data is None or self.num_replicas == 1 or self.stage_index != 0:
            return 0
        return batch_digest(unpack_x_y_sample_weight(data))

    # -- fit / evaluate / predict ---------------------------------------------

    def fit(self, *args, **kwargs):
        """As ``keras.Model.fit``, pipelined; every rank gets the same ``History``."""
        with fail_fast("fit()"):
            built_before = self._stage is not None  # building (in _begin_call or the first step) copies the weights
            arguments = self._begin_call("fit", keras.Model.fit, args, kwargs)
            if self.num_replicas > 1:
                if arguments.get("shuffle", True):
                    self._seed_shuffling()
                if built_before:
                    self._sync_replicas()  # replicas start from the same weights, as Horovod's broadcast does
            history = super().fit(**arguments)
            self._steps.agree("end", False, 0)
            return history

    def evaluate(self, *args, **kwargs):
        """As ``keras.Model.evaluate``, pipelined; every rank returns the same values."""
        with fail_fast("evaluate()"):
            arguments = self._begin_call("evaluate", keras.Model.evaluate, args, kwargs)
            result = super().evaluate(**arguments)
            self._steps.agree("end", False, 0)
            return result

    def predict(self, *args, **kwargs):
        """As ``keras.Model.predict``, pipelined; every rank returns the whole array of predictions."""
        with fail_fast("predict()"):
            arguments = self._begin_call("predict", keras.Model.predict, args, kwargs)
            result = super().predict(**arguments)
            self._steps.agree("end", False, 0)
            return result

    def _seed_shuffling(self) -> None:
        """Makes every rank's ``shuffle=True`` draw the same order (replicas share each global batch).

        Keras shuffles arrays with ``tf.random.shuffle`` under TensorFlow's
        global seed; without one, each process draws its own order. If the
        script set no seed, rank 0 draws one and every rank sets it.
        """
        from tensorflow.python.eager import context

        unseeded = context.global_seed() is None
        if all(self._comm.allgather_json(unseeded)):
            seed = int(np.random.default_rng().integers(2**31 - 1)) if self._comm.rank == 0 else None
            tf.random.set_seed(self._comm.bcast_json(seed, root=0))

    def _begin_call(self, name: str, method, args, kwargs) -> dict:
        """Binds the call's arguments, checks that every rank made the same call; only rank 0 shows progress."""
        bound = inspect.signature(method).bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        if name != "predict" and self.compiled:
            compile_checks.check_model(self)
        shared = {key: describe_argument(value) for key, value in arguments.items() if key in COMPARED_ARGUMENTS}
        shared["call"] = name
        check_same_everywhere(self._comm, f"the model and the {name}() call", {**model_fingerprint(self), **shared})
        self._steps.begin_call()
        if self._input_shape_dtype is not None:
            self._require_built()  # BackupAndRestore and friends expect a built model
        arguments["callbacks"] = adapt_callbacks(arguments.get("callbacks"), self._comm)
        if self._comm.rank != 0:
            arguments["verbose"] = 0
        return arguments

    # -- weights ------------------------------------------------------------

    def get_weights(self) -> list[np.ndarray]:
        """Every layer's weights, in layer order, on every rank (as ``Sequential.get_weights``)."""
        self._require_built()
        return _weights.gather(self)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets the whole model's weights from ``Sequential``-ordered ``weights``; each rank keeps its part."""
        self._require_built()
        _weights.assign(self, weights)

    # -- saving -------------------------------------------------------------------

    def to_sequential(self) -> keras.Sequential | None:
        """The whole model, weights and optimizer state, as a ``keras.Sequential`` on rank 0 (``None`` elsewhere).

        Collective: call it on every rank.
        """
        self._require_built()
        return saving.to_sequential(self)

    def save(self, filepath, overwrite: bool = True, zipped=None, **kwargs) -> None:
        """Writes one standard ``.keras`` file, from rank 0: the equivalent ``Sequential``.

        Call it on every rank, as in any Keras script. Plain
        ``keras.models.load_model`` opens the file in one process, without
        MPI or keras_pipe; :func:`keras_pipe.load_model` opens it on any
        number of ranks.
        """
        sequential = self.to_sequential()
        arguments = dict(kwargs, overwrite=overwrite)
        if zipped is not None:
            arguments["zipped"] = zipped
        saving.on_root(self._comm, lambda: sequential.save(filepath, **arguments), f"save {filepath}")

    def save_weights(self, filepath, overwrite: bool = True, **kwargs) -> None:
        """Writes the whole model's weights (and optimizer state) to one ``.weights.h5`` file, from rank 0."""
        sequential = self.to_sequential()
        saving.on_root(
            self._comm,
            lambda: sequential.save_weights(filepath, overwrite=overwrite, **kwargs),
            f"save weights to {filepath}",
        )

    def load_weights(self, filepath, skip_mismatch: bool = False, **kwargs) -> None:
        """Reads a ``.weights.h5`` file of this model (or its ``Sequential``) on rank 0; each stage gets its part."""
        self._require_built()

        def read():
            sequential = saving.skeleton(self)
            sequential.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
            return sequential

        saving.load_into(self, saving.on_root(self._comm, read, f"load weights from {filepath}"))

    # -- construction from Keras models ---------------------------------------

    @classmethod
    def from_sequential(cls, model: keras.Sequential, **pipeline_options) -> PipelineModel:
        """The same model as a pipeline: one line changes in an existing script.

        Layers are re-created from their configs (so that other stages'
        weights are not kept on every rank) and, if ``model`` is built, its
        weights are copied.

        Example:

        ```python
        seq = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model = PipelineModel.from_sequential(seq, num_microbatches=4)
        ```
        """
        items = []
        if model.built:
            input_shape = model.inputs[0].shape if getattr(model, "inputs", None) else model.input_shape
            items.append(
                keras.Input(
                    batch_shape=tuple(input_shape),
                    dtype=model.inputs[0].dtype if getattr(model, "inputs", None) else None,
                )
            )
        for layer in model.layers:
            items.append(type(layer).from_config(layer.get_config()))
        pipeline_options.setdefault("name", model.name)
        pipeline = cls(items, **pipeline_options)
        if model.built:
            pipeline.set_weights(model.get_weights())
        return pipeline

    def summary(self, print_fn=None, **kwargs) -> None:
        """Prints one table, on rank 0: each layer with its stage, output shape and parameters."""
        self._require_built()
        if self._comm.rank != 0:
            return
        print_fn = print_fn or (lambda line: print(line, file=sys.stdout))
        replicas = f" x {self.num_replicas} replicas" if self.num_replicas > 1 else ""
        print_fn(
            f'PipelineModel "{self.name}": {self.num_stages} stages{replicas}, '
            f"{self.num_microbatches} micro-batches, schedule {self.schedule}"
        )
        for line in partition.summary_lines(self._specs, self._balance):
            print_fn(line)
        if self._comm.size > 1:
            print_fn("Ranks:")
            for line in self._layout.describe():
                print_fn("  " + line)


def _batch_size(data) -> int:
    x, _, _ = unpack_x_y_sample_weight(data)
    first = tf.nest.flatten(x)[0]
    return int(first.shape[0])
