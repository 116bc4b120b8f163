"""Internal: a batch's targets to the last stage and its predictions back to every rank.

The first stage reads the labels and sample weights with the inputs and
sends them to the last stage, which computes the loss; the last stage's
predictions are gathered over the replicas (each computed its share of the
global batch) and broadcast over the pipeline, so that every rank's
``predict()`` returns the whole batch's, as Keras' does.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.stage.compute import Masked
from keras_pipe.stage.microbatch import replica_bounds


class PredictionExchange:
    """Targets and predictions across ranks (an :class:`~keras_pipe.engine.engine.Engine` holds one).

    ``pipeline`` and ``replicas`` are this rank's communicators (``replicas``
    ``None`` without replicas), ``last_rank`` the pipeline rank that computes
    the loss, ``is_first``/``is_last`` whether this rank holds the first/last
    (virtual) stage.
    """

    def __init__(
        self, pipeline, replicas, *, num_replicas: int, num_stages: int, last_rank: int, is_first: bool, is_last: bool
    ):
        self.pipeline = pipeline
        self.replicas = replicas
        self.num_replicas = num_replicas
        self.num_stages = num_stages
        self.last_rank = last_rank
        self.is_first = is_first
        self.is_last = is_last

    def none(self, phase: str, graph, masks: dict | None) -> list:
        """A replica with no share of the batch: empty predictions of the right shapes (``graph``: the cut's)."""
        empty = []
        for t in graph.outputs:
            tensor = graph.tensors[t]
            y_pred = tf.zeros((0,) + tuple(d or 1 for d in tensor.shape[1:]), tensor.dtype)
            mask = (masks or {}).get(t)
            if mask is None or phase == "predict":
                empty.append(y_pred)
            else:
                empty.append(Masked(y_pred, tf.zeros((0,) + tuple(d or 1 for d in mask[1:]), tf.bool)))
        return empty

    def joined(self, predictions: list, phase: str, graph, masks: dict | None) -> list:
        """Last stage: the flat model outputs of this replica's share, its micro-batches' joined in order
        (``predictions``: each micro-batch's flat outputs, ``None`` where it made none)."""
        parts = [p for p in predictions if p is not None] or [self.none(phase, graph, masks)]
        flat = []
        for k in range(len(graph.outputs)):
            pieces = [p[k] for p in parts]
            if isinstance(pieces[0], Masked):
                flat.append(Masked(*(tf.concat(part, axis=0) for part in zip(*pieces))))
            else:
                flat.append(tf.concat(pieces, axis=0))
        return flat

    def gather_replicas(self, y_pred, batch_size: int, shares=None):
        """Last stage: the whole global batch's predictions (``Masked`` ones too), every replica's share, in order
        (``shares``: each replica's rows, where each read its own; else as ``replica_bounds`` cuts the batch)."""
        if self.replicas is None:
            return y_pred
        if shares is None:
            shares = [b - a for a, b in replica_bounds(batch_size, self.num_replicas)]
        counts = list(shares)
        if isinstance(y_pred, Masked):
            mask = self.replicas.allgather_rows(y_pred.mask.numpy().astype(np.uint8), counts)
            tensor = self.gather_replicas(y_pred.tensor, batch_size, shares)
            return Masked(tensor, tf.convert_to_tensor(mask.astype(bool)))
        return tf.convert_to_tensor(self.replicas.allgather_rows(y_pred.numpy(), counts))

    def broadcast_predictions(self, flat, batch_size: int, graph) -> list:
        """Every rank gets the last stage's flat predictions of the batch (shapes travel: they may vary).

        ``graph``: the cut's graph (its outputs and their dtypes).
        """
        if self.num_stages == 1:
            return flat
        root = self.last_rank
        shapes = self.pipeline.bcast_json([list(p.shape) for p in flat] if self.is_last else None, root=root)
        result = []
        for k, (t, shape) in enumerate(zip(graph.outputs, shapes)):
            dtype = tf.as_dtype(graph.tensors[t].dtype).as_numpy_dtype
            buffer = flat[k].numpy() if self.is_last else np.empty(shape, dtype)
            result.append(tf.convert_to_tensor(self.pipeline.bcast_array(buffer, root=root)))
        return result

    def exchange_targets(self, y, sample_weight, batch_size: int, chunks: list):
        """The first stage's labels and sample weights, on the last stage (paired with its inputs).

        ``chunks``: the rank's :class:`~keras_pipe.engine.chunks.Chunk` list, whose links carry them.
        """
        if chunks[0].links is None:
            return y, sample_weight
        flat = [a for a in keras.tree.flatten((y, sample_weight)) if a is not None]
        first = next(chunk for chunk in chunks if chunk.is_first) if self.is_first else None
        last = next(chunk for chunk in chunks if chunk.is_last) if self.is_last else None
        if first is not None:
            first.links.send_targets(flat)
        if last is not None:
            received = iter(last.links.receive_targets(flat, batch_size))
            return keras.tree.map_structure(lambda a: None if a is None else next(received), (y, sample_weight))
        return y, sample_weight
