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
"""

from __future__ import annotations

import tensorflow as tf

from keras_pipe import compat
from keras_pipe.stage.compute import Masked


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
    merged = {}
    for part in pipeline.allgather_json(found) if pipeline.size > 1 else [found]:
        merged.update(part)
    return {int(t): (tuple(shape), None if mask is None else tuple(mask)) for t, (shape, mask) in merged.items()}


def _measure_stage(stage, calls, links, sample, eager: bool) -> dict:
    """One stage's part of :func:`measure`: receive, run, send; what it computed, as JSON."""
    inputs = list(sample) if stage.index == 0 else []
    for crossing in stage.receives:
        inputs.append(links.receive_described(crossing.source, links.tensors[crossing.tensor].dtype))
    forward = _forward(stage, calls)
    values, masks = forward(inputs) if eager else tf.function(forward, autograph=False)(inputs)
    # Each tensor as the stage that computed it saw it once its stage was done (a layer may take the mask
    # off a tensor it reads, as MultiHeadAttention does: the tensor's readers on later stages, in the
    # unsplit model too, see what the tensor carried once every earlier node ran).
    computed = set(stage.model_inputs) | {t for call in calls for t in call.outputs}
    found = {}
    for t, value in values.items():
        if t in computed:
            mask = masks.get(t)
            found[str(t)] = [list(value.shape), None if mask is None else list(mask.shape)]
    for crossing in stage.sends:
        value, mask = values[crossing.tensor], masks.get(crossing.tensor)
        outgoing = value if mask is None else Masked(value, mask)
        for destination in crossing.destinations:
            links.send_described(outgoing, destination)
    return found


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
    for t, (shape, _) in measured.items():
        tensor = graph.tensors[t]
        fixed = [d for d in tensor.shape[1:]]
        if len(shape) != len(tensor.shape) or any(d is not None and d != s for d, s in zip(fixed, shape[1:])):
            notes.append(f"{tensor.name!r} has shape {shape} on real tensors but {tensor.shape} in the model's graph")
    return notes
