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
from dataclasses import replace

import keras

from keras_pipe.engine import cutting, probe
from keras_pipe.engine.batch import StepDone, StepInputs, stage_batch
from keras_pipe.engine.consistency import StepAgreement
from keras_pipe.engine.layer_checks import LayerChecks
from keras_pipe.engine.logs import LogSharing
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.engine.picking import SchedulePicking
from keras_pipe.engine.placement import Placement
from keras_pipe.engine.stage_build import build_chunks
from keras_pipe.graph import cut as cuts
from keras_pipe.graph import graph as graphs
from keras_pipe.mpi.runtime import join_job
from keras_pipe.schedules.auto import SchedulePicker, microbatch_candidates, schedule_candidates
from keras_pipe.schedules.schedule import is_auto
from keras_pipe.stage.compute import Masked


def _placed(name: str, doc: str) -> property:
    """An attribute of the engine's current placement (:class:`~keras_pipe.engine.placement.Placement`)."""
    return property(
        lambda self: getattr(self.placed, name), lambda self, value: setattr(self.placed, name, value), doc=doc
    )


class Engine:
    """The pipeline of one model on this rank (collective to create: every rank creates one).

    Made of the pipeline's :class:`~keras_pipe.engine.options.PipelineOptions` as given, which it resolves
    against the world once it has joined the job and keeps as ``options`` (``num_microbatches``, ``schedule``,
    ``num_chunks`` and ``recompute`` read them).

    Public attributes: ``world``, ``pipeline`` and ``replicas`` (the
    communicators), ``layout``, ``stage``/``replica`` (this rank's place),
    ``num_stages``/``num_replicas``, ``num_microbatches``, ``schedule``, and
    once built ``graph`` (the model's :class:`~keras_pipe.graph.graph.ModelGraph`);
    ``placed``, the model's :class:`~keras_pipe.engine.placement.Placement` on the ranks, whose attributes the
    engine shows as its own: ``cut``, ``balance``, ``chunks``, ``compute`` (this stage), ``executor``, ``actions``
    (which actions this rank runs) and ``predictions`` (targets and predictions across ranks).
    """

    placement = property(lambda self: self.placed.ranks, doc="``placement[r]``: the virtual stages rank r holds.")
    num_chunks = _placed("num_chunks", "Chunks (virtual stages) a rank.")
    virtual_ranks = _placed("virtual_ranks", "``virtual_ranks[k]``: the pipeline rank of virtual stage k.")
    last_rank = _placed("last_rank", "The pipeline rank that computes the loss.")
    is_last = _placed("is_last", "Whether this rank computes the loss.")
    actions = _placed("actions", "The actions this rank runs (:class:`~keras_pipe.engine.stage_actions.StageActions`).")
    predictions = _placed("predictions", "Targets and predictions across ranks.")
    cut = _placed("cut", "The model's cut into (virtual) stages, once built.")
    balance = _placed("balance", "The nodes of each (virtual) stage, once built.")
    chunks = _placed("chunks", "This rank's virtual stages (one, but with a chunked schedule).")
    compute = _placed("compute", "This rank's (first chunk's) :class:`~keras_pipe.stage.compute.StageCompute`.")
    links = _placed("links", "This rank's (first chunk's) links to its neighbours.")
    executor = _placed("executor", "Runs a batch's actions on this rank's chunks.")
    masks = _placed("masks", "Each tensor's Keras mask, measured on real tensors (the first batch).")

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
        self.picker = self.auto = None
        auto_microbatches = self.options.auto_microbatches
        if is_auto(self.schedule) or auto_microbatches:
            candidates = (self.schedule,)
            if is_auto(self.schedule):  # (ZB-V's other cut: kept only where the model can be cut, at build)
                candidates = schedule_candidates(self.num_stages)
            self.picker = SchedulePicker(
                self.num_stages,
                None if auto_microbatches else self.options.num_microbatches,
                candidates=candidates,
                microbatch_counts=microbatch_candidates(self.num_stages) if auto_microbatches else None,
            )
            self.auto = SchedulePicking(self, self.picker)
        self.is_first = self.stage == 0
        first_stages = [pipeline[0] for pipeline in self.layout.pipelines] if self.num_replicas > 1 else []
        self.steps = StepAgreement(self.world, data_ranks=first_stages)
        # Several chunks a rank: the model is cut into num_stages * num_chunks virtual stages, placed as
        # the schedule says (keras_pipe.engine.chunks); the first is always on the first rank, the last not
        # always on the last (ZB-V's V ends where it began).
        self.placed = self.place(self.schedule, self.options.num_chunks)
        self.logs = LogSharing(self.world, source=self.layout.rank_of(0, self.last_rank))
        self.where = f"stage {self.stage}" + (f" of replica {self.replica}" if self.replicas is not None else "")
        self.graph: graphs.ModelGraph | None = None
        self.checks = LayerChecks()
        self._tracer = None
        self.jit, self.eager, self.frozen = "auto", False, False

    def place(self, name: str, num_chunks: int) -> Placement:
        """Schedule ``name``'s placement of ``num_chunks`` chunks a rank (not yet cut nor built)."""
        return Placement.of(
            name,
            num_chunks,
            picker=self.picker,
            pipeline=self.pipeline,
            replicas=self.replicas,
            num_replicas=self.num_replicas,
            num_stages=self.num_stages,
            stage=self.stage,
        )

    def use(self, placed: Placement) -> None:
        """Makes ``placed`` this engine's placement, whole (the rank that shares the logs is its last)."""
        self.placed = placed
        self.logs.source = self.layout.rank_of(0, placed.last_rank)

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
        self.checks.weights_unchanged(self.graph)
        for chunk in self.chunks:
            chunk.compute.configure(jit, eager, frozen)
        if self.graph is not None:  # (a layer unfrozen since, as in the second phase of Keras' fine-tuning guide)
            self.checks.batch_statistics(self.graph, self.num_microbatches, self.options.auto_microbatches)

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
        times_v = self.auto is not None and self.auto.times_v()
        # (auto timing ZB-V: the graph fine enough for its 2P virtual stages, which serves one stage a rank too)
        model_graph = graphs.from_model(model, self.num_stages * max(self.num_chunks, 2 if times_v else 1))
        cutting.check_graph(model_graph, self.num_stages, warn=self.world.rank == 0)
        rows = max(1, batch_size // self.num_microbatches) if batch_size else 32
        sizes = cutting.stage_sizes(
            model_graph, self.options, self.num_stages, self.num_chunks, rows, self.world, self.stage
        )
        if times_v:
            self.auto.check_v_cut(model_graph)
        return self.build_on(model_graph, cuts.cut(model_graph.plain, sizes), sizes, release)

    def build_on(self, model_graph, the_cut, sizes, release: bool) -> list:
        """This rank's chunks of ``the_cut`` under the current placement: their weights allocated, computes, links
        and the executor; returns this rank's layers."""
        self.graph, self.cut, self.balance = model_graph, the_cut, list(sizes)
        self.checks.record(model_graph)
        own = self.own_layers()
        graphs.allocate(own)
        self.checks.batch_statistics(model_graph, self.num_microbatches, self.options.auto_microbatches)
        build_chunks(self)
        if release:
            self.release_others()
        return own

    def reset(self) -> None:
        """Forgets the cut and the stage (one rank, whose layers changed: it is built again)."""
        self.graph = None
        self.placed.forget()
        if self.auto is not None:
            self.auto.forget()

    def release_others(self) -> None:
        """Frees the weights of the layers other stages hold (a model handed in built had them all)."""
        held = set(self.stage_units())
        graphs.release([layer for unit, layer in self.graph.units.items() if unit not in held])

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

    def step(self, inputs: StepInputs, loss_for=None, ready=None):
        """One step of the global batch (collective), the model's one call into the engine a step.

        ``"train"`` and ``"test"``: the targets and sample weights go where the
        last stage needs them; ``loss_for(y)`` gives the step's
        :class:`~keras_pipe.stage.losses.MicrobatchLoss` (from the targets as
        the last stage has them); on ``schedule="auto"``'s first training batch
        the candidates are timed and every rank takes the fastest; then
        ``ready(picked)`` (the model follows a new placement, builds its
        optimizer) and the batch runs. Returns a
        :class:`~keras_pipe.engine.batch.StepDone`.

        ``"predict"``: the batch runs and every rank returns the whole batch's
        flat predictions.
        """
        if inputs.phase == "predict":
            flat = self._run(inputs)[2]
            if flat is not None:
                flat = [p.tensor if isinstance(p, Masked) else p for p in flat]
            return self.predictions.broadcast_predictions(flat, inputs.batch_size, self.cut.graph)
        y, sample_weight = self.predictions.exchange_targets(
            inputs.y, inputs.sample_weight, inputs.batch_size, self.chunks
        )
        inputs = replace(inputs, y=y, sample_weight=sample_weight)
        if loss_for is not None:
            inputs = replace(inputs, loss=loss_for(y))
        picked = self.pick(inputs)
        if ready is not None:
            ready(picked)
        loss_part, terms, flat = self._run(inputs)
        return StepDone(loss_part, terms, flat, y, sample_weight)

    def _run(self, inputs: StepInputs):
        """Runs one global batch through this stage: ``(loss share, term values, flat predictions)``."""
        result = self.run_batch(inputs)
        if not self.is_last:
            return result.loss_part, None, None
        flat = self.predictions.joined(result.predictions, inputs.phase, self.cut.graph, self.masks)
        return (
            result.loss_part,
            result.terms,
            [self.predictions.gather_replicas(p, inputs.batch_size, inputs.shares) for p in flat],
        )

    def run_batch(self, inputs: StepInputs):
        """The batch's actions on this rank's chunks, run: the executor's result (a step's, or a timing's)."""
        probe.measure_first_batch(self, inputs.x)
        batch = stage_batch(self, inputs)
        bounds = batch.bounds
        actions = (
            self.actions.for_batch(self.chunks, inputs.phase, len(bounds), batch.whole_batch_loss) if bounds else []
        )
        return self.executor.run(actions, batch)

    # -- schedule="auto" (collective: keras_pipe.engine.picking) ----------------------------

    def picking(self) -> bool:
        """Whether the next training step first times ``"auto"``'s candidates (:meth:`pick`)."""
        return self.auto is not None and self.auto.pending()

    def pick(self, inputs: StepInputs) -> bool:
        """On ``"auto"``'s first training batch, times its candidates on it and every rank takes the fastest
        (collective); whether it did (the model's layers may then be placed otherwise)."""
        if inputs.phase != "train" or not self.picking():
            return False
        self.auto.pick(inputs)
        return True

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
        return self.placed.units_of(self.stage)

    @property
    def trainable_variables(self) -> list:
        """This rank's trainable variables (every chunk's), once built."""
        return [v for chunk in self.chunks for v in chunk.compute.trainable_variables]

    def stage_layers(self) -> list:
        """The layers this rank holds weights of (every chunk's), once built."""
        return [layer for chunk in self.chunks for layer in chunk.compute.layers]
