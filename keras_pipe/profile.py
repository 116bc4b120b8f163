"""Measuring each layer's forward + backward time, for ``balance="time"``.

Equal parameter counts rarely mean equal time (a convolution has few
weights and much work; a wide Dense the opposite). As torchgpipe's
``balance_by_time``, this times every layer on a sample micro-batch and
splits the chain so that the slowest stage is as fast as possible.

No rank builds the whole model: each rank times the layers of the
parameter-balanced split it would own, on throw-away copies, and the ranks
share their timings (JSON, no pickling) so that all compute the same split.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import partition
from keras_pipe.comm import Communicator


def layer_times(layers, specs, start: int, stop: int, rows: int, repeats: int = 5) -> list[float]:
    """Median seconds of forward + backward of ``layers[start:stop]`` on ``rows`` samples each."""
    times = []
    for layer, spec in zip(layers[start:stop], specs[start:stop]):
        clone = partition.shadow_copy(layer)
        template = spec.input_template
        if template is None:
            template = keras.KerasTensor(spec.input_shape, spec.input_dtype)
        x = keras.tree.map_structure(lambda t: _sample(t, rows), template)
        clone(x)  # build

        @tf.function
        def step(x, clone=clone):
            inputs = [t for t in tf.nest.flatten(x) if t.dtype.is_floating]
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                y = clone(x, training=True)
            outputs = [t for t in tf.nest.flatten(y) if t.dtype.is_floating]
            sources = inputs + clone.trainable_weights
            if not sources or not outputs:
                return y
            return tape.gradient(outputs, sources, output_gradients=[tf.ones_like(t) for t in outputs])

        step(x)  # trace and warm up
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            result = step(x)
            _ = [r.numpy() for r in tf.nest.flatten(result) if r is not None][:1]
            samples.append(time.perf_counter() - began)
        times.append(statistics.median(samples))
        del clone, step
    return times


def _sample(template, rows: int):
    """A tensor of ``rows`` samples shaped as the ``KerasTensor`` ``template``: random floats, else zeros."""
    shape = (rows,) + tuple(template.shape[1:])
    dtype = tf.as_dtype(template.dtype)
    return tf.random.normal(shape, dtype=dtype) if dtype.is_floating else tf.zeros(shape, dtype)


def balance_by_time(
    layers: Sequence[keras.layers.Layer], specs, num_stages: int, comm: Communicator, stage: int, rows: int
) -> list[int]:
    """Layers per stage balancing measured forward + backward time; the same on every rank.

    Each rank times the layers of its ``stage`` in a parameter-balanced
    split; with replicas, a stage's time is the mean over its replicas, so
    every rank of ``comm`` computes the same split.
    """
    provisional = partition.stage_bounds(partition.balance_by_params(specs, num_stages))
    start, stop = provisional[stage]
    mine = layer_times(list(layers), specs, start, stop, rows)
    measured = comm.allgather_json([stage, mine])
    every = []
    for s in range(num_stages):
        replicas = [times for owner, times in measured if owner == s]
        every.extend(float(np.mean(column)) for column in zip(*replicas))
    # Layers that take no measurable time still cost a little (a copy), so
    # that every stage gets at least one layer and ties spread out.
    floor = 1e-6 + 1e-3 * float(np.mean(every))
    return partition.min_max_partition([t + floor for t in every], num_stages)
