"""Learning what a model does on real tensors: the Keras masks that ride with them, and their shapes.

Every rank knows every tensor's shape and dtype from the model's symbolic
graph, but not always its Keras mask: a layer may attach one inside
``call()`` on real tensors only (keras_hub's ``TokenAndPositionEmbedding``
and its ``ReversibleEmbedding``, whose ``compute_mask`` says "masking is
done directly in call"), invisible to a symbolic call. A mask the pipeline
did not know of would not cross the stage boundary, and the layers after
it would attend to and pool over padding: training silently unlike the
unsplit model.

So on its first batch each pipeline runs one real forward of that batch's
first micro-batch (inference mode: no dropout draw, no statistics moved;
traced, as the stage's programs run, since Keras attaches some masks in a
traced call and not in an eager one), stage after stage, every crossing
sent with its whole shape and its mask, whatever the graph says; the
stages then share what each tensor carried.
From then on a tensor whose mask differs from what was measured is an error
naming it (:meth:`keras_pipe.stage.compute.StageCompute._crossing`), never a
silent drop.

The same forward checks, once, what micro-batching assumes of the losses a
layer adds in ``call()`` when training (``add_loss``: activity
regularization, a mixture of experts' load-balancing loss): that the
batch's is the mean of its rows', so that micro-batches weighed by their
rows add up to it. A layer whose loss on the micro-batch is not its halves'
mean (Mixtral's router loss, a product of two means over the tokens) is
named in a warning on every rank (:func:`batch_loss_notes`).
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_pipe import compat
from keras_pipe.engine import executor
from keras_pipe.errors import PipelineConfigError
from keras_pipe.stage.compute import Masked
from keras_pipe.stage.microbatch import microbatch_bounds


def measure(stage, calls, links, pipeline, sample: list | None, eager: bool = False, chunks=None) -> dict:
    """One real forward through the pipeline (collective over ``pipeline``): ``{tensor: (shape, mask shape)}``.

    Args:
        stage: this rank's :class:`~keras_pipe.graph.cut.Stage`.
        calls: its node calls.
        links: its :class:`~keras_pipe.engine.links.Links` (``None`` with one stage).
        pipeline: the pipeline's communicator.
        sample: first stage: the model inputs of one micro-batch.
        eager: run the nodes op by op, as the stage's programs then run
            (``compile(run_eagerly=True)``); else traced, as they do: Keras
            propagates some masks in one mode and not the other.
        chunks: where a rank holds several virtual stages, ``(stage, calls,
            links)`` of each, in the order of their virtual stages (they
            take the place of the first three arguments): each runs once
            what it reads has arrived, so the forward goes round the ranks
            as many times as there are chunks.

    Returns:
        For every tensor any stage read or computed, its real shape and the
        shape of its mask (``None`` without), the same on every rank.
    """
    found = {}
    parts = chunks or [(stage, calls, links)]
    for part_stage, part_calls, part_links in parts:
        found.update(_measure_stage(part_stage, part_calls, part_links, sample, eager))
    # (once every chunk ran: a chunk's send to a later chunk of this rank completes only when received)
    for _, _, part_links in parts[:1]:
        if part_links is not None:
            part_links.comm.flush()
    merged, notes = {}, []
    for part in pipeline.allgather_json(found) if pipeline.size > 1 else [found]:
        notes += part.pop(NOTES, [])
        merged.update(part)
    measured = {}
    for t, (shape, mask, dtype) in merged.items():
        measured[int(t)] = (tuple(shape), None if mask is None else tuple(mask), dtype)
    return measured, notes


NOTES = "notes"  # (the key of a stage's batch-loss notes beside its tensors' numbers)


def _measure_stage(stage, calls, links, sample, eager: bool) -> dict:
    """One stage's part of :func:`measure`: receive, run, send; what it computed, as JSON."""
    inputs = list(sample) if stage.index == 0 else []
    for crossing in stage.receives:
        inputs.append(links.receive_described(crossing.source))
    forward = _forward(stage, calls)
    values, masks = forward(inputs) if eager else tf.function(forward, autograph=False)(inputs)
    # Each tensor as the stage that computed it saw it once its stage was done (a layer may take the mask
    # off a tensor it reads, as MultiHeadAttention does: the tensor's readers on later stages, in the
    # unsplit model too, see what the tensor carried once every earlier node ran).
    computed = set(stage.model_inputs) | {t for call in calls for t in call.outputs}
    found = {}
    for t, value in values.items():
        if value is None:  # (a layer's output it gave as None, read by no node: XLNet's encoder's second)
            continue
        if t in computed:
            mask = masks.get(t)
            found[str(t)] = [list(value.shape), None if mask is None else list(mask.shape), value.dtype.name]
    notes = batch_loss_notes(calls, values)
    if notes:
        found[NOTES] = notes
    for crossing in stage.sends:
        value, mask = values[crossing.tensor], masks.get(crossing.tensor)
        outgoing = value if mask is None else Masked(value, mask)
        for destination in crossing.destinations:
            links.send_described(outgoing, destination)
    return found


