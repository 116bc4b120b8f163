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


class PerReplica:
    """Each replica's own data, tf.distribute's ``distribute_datasets_from_function``: what ``fit`` is given.

    ``dataset_fn(input_context)`` (a ``tf.distribute.InputContext``: the
    number of replicas, this one's index, ``get_per_replica_batch_size``) is
    called on each replica's first stage alone, when a call is first given
    this object, and returns what ``fit`` takes: a ``tf.data.Dataset``, a
    ``PyDataset`` or a generator of this replica's batches. Step by step the
    replicas' batches, joined in replica order, are the global batch (see
    :mod:`keras_pipe.model.feeding`).
    """

    keras_pipe_described = "PerReplica"  # (what every rank compares of a call's data)

    def __init__(self, dataset_fn):
        if not callable(dataset_fn):
            raise TypeError(f"distribute_datasets_from_function takes a function, got {type(dataset_fn).__name__}")
        self.dataset_fn = dataset_fn
        self.made = None  # (this rank's data, once made: first stages only)

    def make(self, num_replicas: int, replica: int):
        """This replica's data (called once, on a first stage)."""
        if self.made is None:
            context = tf.distribute.InputContext(num_replicas, replica, num_replicas)
            made = self.dataset_fn(context)
            if made is None:
                raise TypeError("the dataset function returned None: it must return this replica's batches")
            self.made = made
        return self.made


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

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Each replica reads its own data: ``dataset_fn(input_context)`` on each replica's first stage alone.

        tf.distribute's convention (``input_context.input_pipeline_id`` is the
        replica, ``num_input_pipelines`` the number of replicas): ``fit``,
        ``evaluate`` and ``predict`` take what this returns, and each step's
        global batch is the replicas' batches joined in replica order.
        """
        if not isinstance(options, (type(None), tf.distribute.InputOptions)):
            raise TypeError(f"options must be a tf.distribute.InputOptions or None, got {type(options).__name__}")
        return PerReplica(dataset_fn)  # (InputOptions place batches on devices: each stage places its own)

    def __getattr__(self, name):
        if name in ("_strategy", "_feeding"):  # (not yet set: a copy being made)
            raise AttributeError(name)
        return getattr(self._strategy, name)
