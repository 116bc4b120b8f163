"""Internal: the pipeline under one ``PipelineModel`` — topology, cut, stage, steps, logs.

The engine owns everything that spans ranks: the communicators and the
layout (:mod:`keras_pipe.mpi.topology`), the model's graph and its cut
(:mod:`keras_pipe.graph.graph`, :mod:`keras_pipe.graph.cut`), this rank's stage
(compute, links, executor), the per-step agreement and the log sharing;
it holds the actions it runs (``actions``, a
:class:`~keras_pipe.engine.stage_actions.StageActions`) and the exchange of
targets and predictions (``predictions``, a
:class:`~keras_pipe.engine.predictions.PredictionExchange`).
``PipelineModel`` is a thin Keras façade over it; saving, weights, the
timeline and the benchmarks use the engine's public attributes below, never
the façade's private ones.

Building is an explicit collective step (:meth:`Engine.build`): nothing
communicates behind a property.
"""

from __future__ import annotations

import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.engine import probe, recut
from keras_pipe.engine.allreduce import ReplicaReducer, TiedReducer
from keras_pipe.engine.batch import Batch
from keras_pipe.engine.chunks import Chunk, ChunkComm, Mailbox, ranks_of_virtual_stages
from keras_pipe.engine.consistency import StepAgreement
from keras_pipe.engine.executor import Executor, rows
from keras_pipe.engine.links import Links
from keras_pipe.engine.logs import LogSharing
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.engine.predictions import PredictionExchange
from keras_pipe.engine.profile import balance_by_time
from keras_pipe.engine.stage_actions import StageActions
from keras_pipe.errors import PipelineConfigError
from keras_pipe.graph import cut as cuts
from keras_pipe.graph import graph as graphs
from keras_pipe.mpi.runtime import join_job
from keras_pipe.schedules import schedule
from keras_pipe.schedules.auto import CANDIDATES, SchedulePicker, microbatch_candidates
from keras_pipe.stage.compute import Masked, StageCompute
from keras_pipe.stage.losses import divisor_shares
from keras_pipe.stage.microbatch import microbatch_bounds, replica_bounds


