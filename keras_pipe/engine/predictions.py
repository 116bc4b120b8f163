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
    """The :class:`~keras_pipe.engine.engine.Engine`'s targets and predictions across ranks (its ``links``...)."""

    def _no_predictions(self, phase: str) -> list:
        """A replica with no share of the batch: empty predictions of the right shapes."""
        empty = []
        for t in self.cut.graph.outputs:
            tensor = self.cut.graph.tensors[t]
            y_pred = tf.zeros((0,) + tuple(d or 1 for d in tensor.shape[1:]), tensor.dtype)
            mask = (self.masks or {}).get(t)
            if mask is None or phase == "predict":
                empty.append(y_pred)
            else:
                empty.append(Masked(y_pred, tf.zeros((0,) + tuple(d or 1 for d in mask[1:]), tf.bool)))
        return empty

    def gather_replicas(self, y_pred, batch_size: int):
        """Last stage: the whole global batch's predictions (``Masked`` ones too), every replica's share, in order."""
        if self.replicas is None:
            return y_pred
        counts = [stop - start for start, stop in replica_bounds(batch_size, self.num_replicas)]
        if isinstance(y_pred, Masked):
            mask = self.replicas.allgather_rows(y_pred.mask.numpy().astype(np.uint8), counts)
            return Masked(self.gather_replicas(y_pred.tensor, batch_size), tf.convert_to_tensor(mask.astype(bool)))
        return tf.convert_to_tensor(self.replicas.allgather_rows(y_pred.numpy(), counts))

    def broadcast_predictions(self, flat, batch_size: int) -> list:
        """Every rank gets the last stage's flat predictions of the batch (shapes travel: they may vary)."""
        if self.num_stages == 1:
            return flat
        root = self.last_rank
        shapes = self.pipeline.bcast_json([list(p.shape) for p in flat] if self.is_last else None, root=root)
        result = []
        for k, (t, shape) in enumerate(zip(self.cut.graph.outputs, shapes)):
            dtype = tf.as_dtype(self.cut.graph.tensors[t].dtype).as_numpy_dtype
            buffer = flat[k].numpy() if self.is_last else np.empty(shape, dtype)
            result.append(tf.convert_to_tensor(self.pipeline.bcast_array(buffer, root=root)))
        return result

    def exchange_targets(self, y, sample_weight, batch_size: int):
        """The first stage's labels and sample weights, on the last stage (paired with its inputs)."""
        if self.links is None:
            return y, sample_weight
        flat = [a for a in keras.tree.flatten((y, sample_weight)) if a is not None]
        first = next(chunk for chunk in self.chunks if chunk.is_first) if self.is_first else None
        last = next(chunk for chunk in self.chunks if chunk.is_last) if self.is_last else None
        if first is not None:
            first.links.send_targets(flat)
        if last is not None:
            received = iter(last.links.receive_targets(flat, batch_size))
            return keras.tree.map_structure(lambda a: None if a is None else next(received), (y, sample_weight))
        return y, sample_weight
