"""Internal: a ``PipelineModel``'s logs of one step, on every rank — its compiled metrics, its loss tracker.

The last stage updates the compiled metrics; every stage tracks its loss
share; :class:`keras_pipe.engine.logs.LogSharing` sums and spreads them, and
the logs' order is the order ``keras.Sequential`` gives (loss, then the
compiled metrics in ``compile()`` order), so ``evaluate()``'s list is the
same on every rank.
"""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.stage.compute import Masked
from keras_pipe.stage.programs import Program


class ModelLogs:
    """A ``PipelineModel``'s logs of one step: its last stage's metrics, every stage's loss, on every rank."""

    def __init__(self, model):
        self.model = model
        self._update = (None, None)  # (the compiled metrics, their compiled update and results)
        self._track = (None, None)  # (the loss tracker, its compiled update and result)
        self._answer = None  # (directions, the metrics list answering for them: see answered())
        # The keys of evaluate()'s list, in Keras' order (where Sequential lists
        # a metric twice, so does this), from the last stage, whose metrics are built.
        self.order: list | None = None

    def step_logs(self, phase: str, loss_part: float, terms, batch_size: int, y, flat, sample_weight) -> dict:
        """Updates the metrics (last stage) and the loss tracker; returns the logs, the same on every rank.

        ``terms`` are the loss terms' values over the batch (each output's
        loss, which Keras logs as ``<output>_loss`` when there are several);
        ``flat`` the flat model outputs, ``Masked`` where a Keras mask rides.
        """
        model, engine = self.model, self.model.engine
        metrics, order = {}, None
        if engine.is_last:
            self._track_terms(terms, batch_size)
            if compat.compiled_metrics(model) is not None or self._term_trackers():
                # Every replica's last stage updates its metrics with the whole
                # global batch: exact for every metric, and the same everywhere.
                tensors = [p.tensor if isinstance(p, Masked) else p for p in flat]
                masks = [p.mask if isinstance(p, Masked) else None for p in flat]
                metrics = self.metric_results(self._metrics_update()(y, tensors, masks, sample_weight))
            order = compat.flatten_metrics_in_order(model, {k: k for k in ("loss", *metrics)})
            order = order if isinstance(order, list) else [order]
        directions = self.directions() if engine.is_last else None
        began = time.perf_counter()
        loss, samples, metrics, self.order = engine.logs.share(phase, loss_part, batch_size, metrics, order, directions)
        engine.span("share logs", began)
        return {"loss": self._track_loss(loss, samples), **metrics}

    def flatten_in_order(self, logs: dict):
        """``model._flatten_metrics_in_order(logs)``: the values in the last stage's order on every rank (where
        Sequential lists a metric twice, so does this); ``None`` before a step has shared the order."""
        order = self.order
        if order is None or not set(order) <= set(logs):
            return None
        values = [logs[name] for name in order] + [logs[name] for name in logs if name not in order]
        return values[0] if len(values) == 1 else values

    def directions(self) -> dict:
        """``{name: "up" or "down"}`` of the compiled metrics, as ``MonitorCallback`` reads them (last stage)."""
        found = {}
        for container in self.model.metrics:
            if isinstance(container, compat.metric_containers()):
                for metric in container.metrics:
                    direction = compat.metric_direction(metric)
                    if direction is not None:
                        found[metric.name] = "up" if direction == "up" else "down"
        return found

    def answered(self, metrics: list) -> list:
        """``model.metrics`` on this rank: where the compiled metrics are another stage's, their names and directions.

        Keras' monitoring callbacks (``EarlyStopping(monitor="val_accuracy")``
        with ``mode="auto"``) ask ``model.metrics`` whether a metric goes up
        or down; only the last stage holds the compiled metrics. Every other
        rank answers with the last stage's names and directions (shared with
        the first step's logs), in place of its own unbuilt container.
        """
        engine = self.model.engine
        directions = engine.logs.directions
        compiled = compat.compiled_metrics(self.model)
        if engine.is_last or not directions or compiled is None or compiled.built:
            return metrics
        if self._answer is None or self._answer[0] != directions:
            self._answer = (dict(directions), _directions_list(directions, compiled.name))
        return [self._answer[1] if m is compiled else m for m in metrics]

    def _term_trackers(self) -> list:
        """``CompileLoss``'s mean of each output's loss (several outputs), as Keras logs them."""
        compiled = compat.compiled_loss(self.model)
        return list(compiled.metrics) if compiled is not None else []

    def _track_terms(self, terms, batch_size: int) -> None:
        """Each output's loss over the batch into its ``Mean``, as ``CompileLoss.call`` does once per batch."""
        trackers = self._term_trackers()
        if not trackers or terms is None:
            return
        with_replicas = self.model.engine.replicas
        values = np.asarray(terms, np.float64)
        if with_replicas is not None:
            values = with_replicas.allreduce_sum(values)
        # As CompileLoss.call does, once per batch (keras/src/trainers/compile_utils.py), with the
        # weight it passes: the batch's size, which inside Keras' traced step is unknown (None), so that
        # each batch weighs alike there; run eagerly, it is known.
        weight = batch_size if self.model.run_eagerly else None
        for tracker, value in zip(trackers, values):
            tracker.update_state(np.float32(value), sample_weight=weight)

    # Compiled once each, so that a step costs one call for the metrics and
    # one for the loss instead of a dozen eager operations.

    def _track_loss(self, loss: float, samples: float) -> float:
        """The running mean of the loss over the epoch's samples, as Keras' loss tracker keeps it.

        Summed here in Python (one step costs no TensorFlow call for it) and
        written into the tracker, so that its ``result()`` stays right.
        """
        tracker = compat.loss_tracker(self.model)
        if self._track[0] is not tracker or self._track[1] is None:
            self._track = (tracker, [0.0, 0.0])
        running = self._track[1]
        running[0] += loss * samples
        running[1] += samples
        compat.set_mean_state(tracker, running[0], running[1])
        return float(np.float32(running[0]) / np.float32(running[1])) if running[1] else 0.0

    def reset(self) -> None:
        """At ``reset_metrics()`` (each epoch): the running loss starts again."""
        self._track = (None, None)

    def _metrics_update(self):
        metrics = compat.compiled_metrics(self.model)
        if self._update[0] is not metrics or self._update[1] is None:
            structure = self.model.engine.graph.output_structure()

            def update(y, tensors, masks, sample_weight):
                flat = []
                for tensor, mask in zip(tensors, masks):
                    if mask is not None:  # Keras' metrics read the output's mask from the tensor
                        tensor = tf.identity(tensor)
                        compat.set_mask(tensor, mask)
                    flat.append(tensor)
                if metrics is not None:
                    metrics.update_state(y, keras.tree.pack_sequence_as(structure, flat), sample_weight)
                return self._results()

            self._update = (metrics, Program(update, jit=False, eager=bool(self.model.run_eagerly)))
        return self._update[1]

    def _results(self) -> dict:
        model = self.model
        results = {}
        for metric in model.metrics:
            if metric is compat.loss_tracker(model):
                continue
            value = metric.result()
            results.update(value if isinstance(value, dict) else {metric.name: value})
        return results

    def metric_results(self, results: dict | None = None) -> dict:
        """The metrics' values in the order ``Sequential``'s logs and ``evaluate()`` list them."""
        model = self.model
        results = self._results() if results is None else results
        order = compat.flatten_metrics_in_order(model, {"loss": 0.0, **{k: k for k in results}})
        order = [name for name in (order if isinstance(order, list) else [order]) if name in results]
        return {name: results[name] for name in dict.fromkeys(order)}


def _directions_list(directions: dict, name: str):
    """A ``MetricsList`` of stand-ins, one a compiled metric: its name and direction, no state, no result."""
    _, metrics_list = compat.metric_containers()

    class Direction(keras.metrics.Metric):
        def __init__(self, name, direction):
            super().__init__(name=name)
            self._direction = direction

        def update_state(self, *args, **kwargs):
            pass

        def reset_state(self):
            pass

        def result(self):
            return 0.0

    class Directions(metrics_list):
        def reset_state(self):
            pass

        def result(self):
            return {}  # (the values are the logs', shared from the last stage)

    return Directions([Direction(n, d) for n, d in directions.items()], name=name)
