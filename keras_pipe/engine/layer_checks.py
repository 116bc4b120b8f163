"""Internal: what the engine checks of the model's layers after the cut, at each ``compile`` and build.

Every rank holds every layer object (the other stages' unallocated), so each
check sees the same layers and raises or warns alike on every rank: layers
that gained or lost weights since the pipeline was made (LoRA enabled, a
layer quantized, on the model handed in), and batch normalization computing
its statistics per micro-batch.
"""

from __future__ import annotations

import warnings

import keras

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError


class LayerChecks:
    """The weights each layer held when the model was cut, and the batch-normalization layers last warned of."""

    def __init__(self):
        self._counts: dict | None = None
        self._warned: set = set()

    def record(self, model_graph) -> None:
        """Remembers each layer's number of weights (at build)."""
        self._counts = _weight_counts(model_graph)

    def weights_unchanged(self, model_graph) -> None:
        """Raises where layers gained or lost weights since :meth:`record`: the cut, the stages' weights,
        ``get_weights`` and saving were made from the weights the layers held then."""
        if model_graph is None or self._counts is None:
            return
        changed = sorted(unit for unit, count in _weight_counts(model_graph).items() if count != self._counts[unit])
        if changed:
            raise PipelineConfigError(
                f"the layers {changed[:5]} hold other weights than when the pipeline was made (LoRA enabled or a "
                "layer quantized after PipelineModel.from_model?). Change the Keras model first (enable_lora, "
                "quantize), then make the pipeline of it."
            )

    def batch_statistics(self, model_graph, num_microbatches: int, auto_microbatches: bool) -> None:
        """Batch normalization computing statistics per micro-batch: refused with ``num_microbatches="auto"``
        (each candidate m would train differently), warned of otherwise (training differs from ``Sequential``),
        once for each new set of such layers."""
        if num_microbatches <= 1:
            return
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
        if normalising and auto_microbatches:
            raise PipelineConfigError(
                f"num_microbatches='auto' times several numbers of micro-batches, but {len(normalising)} "
                f"BatchNormalization layers ({', '.join(normalising[:4])}) compute their statistics per "
                "micro-batch, so each would train differently: give num_microbatches (1 trains as Sequential)."
            )
        new = set(normalising) - self._warned
        self._warned = set(normalising)
        if new:
            warnings.warn(
                f"{len(normalising)} BatchNormalization layers ({', '.join(normalising[:4])}"
                f"{', ...' if len(normalising) > 4 else ''}) compute their statistics per micro-batch "
                f"({num_microbatches} per batch), so training differs from Sequential; use "
                "num_microbatches=1 or a normalisation without batch statistics (LayerNormalization).",
                stacklevel=5,
            )


def _weight_counts(model_graph) -> dict:
    return {unit: len(layer.weights) for unit, layer in model_graph.units.items()}