def rows_not_first(the_cut, measured: dict) -> list[str]:
    """The crossings whose tensor does not have the micro-batch's rows on its first axis (as measured).

    Stages send a micro-batch's tensors with its rows first, and check them
    on arrival; a tensor laid out another way (XLNet's encoder is
    time-major: ``(length, batch, width)``) cannot cross, and would fail on
    the receiving rank alone: said on every rank, with what to do.
    """
    graph = the_cut.graph
    rows = {measured[t][0][0] for t in graph.inputs if t in measured and measured[t][0]}
    if len(rows) != 1:
        return []
    (count,) = rows
    problems = []
    for crossing in the_cut.crossings:
        shape = measured.get(crossing.tensor, ((),))[0]
        if shape and shape[0] != count:
            problems.append(
                f"{graph.tensors[crossing.tensor].name} crosses from stage {crossing.source} to "
                f"{list(crossing.destinations)} with shape {tuple(shape)} for a micro-batch of {count} rows: "
                "keras_pipe sends tensors with the batch's rows on their first axis (this one has another axis "
                "first, as a time-major encoder's, or no batch axis, as a table of positions); cut the model "
                "elsewhere (split_before=...) or keep these layers on one stage"
            )
    return problems


def batch_loss_notes(calls, values: dict, rtol: float = 1e-4) -> list[str]:
    """The layers among ``calls`` whose losses added in a training ``call()`` are not a mean over their rows.

    Each layer that adds any is called on the micro-batch (real ``values``)
    and on its two halves, in training mode, its state (moving statistics,
    random generators) put back after each call; the pipeline weighs each
    micro-batch's loss by its rows, which is right where the batch's loss is
    its halves' mean, weighed by their rows.
    """
    notes = []
    for call in calls:
        layer = call.layer
        if layer is None or not call.inputs:
            continue
        rows = _rows(values[call.inputs[0]])
        if rows is None or rows < 2:
            continue
        # what a training call may move (moving statistics, generators' states), not a frozen layer's weights
        state = [v for v in layer.non_trainable_variables if not v.trainable]
        saved = [tf.identity(v) for v in state]
        parts = [(0, rows), (0, rows // 2), (rows // 2, rows)]
        losses = []
        try:
            for begin, end in parts:
                sliced = {t: _slice(values[t], begin, end, rows) for t in call.inputs}
                call(sliced, training=True)
                own = [loss for sub in compat.sublayers(layer) for loss in compat.own_losses(sub)]
                if not own:
                    break
                losses.append(float(sum(tf.reduce_sum(tf.cast(loss, tf.float64)) for loss in own)))
        except Exception:  # noqa: BLE001 (a layer that cannot be called on part of the rows is not checked here)
            losses = []
        finally:
            for variable, value in zip(state, saved):
                variable.assign(value)
        if len(losses) != 3:
            continue
        whole, first, second = losses
        half = rows // 2
        mean = (half * first + (rows - half) * second) / rows
        if abs(whole - mean) > rtol * max(abs(whole), abs(mean), 1e-12):
            randomly = " (or it draws random numbers)" if compat.seed_generators(layer) else ""
            notes.append(
                f"{layer.name!r} ({type(layer).__name__}) adds a loss in call() that is not a mean over the batch's "
                f"rows{randomly}: {whole:.6g} on {rows} rows, where its halves' mean is {mean:.6g}. Each "
                "micro-batch adds its own, so the pipeline's loss and gradients differ from the unsplit model's "
                "(as a mixture of experts' load-balancing loss computed per micro-batch). Use num_microbatches=1 "
                "for the unsplit model's training, or accept the per-micro-batch loss."
            )
    return notes


def _rows(value):
    value = value.tensor if isinstance(value, Masked) else value
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None


def _slice(value, begin: int, end: int, rows: int):
    """``value``'s rows ``begin:end`` with its Keras mask's, where it has ``rows`` rows (else as it is)."""
    if _rows(value) != rows:
        return value
    mask = compat.get_mask(value)
    part = tf.identity(value[begin:end])
    if mask is not None:
        compat.set_mask(part, mask[begin:end])
    return part


def _forward(stage, calls):
    """The stage's nodes in inference mode: ``(values, masks)`` of every tensor it read or computed."""

    def forward(inputs):
        values = {}
        for t, value in zip(stage.inputs, inputs):
            if isinstance(value, Masked):
                tensor = tf.identity(value.tensor)
                compat.set_mask(tensor, value.mask)
                value = tensor
            values[t] = value
        for call in calls:
            values.update(zip(call.outputs, call(values, training=False)))
        masks = {}
        for t, value in values.items():
            mask = compat.get_mask(value)
            if mask is not None:
                masks[t] = tf.cast(mask, tf.bool)
        return values, masks

    return forward


def masks_of(graph, measured: dict) -> dict:
    """Each tensor's mask shape as the graph states shapes: ``None`` where the tensor's dimension varies."""
    masks = {}
    for t, tensor in enumerate(graph.tensors):
        if t not in measured:
            masks[t] = tensor.mask
            continue
        mask = measured[t][1]
        if mask is None:
            masks[t] = None
            continue
        masks[t] = tuple(
            None if k == 0 or (k < len(tensor.shape) and tensor.shape[k] is None) else d for k, d in enumerate(mask)
        )
    return masks


def differences(graph, measured: dict) -> list[str]:
    """Where real tensors disagree with the symbolic graph: a dtype or a fixed dimension (errors), or a mask."""
    notes = []
    for t, (shape, _, dtype) in measured.items():
        tensor = graph.tensors[t]
        fixed = [d for d in tensor.shape[1:]]
        if len(shape) != len(tensor.shape) or any(d is not None and d != s for d, s in zip(fixed, shape[1:])):
            notes.append(f"{tensor.name!r} has shape {shape} on real tensors but {tensor.shape} in the model's graph")
        if dtype != tensor.dtype:  # (links send a tensor's bytes as the graph's dtype)
            notes.append(f"{tensor.name!r} is {dtype} on real tensors but {tensor.dtype} in the model's graph")
    return notes


def measure_first_batch(engine, x: list | None) -> None:
    """The first batch's real forward (collective over the pipeline): what each crossing carries, kept as
    ``engine.masks`` (once: later batches return at once).

    ``engine``: this rank's :class:`~keras_pipe.engine.engine.Engine`; ``x``: first stage, the batch's model
    inputs, whose first micro-batch's rows are used.
    """
    if engine.masks is not None:
        return
    sample = None
    if engine.is_first:
        present = next(t for t in x if t is not None)  # (None: an optional input not given)
        first = microbatch_bounds(int(present.shape[0]), engine.num_microbatches)[0][1]
        sample = [executor.rows(t, 0, first) for t in x]
    engine.world.doing = "measuring the model's masks and shapes on the first micro-batch"
    parts = [(chunk.compute.stage, chunk.compute.calls, chunk.links) for chunk in engine.chunks]
    # The measuring forward is not one of the model's calls: what it changes in the layers' state (a layer
    # counting its calls, a statistic updated in the forward) is put back, so that the state is Keras'.
    state = [
        (v, v.numpy())
        for unit in engine.stage_units()
        for v in engine.graph.units[unit].non_trainable_variables
        if not compat.unallocated(v)
    ]
    measured, notes = measure(None, None, None, engine.pipeline, sample, eager=engine.eager, chunks=parts)
    for variable, value in state:
        variable.assign(value)
    if notes and engine.options.auto_microbatches:  # (the same on every rank)
        raise PipelineConfigError(
            "num_microbatches='auto' times several numbers of micro-batches, each of which would train this "
            "model differently: " + notes[0]
        )
    for note in notes:  # (the same on every rank)
        warnings.warn(note, stacklevel=2)
    problems = differences(engine.cut.graph, measured) + rows_not_first(engine.cut, measured)
    if problems:
        raise PipelineConfigError(
            "the model's tensors do not have the shapes its graph says: " + "; ".join(problems[:5])
        )
    engine.masks = masks_of(engine.cut.graph, measured)
    for chunk in engine.chunks:
        chunk.compute.set_masks(engine.masks)
        if chunk.links is not None:
            chunk.links.set_masks(engine.masks)
    engine.actions.forget()
