"""Measuring each node's forward + backward time, for ``balance="time"``.

Equal parameter counts rarely mean equal time (a convolution has few
weights and much work; a wide Dense the opposite). As torchgpipe's
``balance_by_time``, this times every node on a sample micro-batch and cuts
the graph so that the slowest stage is as fast as possible.

No rank allocates the whole model: each rank times the nodes of the
parameter-balanced cut it would run, allocating only their weights, and the
ranks share their timings (JSON, no pickling) so that all compute the same
cut.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.graph import cut as cuts
from keras_pipe.graph import graph as graphs
from keras_pipe.mpi.comm import Communicator

# A dimension that varies from batch to batch is timed at this size.
SAMPLE_LENGTH = 16


def node_times(model_graph, nodes, rows: int, repeats: int = 5) -> list[float]:
    """Median seconds of forward + backward of each of ``nodes`` (indices) on ``rows`` samples."""
    plain = model_graph.plain
    units = {plain.nodes[n].unit for n in nodes} - {None}
    graphs.allocate([model_graph.units[u] for u in units])
    times = []
    for n in nodes:
        call = model_graph.calls[n]
        values = {t: _sample(plain.tensors[t], rows) for t in call.inputs}
        layer = call.layer
        variables = compat.trained_weights(layer) if layer is not None else []

        @tf.function(autograph=False)
        def step(values, call=call, variables=variables):
            inputs = [v for v in values.values() if v.dtype.is_floating]
            with tf.GradientTape() as tape:
                tape.watch(inputs + [compat.variable_handle(v) for v in variables])
                outputs = call(values, training=True)
            outputs = [t for t in outputs if t.dtype.is_floating]
            sources = inputs + variables
            if not sources or not outputs:
                return outputs
            grads = tape.gradient(outputs, sources, output_gradients=[tf.ones_like(t) for t in outputs])
            return [g for g in grads if g is not None]

        try:
            step(values)  # trace and warm up
        except Exception as error:  # noqa: BLE001 - re-raised with context
            raise PipelineConfigError(
                f"balance='time' could not time node {call.name!r} on sample inputs ({error}); use balance=None, "
                "a list of sizes, or split_before."
            ) from error
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            result = step(values)
            _ = [r.numpy() for r in tf.nest.flatten(result) if r is not None][:1]
            samples.append(time.perf_counter() - began)
        times.append(statistics.median(samples))
        del step
    return times


def _sample(tensor, rows: int):
    """A tensor of ``rows`` samples shaped as the graph's ``tensor``: random floats, else zeros."""
    shape = (rows,) + tuple(SAMPLE_LENGTH if d is None else d for d in tensor.shape[1:])
    dtype = tf.as_dtype(tensor.dtype)
    return tf.random.normal(shape, dtype=dtype) if dtype.is_floating else tf.zeros(shape, dtype)


def balance_by_time(model_graph, num_stages: int, comm: Communicator, stage: int, rows: int) -> list[int]:
    """Nodes per stage balancing measured forward + backward time; the same on every rank.

    Each rank times the nodes of its ``stage`` in a parameter-balanced
    cut; with replicas, a stage's time is the mean over its replicas, so
    every rank of ``comm`` computes the same cut.
    """
    plain = model_graph.plain
    provisional = cuts.cut(plain, cuts.balance_by_cost([node.cost for node in plain.nodes], num_stages))
    mine = node_times(model_graph, provisional.stages[stage].nodes, rows)
    measured = comm.allgather_json([stage, mine])
    every = []
    for s in range(num_stages):
        replicas = [times for owner, times in measured if owner == s]
        every.extend(float(np.mean(column)) for column in zip(*replicas))
    # Nodes that take no measurable time still cost a little (a copy), so
    # that every stage gets at least one node and ties spread out.
    floor = 1e-6 + 1e-3 * float(np.mean(every))
    return cuts.balance_by_cost([t + floor for t in every], num_stages)
