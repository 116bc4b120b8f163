"""Internal: the pipeline under one ``PipelineModel`` — topology, split, stage, steps, logs.

The engine owns everything that spans ranks: the communicators and the
layout (:mod:`keras_pipe.topology`), the layer specs and the split
(:mod:`keras_pipe.partition`), this rank's stage (compute, links, executor),
the per-step agreement and the log sharing. ``PipelineModel`` is a thin
Keras façade over it; saving, weights, the timeline and the benchmarks use
the engine's public attributes below, never the façade's private ones.

Building is an explicit collective step (:meth:`Engine.build`): nothing
communicates behind a property.
"""

from __future__ import annotations

import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import partition, schedule
from keras_pipe.allreduce import ReplicaReducer
from keras_pipe.compute import StageCompute, check_recompute
from keras_pipe.consistency import StepAgreement
from keras_pipe.devices import check_all_ranks, try_configure_gpus
from keras_pipe.errors import PipelineConfigError
from keras_pipe.executor import Batch, Executor
from keras_pipe.links import Links, Masked
from keras_pipe.logs import LogSharing
from keras_pipe.microbatch import microbatch_bounds, replica_bounds
from keras_pipe.profile import balance_by_time
from keras_pipe.runtime import init, start_entry_agreement
from keras_pipe.threads import configure_threads
from keras_pipe.topology import connect


