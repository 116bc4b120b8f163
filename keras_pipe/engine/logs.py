"""Internal: the same logs on every rank — loss from every stage, metrics from the last.

Every rank holds a share of the batch loss (the last stage the data loss,
every stage its regularization), and only the last stage has metrics. One
all-reduce per step sums the loss shares and spreads the metric values, so
``History``, callbacks and progress bars agree on every rank. The names and
shapes of the logs are agreed once per kind of step (:class:`LogSharing`);
the model's side of a step's logs, its compiled metrics and loss tracker, is
:class:`keras_pipe.model.logs.ModelLogs`.
"""

from __future__ import annotations

import numpy as np

from keras_pipe.mpi.comm import Communicator


class LogSharing:
    """Shares one step's logs over ``comm``; ``source`` is the world rank that has the metrics."""

    def __init__(self, comm: Communicator, source: int):
        self.comm = comm
        self.source = source
        self._fields: dict = {}
        self.directions: dict = {}  # the compiled metrics' {name: "up" or "down"}, from the source

    def forget(self) -> None:
        """After ``compile()``: the metrics may have changed."""
        self._fields = {}
        self.directions = {}

    def share(self, kind: str, loss_part: float, samples: int, metrics: dict, order=None, directions=None):
        """``(loss sum, samples, metrics, order)`` over every rank; ``metrics`` in the source's order.

        ``samples`` counts once (rank 0's); ``metrics``, ``order`` (the keys
        of ``evaluate()``'s list) and ``directions`` (each compiled metric's,
        kept in :attr:`directions`) are read on the source only.
        """
        has_metrics = self.comm.rank == self.source
        if kind not in self._fields:
            fields = [[name, list(np.shape(value))] for name, value in metrics.items()]
            shared = self.comm.bcast_json([fields, order, directions] if has_metrics else None, root=self.source)
            self._fields[kind] = shared[:2]
            self.directions.update(shared[2] or {})
        fields, order = self._fields[kind]
        values = [loss_part, float(samples) if self.comm.rank == 0 else 0.0]
        for name, shape in fields:
            size = int(np.prod(shape, dtype=np.int64))
            values.extend(np.ravel(metrics[name]).tolist() if has_metrics else [0.0] * size)
        summed = self.comm.allreduce_sum(np.asarray(values, np.float64))
        shared, offset = {}, 2
        for name, shape in fields:
            size = int(np.prod(shape, dtype=np.int64))
            chunk = summed[offset : offset + size]
            shared[name] = float(chunk[0]) if not shape else chunk.reshape(shape)
            offset += size
        return float(summed[0]), float(summed[1]), shared, order