class Engine:
    """The pipeline of one model on this rank (collective to create: every rank creates one).

    Made of the pipeline's :class:`~keras_pipe.engine.options.PipelineOptions` as given, which it resolves
    against the world once it has joined the job and keeps as ``options`` (``num_microbatches``, ``schedule``,
    ``num_chunks`` and ``recompute`` read them).

    Public attributes: ``world``, ``pipeline`` and ``replicas`` (the
    communicators), ``layout``, ``stage``/``replica`` (this rank's place),
    ``num_stages``/``num_replicas``, ``num_microbatches``, ``schedule``, and
    once built ``graph`` (the model's :class:`~keras_pipe.graph.graph.ModelGraph`),
    ``cut``, ``balance``, ``compute`` (this stage) and ``executor``; ``actions``
    (which actions this rank runs) and ``predictions`` (targets and predictions across ranks).
    """

    def __init__(self, options: PipelineOptions):
        topology = join_job(options.num_stages, options.stall_timeout)
        self.world = topology.world
        self.pipeline = topology.pipeline
        self.replicas = topology.replicas
        self.layout = topology.layout
        self.stage = topology.stage
        self.replica = topology.replica
        self.num_stages = self.layout.num_stages
        self.num_replicas = self.layout.num_replicas
        # (every default filled in and every rule checked there, once: keras_pipe.engine.options)
        self.options = options.resolve(self.num_stages)
        self.picker = None
        auto_microbatches = self.options.auto_microbatches
        if self.schedule == "auto" or auto_microbatches:
            candidates = (self.schedule,)
            if self.schedule == "auto":  # (ZB-V's other cut: kept only where the model can be cut for it, at build)
                candidates = CANDIDATES + (("zb-v",) if self.num_stages > 1 else ())
            self.picker = SchedulePicker(
                self.num_stages,
                None if auto_microbatches else self.options.num_microbatches,
                candidates=candidates,
                microbatch_counts=microbatch_candidates(self.num_stages) if auto_microbatches else None,
            )
        self._placings: dict = {}  # (auto, while it times: each placement's engine attributes, engine.recut.PLACED)
        # Several chunks a rank: the model is cut into num_stages * num_chunks virtual stages, placed as
        # the schedule says (keras_pipe.engine.chunks); the first is always on the first rank, the last not
        # always on the last (ZB-V's V ends where it began).
        self._place(self.schedule, self.options.num_chunks)
        self.is_first = self.stage == 0
        first_stages = [pipeline[0] for pipeline in self.layout.pipelines] if self.num_replicas > 1 else []
        self.steps = StepAgreement(self.world, data_ranks=first_stages)
        self.logs = LogSharing(self.world, source=self.layout.rank_of(0, self.last_rank))
        self.where = f"stage {self.stage}" + (f" of replica {self.replica}" if self.replicas is not None else "")
        self.graph: graphs.ModelGraph | None = None
        self.cut: cuts.Cut | None = None
        self.balance = None
        self.compute: StageCompute | None = None
        self.executor: Executor | None = None
        self.links: Links | None = None
        self.chunks: list[Chunk] = []  # this rank's virtual stages (one, but with a chunked schedule)
        self.masks: dict | None = None  # each tensor's Keras mask, measured on real tensors (first batch)
        self._tracer = None
        self.jit, self.eager, self.frozen = "auto", False, False
        self._warned_norms: set = set()  # the trainable BatchNormalization layers when last warned about

    def _place(self, name: str, num_chunks: int) -> None:
        """The placement of schedule ``name``'s ``num_chunks`` chunks a rank, and what follows from it: which rank
        computes the loss (``last_rank``, ``is_last``), this rank's actions and the exchange of targets."""
        self.num_chunks = num_chunks
        self.placement = schedule.placement(name, self.num_stages, num_chunks)
        self.virtual_ranks = ranks_of_virtual_stages(self.placement)
        self.last_rank = self.virtual_ranks[-1]  # (the pipeline rank that computes the loss)
        self.actions = StageActions(name, self.picker, self.num_stages, self.stage, num_chunks, self.placement)
        self.is_last = self.stage == self.last_rank
        self.predictions = PredictionExchange(
            self.pipeline,
            self.replicas,
            self.num_replicas,
            self.num_stages,
            self.last_rank,
            self.stage == 0,
            self.is_last,
        )
        if getattr(self, "logs", None) is not None:
            self.logs.source = self.layout.rank_of(0, self.last_rank)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per batch (``"auto"``: the next step's, the pick's once made)."""
        return self.options.num_microbatches if self.picker is None else self.picker.microbatches()

    schedule = property(lambda self: self.options.schedule, doc='The schedule\'s name (``"auto"`` too).')
    recompute = property(lambda self: self.options.recompute, doc="Activation recomputation.")

    def configure(self, jit, eager: bool, frozen: bool = False) -> None:
        """How the stage compiles its programs (``compile(jit_compile=True | False | "auto", run_eagerly=...)``).

        ``frozen``: the model's ``trainable`` is ``False`` (its layers' own flags stay as they are, as in Keras).
        """
        self.jit, self.eager, self.frozen = jit, eager, frozen
        self._check_weights_unchanged()
        for chunk in self.chunks:
            chunk.compute.configure(jit, eager, frozen)
        if self.graph is not None:  # (a layer unfrozen since, as in the second phase of Keras' fine-tuning guide)
            self._check_batch_statistics(self.graph)

    @property
    def built(self) -> bool:
        return self.compute is not None

    # -- building (collective) -------------------------------------------------

    def build(self, model: keras.Model, batch_size: int | None = None, release: bool = True) -> list:
        """Cuts the Functional ``model``'s graph into stages and builds this rank's (collective); returns its layers.

        ``batch_size``: the first batch's, where known: ``balance="time"``
        measures with one micro-batch of it (else with 32 rows). With
        ``release=False`` the other stages' weights stay where they are
        allocated (until :meth:`release_others`).
        """
        # (auto timing ZB-V: the graph fine enough for its 2P virtual stages, which serves one stage a rank too)
        model_graph = graphs.from_model(model, self.num_stages * max(self.num_chunks, 2 if self._times_v() else 1))
        rows = max(1, batch_size // self.num_microbatches) if batch_size else 32
        plain = model_graph.plain
        if not plain.nodes:
            raise PipelineConfigError("the PipelineModel has no layers; pass a list of layers.")
        nested = sorted(
            {
                sub.name
                for call in model_graph.calls
                if call.layer is not None
                for sub in compat.sublayers(call.layer)
                if getattr(sub, "_keras_pipe_pipeline", False)
            }
        )
        if nested and self.num_stages > 1:  # (the same graph on every rank: raised on every rank)
            raise PipelineConfigError(
                f"the PipelineModels {nested} are layers of this one: a pipeline over every rank cannot run inside "
                "one stage of another. Nest their keras.Model (pipeline.to_keras(), or the graph they were made of) "
                "and pipeline the whole."
            )
        if len(plain.nodes) < self.num_stages and self.world.rank == 0:
            warnings.warn(
                f"{self.num_stages} stages but the model has only {len(plain.nodes)} layers: the last "
                f"{self.num_stages - len(plain.nodes)} stages hold none (the last receives the outputs and computes "
                f"the loss) and their ranks idle. Run with at most {len(plain.nodes)} ranks "
                f"(mpirun -n {len(plain.nodes)}) or add layers.",
                stacklevel=4,
            )
        virtual = self.num_stages * self.num_chunks
        try:
            sizes = self._sizes(model_graph, virtual, rows)
        except PipelineConfigError as error:
            if self.num_chunks == 1:
                raise
            raise PipelineConfigError(
                f"{error} (with {self.num_chunks} chunks a rank there are {virtual} virtual stages: balance lists "
                f"{virtual} sizes, split_before {virtual - 1} names)"
            ) from None
        if self._times_v():
            self._check_v_cut(model_graph)
        return self._finish_build(model_graph, cuts.cut(plain, sizes), sizes, release)

    def _times_v(self) -> bool:
        """Whether ``"auto"`` still has ZB-V, whose cut is not this one, among its candidates."""
        return self.picker is not None and self.picker.picked is None and "zb-v" in self.picker.schedules()

    def _v_sizes(self, model_graph) -> list[int]:
        """The nodes of each of ZB-V's ``2P`` virtual stages, balanced by parameter count as ``balance=None`` does."""
        return cuts.balance_by_cost([node.cost for node in model_graph.plain.nodes], 2 * self.num_stages)

    def _check_v_cut(self, model_graph) -> None:
        """Drops ZB-V from ``"auto"``'s candidates where its cut is not this model's to make (the same on every
        rank): a cut the user gave (``balance``, ``split_before``: for one stage a rank), fewer layers than its
        ``2P`` virtual stages."""
        problem = None
        if self.options.balance is not None or self.options.split_before is not None:
            problem = "balance or split_before give one stage a rank"
        elif len(model_graph.plain.nodes) < 2 * self.num_stages:
            problem = f"{len(model_graph.plain.nodes)} layers, fewer than its {2 * self.num_stages} virtual stages"
        else:
            try:
                cuts.cut(model_graph.plain, self._v_sizes(model_graph))
            except PipelineConfigError as error:
                problem = str(error)
        if problem is not None:
            self.picker.drop("zb-v", problem)

    def _sizes(self, model_graph, virtual: int, rows: int) -> list[int]:
        """Nodes per (virtual) stage, as ``split_before`` or ``balance`` say."""
        plain = model_graph.plain
        balance, split_before = self.options.balance, self.options.split_before
        if split_before is not None:
            sizes = cuts.sizes_before(plain, list(split_before), virtual)
        elif balance is None:
            sizes = cuts.balance_by_cost([node.cost for node in plain.nodes], virtual)
        elif isinstance(balance, str) and balance == "time":
            if self.num_chunks > 1:
                raise PipelineConfigError(
                    f"balance='time' times one stage a rank; with num_chunks={self.num_chunks} give balance=None "
                    f"(parameter counts) or a list of {virtual} sizes, one a virtual stage."
                )
            sizes = balance_by_time(model_graph, self.num_stages, self.world, self.stage, rows)
        else:
            sizes = cuts.sizes_of_layers(plain, balance, virtual)
        return sizes

    def _finish_build(self, model_graph, the_cut, sizes, release: bool) -> list:
        """This rank's chunks of ``the_cut``: their weights allocated, computes, links and the executor."""
        self.graph, self.cut, self.balance = model_graph, the_cut, list(sizes)
        self._built_counts = self._weight_counts()
        own = [model_graph.units[unit] for unit in self.stage_units()]
        graphs.allocate(own)
        self._check_batch_statistics(model_graph)
        mailbox = Mailbox()  # (what this rank's chunks hand each other: engine.chunks)
        self.chunks = [self._chunk(k, mailbox) for k in self.placement[self.stage]]
        self.compute, self.links = self.chunks[0].compute, self.chunks[0].links
        reducer = ReplicaReducer(self.replicas) if self.replicas is not None else None
        tied = TiedReducer.create(self.pipeline, the_cut, self.stage, model_graph, self.virtual_ranks)
        pipeline_sum = self.pipeline.allreduce_sum if self.num_stages > 1 else None
        self.executor = Executor(
            self.compute,
            self.links,
            reducer,
            self.is_first,
            self.is_last,
            self.world,
            self.where,
            pipeline_sum,
            tied,
            chunks=self.chunks,
        )
        self.executor.tracer = self._tracer
        if release:
            self.release_others()
        return own

    def _chunk(self, k: int, mailbox: Mailbox) -> Chunk:
        """Virtual stage ``k`` of the cut (this rank's stage, with one chunk a rank): its compute and links.

        ``mailbox``: what this rank's chunks hand each other (:class:`~keras_pipe.engine.chunks.Mailbox`)."""
        the_cut, model_graph = self.cut, self.graph
        plain = model_graph.plain
        stage = the_cut.stages[k]
        own = [model_graph.units[unit] for unit in stage.units]
        calls = [model_graph.calls[n] for n in stage.nodes]
        last = len(the_cut.stages) - 1
        output_structure = model_graph.output_structure() if k == last else None
        regularized = [model_graph.units[u] for u in stage.units if min(the_cut.shared.get(u, [k])) == k]
        compute = StageCompute(
            stage, calls, plain, own, self.jit, self.eager, self.recompute, output_structure, regularized, self.frozen
        )
        links = None
        if self.num_chunks > 1:
            links = Links(ChunkComm(self.pipeline, self.virtual_ranks, k, mailbox), stage, plain.tensors)
        elif self.num_stages > 1:
            links = Links(self.pipeline, stage, plain.tensors)
        return Chunk(compute, links, k == 0, k == last)

    def reset(self) -> None:
        """Forgets the cut and the stage (one rank, whose layers changed: it is built again)."""
        self.graph = self.cut = self.balance = self.compute = self.executor = self.links = self.masks = None
        self.chunks = []
        self._placings.clear()
        self.actions.forget()

    def release_others(self) -> None:
        """Frees the weights of the layers other stages hold (a model handed in built had them all)."""
        held = set(self.stage_units())
        graphs.release([layer for unit, layer in self.graph.units.items() if unit not in held])

    def _weight_counts(self) -> dict:
        return {unit: len(layer.weights) for unit, layer in self.graph.units.items()}

    def _check_weights_unchanged(self) -> None:
        """Raises (on every rank: every rank holds every layer object) where layers gained or lost weights since the
        pipeline was made: LoRA enabled, or a layer quantized, on the model handed in. The cut, the stages' weights,
        ``get_weights`` and saving were made from the weights the layers held then."""
        if self.graph is None:
            return
        changed = sorted(unit for unit, count in self._weight_counts().items() if count != self._built_counts[unit])
        if changed:
            raise PipelineConfigError(
                f"the layers {changed[:5]} hold other weights than when the pipeline was made (LoRA enabled or a "
                "layer quantized after PipelineModel.from_model?). Change the Keras model first (enable_lora, "
                "quantize), then make the pipeline of it."
            )

    def _check_batch_statistics(self, model_graph) -> None:
        """Batch normalization computing statistics per micro-batch: refused with ``num_microbatches="auto"``
        (each candidate m would train differently), warned of otherwise (training differs from ``Sequential``)."""
        if self.num_microbatches > 1:
            # (with replicas, statistics are also per replica, as in any data-parallel Keras)
            # (a frozen one, trainable=False, normalises with its moving statistics: nothing differs)
            # (on every rank, nested ones too: keras_hub's CNN blocks hold theirs inside composite layers)
            # (nor one a subclassed model's call() runs with training=False of its own: graph.NodeCall.training)
            normalising = list(
                dict.fromkeys(
                    sub.name
                    for call in model_graph.calls
                    if call.layer is not None and call.training is not False
                    for sub in compat.sublayers(call.layer)
                    if isinstance(sub, keras.layers.BatchNormalization) and sub.trainable
                )
            )
            if normalising and self.options.auto_microbatches:
                raise PipelineConfigError(
                    f"num_microbatches='auto' times several numbers of micro-batches, but {len(normalising)} "
                    f"BatchNormalization layers ({', '.join(normalising[:4])}) compute their statistics per "
                    "micro-batch, so each would train differently: give num_microbatches (1 trains as Sequential)."
                )
            new = set(normalising) - self._warned_norms
            self._warned_norms = set(normalising)
            if new:
                warnings.warn(
                    f"{len(normalising)} BatchNormalization layers ({', '.join(normalising[:4])}"
                    f"{', ...' if len(normalising) > 4 else ''}) compute their statistics per micro-batch "
                    f"({self.num_microbatches} per batch), so training differs from Sequential; use "
                    "num_microbatches=1 or a normalisation without batch statistics (LayerNormalization).",
                    stacklevel=4,
                )

    def measure(self, x: list | None) -> None:
        """The first batch's real forward (collective over the pipeline): what each crossing carries.

        ``x``: first stage, the batch's model inputs; the first micro-batch's rows are used.
        """
        if self.masks is not None:
            return
        sample = None
        if self.is_first:
            present = next(t for t in x if t is not None)  # (None: an optional input not given)
            first = microbatch_bounds(int(present.shape[0]), self.num_microbatches)[0][1]
            sample = [rows(t, 0, first) for t in x]
        self.world.doing = "measuring the model's masks and shapes on the first micro-batch"
        parts = [(chunk.compute.stage, chunk.compute.calls, chunk.links) for chunk in self.chunks]
        # The measuring forward is not one of the model's calls: what it changes in the layers' state (a layer
        # counting its calls, a statistic updated in the forward) is put back, so that the state is Keras'.
        state = [
            (v, v.numpy())
            for unit in self.stage_units()
            for v in self.graph.units[unit].non_trainable_variables
            if not compat.unallocated(v)
        ]
        measured, notes = probe.measure(None, None, None, self.pipeline, sample, eager=self.eager, chunks=parts)
        for variable, value in state:
            variable.assign(value)
        if notes and self.options.auto_microbatches:  # (the same on every rank)
            raise PipelineConfigError(
                "num_microbatches='auto' times several numbers of micro-batches, each of which would train this "
                "model differently: " + notes[0]
            )
        for note in notes:  # (the same on every rank)
            warnings.warn(note, stacklevel=2)
        problems = probe.differences(self.cut.graph, measured) + probe.rows_not_first(self.cut, measured)
        if problems:
            raise PipelineConfigError(
                "the model's tensors do not have the shapes its graph says: " + "; ".join(problems[:5])
            )
        self.masks = probe.masks_of(self.cut.graph, measured)
        for chunk in self.chunks:
            chunk.compute.set_masks(self.masks)
            if chunk.links is not None:
                chunk.links.set_masks(self.masks)
        self.actions.forget()

    def output_masked(self) -> list[bool]:
        """For each flat model output, whether it carries a Keras mask (measured; the graph's until then)."""
        masks = self.masks or {t: tensor.mask for t, tensor in enumerate(self.cut.graph.tensors)}
        return [masks.get(t) is not None for t in self.cut.graph.outputs]

    @property
    def tracer(self):
        """The :class:`~keras_pipe.engine.tracing.Tracer` the executor reports spans to (``None``: no tracing)."""
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

    def run(self, phase: str, x, batch_size: int, y=None, sample_weight=None, loss=None, optimizer=None):
        """Runs one global batch through this stage: ``(loss share, term values, flat predictions)``.

        ``x`` is the flat list of model inputs (first stage), ``y`` and
        ``sample_weight`` the global batch's (last stage). ``predictions`` are
        the global batch's flat model outputs on the last stage (every
        replica's share, gathered), else ``None``.
        """
        batch = self._batch(phase, x, batch_size, y, sample_weight, loss, optimizer)
        bounds = batch.bounds
        actions = self.actions.for_batch(self.chunks, phase, len(bounds), batch.whole_batch_loss) if bounds else []
        result = self.executor.run(actions, batch)
        if not self.is_last:
            return result.loss_part, None, None
        outputs = len(self.cut.graph.outputs)
        parts = [p for p in result.predictions if p is not None] or [
            self.predictions.none(phase, self.cut.graph, self.masks)
        ]
        flat = []
        for k in range(outputs):
            pieces = [p[k] for p in parts]
            if isinstance(pieces[0], Masked):
                flat.append(Masked(*(tf.concat(part, axis=0) for part in zip(*pieces))))
            else:
                flat.append(tf.concat(pieces, axis=0))
        return result.loss_part, result.terms, [self.predictions.gather_replicas(p, batch_size) for p in flat]

    def _batch(self, phase: str, x, batch_size: int, y, sample_weight, loss, optimizer) -> Batch:
        """The batch as this rank's executor runs it (its micro-batches' rows; the loss's shares on the last rank)."""
        self.measure(x)
        if loss is not None:
            loss.masked = self.output_masked()  # (known once measured, on the first batch)
        first, last = replica_bounds(batch_size, self.num_replicas)[self.replica]
        bounds = (
            [(first + a, first + b) for a, b in microbatch_bounds(last - first, self.num_microbatches)]
            if (last > first)
            else []
        )
        if bounds and phase == "train":
            self.compute.estimate_holding(bounds[0][1] - bounds[0][0])
        whole = phase != "predict" and loss is not None and loss.whole_batch()
        shares = term_weights = None
        if loss is not None and self.is_last:
            shares = divisor_shares(loss.reductions(), bounds, sample_weight, batch_size, [p for p, *_ in loss.terms])
            term_weights = np.asarray(loss.weights(), np.float64)
        return Batch(
            phase=phase,
            batch_size=batch_size,
            bounds=bounds,
            x=x,
            y=y,
            sample_weight=sample_weight,
            loss=loss if self.is_last else None,
            shares=shares,
            term_weights=term_weights,
            optimizer=optimizer,
            regularize=self.replica == 0 and phase != "predict",
            whole_batch_loss=whole,
        )

    # -- schedule="auto" (collective) -------------------------------------------------------

    def picking(self) -> bool:
        """Whether the next training step first times ``"auto"``'s candidates (:meth:`pick_schedule`)."""
        return self.picker is not None and self.picker.picked is None and self.built

    def pick_schedule(self, x, batch_size: int, y, sample_weight, loss, optimizer) -> None:
        """Times ``"auto"``'s candidates on this batch, then every rank takes the fastest (collective).

        Each candidate runs warm-up and timed steps in turn on the batch
        (:class:`~keras_pipe.schedules.auto.SchedulePicker`); none of them
        trains: each updates a copy of ``optimizer`` (not yet built: it is
        built once the pick is made, on the variables the picked cut places
        here) and every variable this rank held is put back afterwards
        (:mod:`keras_pipe.engine.recut`). A candidate that cuts the model
        otherwise (ZB-V's V of ``2P`` virtual stages) is built beside this
        cut while the timing lasts, its weights copied from the ranks that
        hold them; the cut not picked is freed.
        """
        picker = self.picker
        tracer, self.tracer = self._tracer, None  # (a timeline sees the batch's real step, not the timing)
        if optimizer is not None and optimizer.built and self._times_v():
            # (built on this cut's variables already: a restored optimizer state; the same on every rank)
            picker.drop("zb-v", "the optimizer was built before the first training step, on one stage a rank")
        keys = {}
        for name in picker.schedules():  # (every placement built, and its weights copied, before the timing)
            self._switch(name)
            keys[name] = recut.key_of(self.placement)
        held = [self.graph.units[u] for state in self._placings.values() for u in self._units_of(state)]
        snapshot = recut.Snapshot(held + [self.graph.units[u] for u in self.stage_units()])
        copies = {}
        while picker.steps_left():
            name = picker.current()
            self._switch(name)
            if keys[name] not in copies:
                copies[keys[name]] = recut.timing_optimizer(optimizer) if optimizer is not None else None
                if copies[keys[name]] is not None:
                    copies[keys[name]].build(self.trainable_variables)
            self.world.doing = f"timing schedule {picker.candidate()!r} for schedule='auto'"
            batch = self._batch("train", x, batch_size, y, sample_weight, loss, copies[keys[name]])
            actions = self.actions.for_batch(self.chunks, "train", len(batch.bounds), batch.whole_batch_loss)
            began = time.perf_counter()
            self.executor.run(actions, batch)
            picker.record(time.perf_counter() - began)
        snapshot.restore()
        picker.decide(self.world.allgather_json(picker.times))
        self._switch(picker.current())
        self._placings.clear()
        self.release_others()
        for copy in (c for c in copies.values() if c is not None):  # (their programs: the user's traces its own)
            for chunk in self.chunks:
                chunk.compute.forget_optimizer(copy)
        self.tracer = tracer

    def _units_of(self, state: dict) -> list[str]:
        """The units a rank holds under another placement's ``state`` (:data:`keras_pipe.engine.recut.PLACED`)."""
        units = [u for k in state["placement"][self.stage] for u in state["cut"].stages[k].units]
        return list(dict.fromkeys(units))

    def _switch(self, name: str) -> None:
        """Makes schedule ``name``'s placement this engine's. The one-stage-a-rank cut is the one built first;
        ZB-V's V is built the first time (collective then: the weights it places elsewhere travel from the
        ranks that hold them)."""
        # (a fixed schedule timing its m alone: its own chunks, this placement; "auto"'s candidates: their defaults)
        chunks = self.options.num_chunks if name == self.schedule else schedule.default_chunks(name)
        key = recut.key_of(schedule.placement(name, self.num_stages, chunks))
        current = recut.key_of(self.placement)
        if key == current:
            return
        self._placings[current] = {attr: getattr(self, attr) for attr in recut.PLACED}
        if key in self._placings:
            for attr, value in self._placings.pop(key).items():
                setattr(self, attr, value)
            self.logs.source = self.layout.rank_of(0, self.last_rank)
            return
        owners = {unit: self.owner_of(unit) for unit in self.graph.units}
        self._place(name, chunks)
        self.masks = None
        sizes = self._v_sizes(self.graph)
        the_cut = cuts.cut(self.graph.plain, sizes)
        holders = self.holder_ranks(the_cut)
        # (before the chunks are built: a chunk takes its frozen and non-trainable variables' tf.Variable, which a
        # weight released here only has once it arrives)
        self.world.doing = f"copying the weights schedule {name!r} places on other ranks (schedule='auto')"
        recut.move_weights(self.pipeline, self.graph.units, owners, holders, self.stage)
        self._finish_build(self.graph, the_cut, sizes, release=False)

    # -- weights -------------------------------------------------------------------------

    def owner_of(self, unit: str) -> int:
        """The rank of the first stage holding ``unit``'s weights (it answers for them: saving, ``get_weights``)."""
        return self.virtual_ranks[min(s.index for s in self.cut.stages if unit in s.units)]

    def holder_ranks(self, the_cut=None) -> dict[str, set[int]]:
        """Each unit's ranks holding its weights: the ranks of its virtual stages in ``the_cut`` (this engine's cut
        by default), under this placement."""
        holders = {unit: set() for unit in self.graph.units}
        for stage in (the_cut or self.cut).stages:
            for unit in stage.units:
                holders[unit].add(self.virtual_ranks[stage.index])
        return holders

    def own_layers(self) -> list:
        """The layers (units) whose weights this rank holds, in the cut's order."""
        return [self.graph.units[unit] for unit in self.stage_units()]

    def stage_units(self) -> list[str]:
        """The units whose weights this rank holds (its chunks', in order, each once)."""
        units = [u for k in self.placement[self.stage] for u in self.cut.stages[k].units]
        return list(dict.fromkeys(units))

    @property
    def trainable_variables(self) -> list:
        """This rank's trainable variables (every chunk's), once built."""
        return [v for chunk in self.chunks for v in chunk.compute.trainable_variables]

    def stage_layers(self) -> list:
        """The layers this rank holds weights of (every chunk's), once built."""
        return [layer for chunk in self.chunks for layer in chunk.compute.layers]
