"""Internal: the datasets Keras' loop iterates on each rank, with tf.data's autotuning off unless the user chose.

tf.data tunes a pipeline's prefetch buffers and parallelism from timings, in
a thread of its own. On a host whose cores the ranks keep busy (each computes
or polls for its next message), those timings are the ranks' and the
tuning's threads take cores from them: two ranks on two cores, batch 64
(``benchmarks/step_spans.py --workload balanced-b64``, twelve epochs a
launch) trained some epochs at 1250 samples/s and others at 800 or 490,
changing from epoch to epoch; with ``options.autotune.enabled = False`` every
epoch ran at 1150-1340. Turning off only the private thread pool or the
injected prefetch did not help.

So every dataset Keras' epoch iterator makes (from arrays) or is given gets
``autotune.enabled = False``, unless its options already set it: a user's
``with_options`` wins (``AUTOTUNE`` parallelism and buffers then take
tf.data's untuned defaults). Keras hands every such dataset to
``model.distribute_strategy.experimental_distribute_dataset``, so that is
where :class:`DatasetStrategy` sets it.

>>> import tensorflow as tf
>>> without_autotuning(tf.data.Dataset.range(3)).options().autotune.enabled
False
>>> options = tf.data.Options()
>>> options.autotune.enabled = True
>>> without_autotuning(tf.data.Dataset.range(3).with_options(options)).options().autotune.enabled
True
"""

from __future__ import annotations

import tensorflow as tf


def without_autotuning(dataset):
    """``dataset`` with tf.data's autotuning off, unless its options already say whether to tune."""
    if not isinstance(dataset, tf.data.Dataset) or dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


class DatasetStrategy:
    """Keras' distribution strategy (TensorFlow's default one), whose datasets are :func:`without_autotuning`.

    With ``feeding`` (a :class:`~keras_pipe.model.feeding.Feeding`), each
    dataset is drawn through it: the ranks agree on each batch as Keras' loop
    draws it, and the stages that do not read follow the first.

    Everything else is the wrapped strategy's.
    """

    def __init__(self, strategy, feeding=None):
        self._strategy = strategy
        self._feeding = feeding

    def experimental_distribute_dataset(self, dataset, options=None):
        if self._feeding is not None and self._feeding.is_drawn(dataset):  # (a follower: nothing to distribute)
            return dataset
        dataset = self._strategy.experimental_distribute_dataset(without_autotuning(dataset), options)
        return dataset if self._feeding is None else self._feeding.drawing(dataset)

    def __getattr__(self, name):
        if name in ("_strategy", "_feeding"):  # (not yet set: a copy being made)
            raise AttributeError(name)
        return getattr(self._strategy, name)
