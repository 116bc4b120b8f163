"""Internal: layers' internals (Keras 3.0-3.15): sublayers, the weights that train, a layer's losses and generators."""

from __future__ import annotations


def sublayers(layer) -> list:
    """``layer`` and every layer nested in it (``Layer._flatten_layers``, Keras 3.0-3.15).

    Why: the losses a layer adds during ``call`` (activity regularization)
    live on the sublayer that added them.
    """
    return list(layer._flatten_layers())


def trained_weights(layer) -> list:
    """The weights of ``layer`` a trainable Keras model trains: each one whose own ``trainable`` flag is set.

    The one place keras_pipe decides what trains (every stage, backward,
    update, tied weight and replica reads it). Keras decides per variable,
    at any depth: ``Model.trainable_weights`` is ``[v for v in self.weights
    if v.trainable]`` (``Layer.trainable_weights``, Keras 3.0-3.15), and a
    model's ``weights`` gather every sub-layer's whatever the sub-layer's
    flag. ``layer.trainable_weights`` is not that: it is empty when
    ``layer`` itself is frozen, even where a child was unfrozen after it
    (``block.trainable = False; block.a.trainable = True``) or where LoRA
    added trainable weights under a frozen parent (keras_hub's
    ``Backbone.enable_lora`` freezes every layer, then unfreezes the targets
    and adds their ``lora_kernel_a``/``lora_kernel_b``). Setting a layer's
    ``trainable`` sets its variables' flags (``Layer.trainable``'s setter),
    so the flags are the whole truth. The model's own ``trainable=False`` is
    applied by the caller (``StageCompute``'s ``frozen``), as Keras' model does.
    """
    return [v for v in layer.weights if v.trainable]


def own_losses(layer) -> list:
    """The losses ``layer`` itself added in its last call (``Layer._get_own_losses``, Keras 3.0-3.15).

    Why: a stage adds its layers' activity losses to its share of the loss;
    the public ``layer.losses`` also includes weight regularization, which is
    counted once per batch, not per micro-batch.
    """
    return list(layer._get_own_losses())


def weight_regularization_losses(layer) -> list:
    """The weight regularizers' losses of ``layer``'s weights that train, as the unsplit model counts them.

    Keras' model sums ``v.regularizer(v)`` over its ``trainable_weights``
    (``Layer._get_regularization_losses``, Keras 3.0-3.15): the weights of
    :func:`trained_weights`, not ``layer._get_regularization_losses()``, which
    a frozen parent empties of a trainable child's.
    """
    return [v.regularizer(v) for v in trained_weights(layer) if v.regularizer is not None]


def seed_generators(layer) -> list:
    """The ``SeedGenerator``s of ``layer`` and its sublayers (``Layer._seed_generators``, Keras 3.0-3.15).

    Why: replaying a layer with dropout during its backward must draw the
    same random numbers as its forward did, so the generators' states are
    saved before the forward and restored for the replay.
    """
    found = []
    for sub in sublayers(layer):
        for generator in sub._seed_generators:
            if all(generator is not g for g in found):
                found.append(generator)
    return found


def converts_input_args(layer) -> bool:
    """A layer's ``_convert_input_args`` (Keras 3.0-3.15): whether its ``__call__`` casts its inputs to its dtype
    policy's (a tracer does as its ``__call__`` would)."""
    return layer._convert_input_args