class Engine:
    """The pipeline of one model on this rank (collective to create: every rank creates one).

    Public attributes: ``world``, ``pipeline`` and ``replicas`` (the
    communicators), ``layout``, ``stage``/``replica`` (this rank's place),
    ``num_stages``/``num_replicas``, ``num_microbatches``, ``schedule``, and
    once built ``specs``, ``balance``, ``compute`` (this stage) and
    ``executor``.
    """

    def __init__(self, num_stages, stall_timeout, num_microbatches, schedule_name: str, balance, recompute="never"):
        init()
        topology = connect(num_stages, stall_timeout)
        start_entry_agreement(topology.world)
        hosts, me = topology.layout.hosts, topology.layout.hosts[topology.world.rank]
        configure_threads(ranks_on_host=hosts.count(me))
        try_configure_gpus(local_rank=hosts[: topology.world.rank].count(me), local_size=hosts.count(me))
        check_all_ranks(topology.world)
        self.world = topology.world
        self.pipeline = topology.pipeline
        self.replicas = topology.replicas
        self.layout = topology.layout
        self.stage = topology.stage
        self.replica = topology.replica
        self.num_stages = self.layout.num_stages
        self.num_replicas = self.layout.num_replicas
        if num_microbatches is None:
            num_microbatches = 1 if self.num_stages == 1 else 2 * self.num_stages
        schedule.check_microbatches(num_microbatches)
        schedule.check_name(schedule_name)
        check_recompute(recompute)
        self.recompute = recompute
        self.num_microbatches = num_microbatches
        self.schedule = schedule_name
        self.balance_option = balance
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1
        first_stages = [pipeline[0] for pipeline in self.layout.pipelines] if self.num_replicas > 1 else []
        self.steps = StepAgreement(self.world, data_ranks=first_stages)
        self.logs = LogSharing(self.world, source=self.layout.rank_of(0, self.num_stages - 1))
        self.where = f"stage {self.stage}" + (f" of replica {self.replica}" if self.replicas is not None else "")
        self.specs = None
        self.balance = None
        self.compute: StageCompute | None = None
        self.executor: Executor | None = None
        self.input_spec = None  # (shape, dtype) of the model input
        self._schedules: dict = {}
        self._tracer = None
        self.jit, self.eager = True, False

    def configure(self, jit: bool, eager: bool) -> None:
        """How the stage compiles its programs (``compile(jit_compile=..., run_eagerly=...)``)."""
        self.jit, self.eager = jit, eager
        if self.compute is not None:
            self.compute.configure(jit, eager)

    @property
    def built(self) -> bool:
        return self.compute is not None

    # -- building (collective) -------------------------------------------------

    def build(self, layers: list, input_shape, input_dtype, rows: int = 32) -> list:
        """Splits ``layers`` over the stages and builds this rank's (collective); returns them.

        ``rows`` is the micro-batch size ``balance="time"`` measures with.
        """
        if not layers:
            raise PipelineConfigError("the PipelineModel has no layers; pass a list of layers.")
        partition.check_num_stages(len(layers), self.num_stages)
        specs = partition.infer_specs(layers, input_shape, input_dtype)
        if self.balance_option is None:
            balance = partition.balance_by_params(specs, self.num_stages)
        elif isinstance(self.balance_option, str) and self.balance_option == "time":
            balance = balance_by_time(layers, specs, self.num_stages, self.world, self.stage, rows)
        else:
            balance = partition.check_balance(self.balance_option, len(layers), self.num_stages)
        self._warn_about_batch_statistics(layers)
        start, stop = partition.stage_bounds(balance)[self.stage]
        own = layers[start:stop]
        x = specs[start].input_template
        if x is None:
            x = keras.KerasTensor(specs[start].input_shape, specs[start].input_dtype)
        x = keras.tree.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype), x)
        out = x
        for layer in own:
            out = layer(out)
        self.specs, self.balance = specs, balance
        self.input_spec = (tuple(input_shape), str(input_dtype))
        mask_in = specs[start - 1].output_mask_shape if start else None
        mask_out = specs[stop - 1].output_mask_shape if not self.is_last else None
        masked = mask_in is not None or any(spec.output_mask_shape is not None for spec in specs[start:stop])
        several = any(spec.output_template is not None for spec in specs[max(start - 1, 0) : stop])
        self.compute = StageCompute(
            own, self.is_first, self.jit, self.eager, masked, mask_out is not None, self.recompute, several
        )
        links = Links(self.pipeline, x, out, mask_in) if self.num_stages > 1 else None
        reducer = ReplicaReducer(self.replicas) if self.replicas is not None else None
        pipeline_sum = self.pipeline.allreduce_sum if self.num_stages > 1 else None
        self.executor = Executor(
            self.compute, links, reducer, self.is_first, self.is_last, self.world, self.where, pipeline_sum
        )
        self.executor.tracer = self._tracer
        return own

    def _warn_about_batch_statistics(self, layers) -> None:
        if self.num_microbatches > 1 and self.world.rank == 0:
            # (with replicas, statistics are also per replica, as in any data-parallel Keras)
            normalising = [layer.name for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]
            if normalising:
                warnings.warn(
                    f"BatchNormalization layers {normalising} compute their statistics per micro-batch "
                    f"({self.num_microbatches} per batch), so training differs from Sequential; use "
                    "num_microbatches=1 or a normalisation without batch statistics (LayerNormalization).",
                    stacklevel=4,
                )

    @property
    def tracer(self):
        """The :class:`~keras_pipe.tracing.Tracer` the executor reports spans to (``None``: no tracing)."""
        return self._tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self._tracer = tracer
        if self.executor is not None:
            self.executor.tracer = tracer

    def span(self, name: str, began: float) -> None:
        """Reports a whole-step span (log sharing, say) to the tracer."""
        if self._tracer is not None:
            self._tracer.span(name, self.executor.step - 1, -1, began, time.perf_counter())

    # -- one step ------------------------------------------------------------------

    def actions(self, phase: str, num_microbatches: int, whole_batch_loss: bool = False) -> list:
        """This stage's actions for a batch of ``num_microbatches`` (resolved once per configuration).

        ``whole_batch_loss`` (a mean loss over a masked output) trains in
        GPipe's order whatever the schedule: the last stage must count the
        whole batch's unmasked entries before its first backward.
        """
        key = (phase, num_microbatches, self.compute.split, whole_batch_loss)
        if key not in self._schedules:
            if phase != "train":
                plan = schedule.forward_only(self.num_stages, num_microbatches)
            elif whole_batch_loss:
                plan = schedule.gpipe(self.num_stages, num_microbatches, self.compute.split, whole_batch_loss=True)
            else:
                split = self.compute.split or schedule.needs_split_backward(self.schedule)
                plan = schedule.make_schedule(self.schedule, self.num_stages, num_microbatches, split)
            actions = plan[self.stage]
            if phase == "train" and not self.compute.split:
                actions = _unsplit(actions)
            self._schedules[key] = actions
        return self._schedules[key]

    def run(self, phase: str, x, y, sample_weight, loss_fn=None, loss_reduction=None, optimizer=None):
        """Runs one global batch through this stage: ``(loss share, predictions)``.

        ``predictions`` are the global batch's, on the last stage (every
        replica's share, gathered), else ``None``. ``y``/``sample_weight`` are
        the global batch's, on the last stage.
        """
        batch_size = int(x.shape[0])
        first, last = replica_bounds(batch_size, self.num_replicas)[self.replica]
        bounds = (
            [(first + a, first + b) for a, b in microbatch_bounds(last - first, self.num_microbatches)]
            if (last > first)
            else []
        )
        batch = Batch(
            phase=phase,
            batch_size=batch_size,
            bounds=bounds,
            x=x,
            y=y,
            sample_weight=sample_weight,
            loss_fn=loss_fn,
            loss_reduction=loss_reduction,
            optimizer=optimizer,
            regularize=self.replica == 0 and phase != "predict",
            whole_batch_loss=phase != "predict" and self.whole_batch_loss(loss_reduction),
        )
        actions = self.actions(phase, len(bounds), batch.whole_batch_loss) if bounds else []
        result = self.executor.run(actions, batch)
        if not self.is_last:
            return result.loss_part, None
        predictions = result.predictions or [self._no_predictions(phase)]  # (a replica with no share)
        if isinstance(predictions[0], Masked):  # with the output's Keras mask, for the metrics
            y_pred = Masked(*(tf.concat(parts, axis=0) for parts in zip(*predictions)))
        else:
            y_pred = tf.concat(predictions, axis=0)
        return result.loss_part, self.gather_replicas(y_pred, batch_size)

    def _no_predictions(self, phase: str):
        shape, dtype = self.output_spec()
        y_pred = tf.zeros((0,) + tuple(shape[1:]), dtype)
        mask = self.specs[-1].output_mask_shape
        if mask is None or phase == "predict":
            return y_pred
        return Masked(y_pred, tf.zeros((0,) + tuple(mask[1:]), tf.bool))

    def whole_batch_loss(self, loss_reduction) -> bool:
        """Whether the loss is a mean over a masked output's entries (see ``Executor``): counted over the batch."""
        masked = self.specs is not None and self.specs[-1].output_mask_shape is not None
        return masked and loss_reduction is not None and loss_reduction != "sum"

    def gather_replicas(self, y_pred, batch_size: int):
        """Last stage: the whole global batch's predictions (``Masked`` ones too), every replica's share, in order."""
        if self.replicas is None:
            return y_pred
        counts = [stop - start for start, stop in replica_bounds(batch_size, self.num_replicas)]
        if isinstance(y_pred, Masked):
            mask = self.replicas.allgather_rows(y_pred.mask.numpy().astype(np.uint8), counts)
            return Masked(self.gather_replicas(y_pred.tensor, batch_size), tf.convert_to_tensor(mask.astype(bool)))
        return tf.convert_to_tensor(self.replicas.allgather_rows(y_pred.numpy(), counts))

    def output_spec(self):
        """``(shape, dtype)`` of the model's output, known on every rank from the layer specs."""
        last = self.specs[-1]
        return last.output_shape, last.output_dtype

    def broadcast_predictions(self, y_pred, batch_size: int):
        """Every rank gets the last stage's predictions of the batch."""
        if self.num_stages == 1:
            return y_pred
        shape, dtype = self.output_spec()
        buffer = (
            y_pred.numpy()
            if self.is_last
            else np.empty((batch_size,) + tuple(shape[1:]), tf.as_dtype(dtype).as_numpy_dtype)
        )
        return tf.convert_to_tensor(self.pipeline.bcast_array(buffer, root=self.num_stages - 1))

    def exchange_targets(self, y, sample_weight, batch_size: int):
        """The first stage's labels and sample weights, on the last stage (paired with its inputs)."""
        links = self.executor.links
        if links is None:
            return y, sample_weight
        if self.is_first:
            links.send_targets(y, sample_weight)
        if self.is_last:
            return links.receive_targets(y, sample_weight, batch_size)
        return y, sample_weight

    # -- weights -------------------------------------------------------------------------

    def stage_weights(self) -> list:
        """This stage's variables, in ``Sequential`` order (``layer.weights`` of each layer)."""
        return [v for layer in self.compute.layers for v in layer.weights]

    def weight_offset(self, trainable: bool = False) -> int:
        """How many (trainable) weights the layers before this stage have."""
        start, _ = partition.stage_bounds(self.balance)[self.stage]
        field = "trainable_shapes" if trainable else "weight_shapes"
        return sum(len(getattr(spec, field)) for spec in self.specs[:start])


def _unsplit(actions: list) -> list:
    """A schedule with a split backward, for a stage that cannot split: I -> B, FI -> FB, no W."""
    renamed = {
        schedule.Kind.BACKWARD_INPUT: schedule.Kind.BACKWARD,
        schedule.Kind.FORWARD_INPUT: schedule.Kind.FORWARD_BACKWARD,
    }
    return [
        schedule.Action(renamed.get(a.kind, a.kind), a.microbatches)
        for a in actions
        if a.kind is not schedule.Kind.BACKWARD_WEIGHT
    ]
