"""Internal: ``schedule="auto"`` on one engine: timing its candidates on the first batch, then keeping one.

The candidates are :class:`~keras_pipe.schedules.auto.SchedulePicker`'s
(1F1B, ZB-H1, and ZB-V where the model can be cut for its ``2P`` virtual
stages; or the numbers of micro-batches of ``num_microbatches="auto"``). A
candidate that places the model otherwise (ZB-V's V) is built as a second
:class:`~keras_pipe.engine.placement.Placement` beside the first while the
timing lasts, its weights copied from the ranks that hold them
(:mod:`keras_pipe.engine.recut`); the engine's ``placed`` is swapped whole
between them, and the one not picked is freed.
"""

from __future__ import annotations

import time
from dataclasses import replace

from keras_pipe.engine import cutting, recut
from keras_pipe.engine.placement import key_of
from keras_pipe.graph import cut as cuts
from keras_pipe.schedules import schedule
from keras_pipe.schedules.auto import OTHER_CUT


class SchedulePicking:
    """The engine's ``schedule="auto"`` (or ``num_microbatches="auto"``): :attr:`picker` decides, this runs."""

    def __init__(self, engine, picker):
        self.engine = engine
        self.picker = picker
        self._placings: dict = {}  # (while it times: each other placement, by key)

    def pending(self) -> bool:
        """Whether the next training step first times the candidates (the model built, nothing picked yet)."""
        return self.picker.picked is None and self.engine.built

    def times_v(self) -> bool:
        """Whether ZB-V, whose cut is not the one-stage-a-rank one, is still among the candidates."""
        return self.picker.picked is None and OTHER_CUT in self.picker.schedules()

    def check_v_cut(self, model_graph) -> None:
        """Drops ZB-V from the candidates where its cut is not this model's to make (the same on every rank)."""
        problem = cutting.v_cut_problem(model_graph, self.engine.options, self.engine.num_stages)
        if problem is not None:
            self.picker.drop(OTHER_CUT, problem)

    def forget(self) -> None:
        self._placings.clear()

    def pick(self, inputs) -> None:
        """Times the candidates on this batch, then every rank takes the fastest (collective).

        Each candidate runs warm-up and timed steps in turn on the batch; none
        of them trains: each updates a copy of ``optimizer`` (not yet built: it
        is built once the pick is made, on the variables the picked cut places
        here) and every variable this rank held is put back afterwards.
        """
        engine, picker, optimizer = self.engine, self.picker, inputs.optimizer
        tracer, engine.tracer = engine.tracer, None  # (a timeline sees the batch's real step, not the timing)
        if optimizer is not None and optimizer.built and self.times_v():
            # (built on this cut's variables already: a restored optimizer state; the same on every rank)
            picker.drop(OTHER_CUT, "the optimizer was built before the first training step, on one stage a rank")
        keys = {}
        for name in picker.schedules():  # (every placement built, and its weights copied, before the timing)
            self.switch(name)
            keys[name] = engine.placed.key
        held = [engine.graph.units[u] for placed in self._placings.values() for u in placed.units_of(engine.stage)]
        snapshot = recut.Snapshot(held + engine.own_layers())
        copies = {}
        while picker.steps_left():
            name = picker.current()
            self.switch(name)
            if keys[name] not in copies:
                copies[keys[name]] = recut.timing_optimizer(optimizer) if optimizer is not None else None
                if copies[keys[name]] is not None:
                    copies[keys[name]].build(engine.trainable_variables)
            engine.world.doing = f"timing schedule {picker.candidate()!r} for schedule='auto'"
            began = time.perf_counter()
            engine.run_batch(replace(inputs, optimizer=copies[keys[name]]))
            picker.record(time.perf_counter() - began)
        snapshot.restore()
        picker.decide(engine.world.allgather_json(picker.times))
        self.switch(picker.current())
        self._placings.clear()
        engine.release_others()
        for copy in (c for c in copies.values() if c is not None):  # (their programs: the user's traces its own)
            for chunk in engine.chunks:
                chunk.compute.forget_optimizer(copy)
        engine.tracer = tracer

    def switch(self, name: str) -> None:
        """Makes schedule ``name``'s placement the engine's. The one-stage-a-rank cut is the one built first;
        ZB-V's V is built the first time (collective then: the weights it places elsewhere travel from the
        ranks that hold them)."""
        engine = self.engine
        # (a fixed schedule timing its m alone: its own chunks, this placement; "auto"'s candidates: their defaults)
        chunks = engine.options.num_chunks if name == engine.schedule else schedule.default_chunks(name)
        key = key_of(schedule.placement(name, engine.num_stages, chunks))
        current = engine.placed
        if key == current.key:
            return
        self._placings[current.key] = current
        if key in self._placings:
            engine.use(self._placings.pop(key))
            return
        owners = {unit: engine.owner_of(unit) for unit in engine.graph.units}
        engine.use(engine.place(name, chunks))
        sizes = cutting.v_sizes(engine.graph, engine.num_stages)
        the_cut = cuts.cut(engine.graph.plain, sizes)
        holders = engine.holder_ranks(the_cut)
        # (before the chunks are built: a chunk takes its frozen and non-trainable variables' tf.Variable, which a
        # weight released here only has once it arrives)
        engine.world.doing = f"copying the weights schedule {name!r} places on other ranks (schedule='auto')"
        recut.move_weights(engine.pipeline, engine.graph.units, owners, holders, engine.stage)
        engine.build_on(engine.graph, the_cut, sizes, release=False)
