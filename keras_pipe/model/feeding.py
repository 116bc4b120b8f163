"""Internal: who reads the data. The first stage of each pipeline draws every batch; the other stages follow it.

Only a pipeline's first stage needs the inputs (the labels and sample
weights travel from it to the last stage), yet Keras' loop iterates whatever
``fit``/``evaluate``/``predict`` is given. For NumPy arrays the other stages
already get zero-width stand-ins (:func:`keras_pipe.model.calls.stand_in_inputs`).
For a ``tf.data.Dataset``, a ``keras.utils.PyDataset`` (or ``Sequence``) or a
generator, every stage but the first gets a :class:`Following` in its place:
a Keras ``DataAdapter`` that never touches the user's object. It reports the
same ``num_batches`` as the first stage's (Keras' progress bar and the
callbacks' ``params["steps"]`` stay the same on every rank) and each of its
batches is made, when Keras asks for it, from what the readers say at that
step's agreement:

- whether a batch came (the end of an epoch, or of a dataset of unknown
  length, is the first stage's), its size, and
- its description: the structure, dtypes and shapes of its inputs, labels
  and sample weights, sent only when it changes (once per call, mostly).

A follower's batch is arrays of the right shapes and dtypes that hold no
bytes (``np.broadcast_to`` of one zero): every rank checks the inputs'
shapes against the model and builds the loss from the labels' as before, so
bad data is the same error everywhere, while the last stage receives the real
labels and sample weights from the first. An exception inside the user's
``map``, ``__getitem__`` or generator is raised on the reading rank and
becomes a :class:`~keras_pipe.errors.PipelineDataError` on every rank.

Every dataset Keras' loop makes or is given passes through
:meth:`Feeding.drawing` (from ``model.distribute_strategy``, see
:mod:`keras_pipe.model.datasets`): the step's agreement happens when Keras
draws a batch, on every rank, whoever reads. With replicas, every replica's
first stage reads each global batch and keeps its rows, as before (their
digests are compared); the other stages read nothing.

>>> import numpy as np
>>> described = describe((np.zeros((4, 3), np.float32), {"y": np.ones((4,), np.int64)}, None))
>>> described
{'tuple': [{'dense': ['float32', [3]]}, {'dict': [['y', {'dense': ['int64', []]}]]}, None]}
>>> x, y, w = stand_in(described, 2)
>>> x.shape, x.dtype, y["y"].shape, w
((2, 3), dtype('float32'), (2,), None)
"""

from __future__ import annotations

import hashlib
import json
import types

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.engine.consistency import FAILED, FOLLOWS


class Drawn:
    """A batch whose step the ranks have already agreed on (the step function does not agree again)."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data


def followed(x) -> bool:
    """Whether ``x`` is data only the first stage reads: a dataset, a ``PyDataset`` or a generator (or a follower)."""
    return isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, types.GeneratorType, Following))


def num_batches(x) -> int | None:
    """The batches of an epoch of ``x``, as Keras' data adapter counts them (``None``: unknown or infinite)."""
    if isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        return None if cardinality < 0 else cardinality
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches
    return None


class Feeding:
    """One model's readers and followers: the call in progress and the step's draw.

    ``engine``: the model's :class:`~keras_pipe.engine.engine.Engine` (its
    stage, topology and :class:`~keras_pipe.engine.consistency.StepAgreement`);
    ``digest``: a reader's digest of its batch, compared between replicas.
    """

    PHASES = {"fit": "train", "evaluate": "test", "predict": "predict"}

    def __init__(self, engine, digest):
        self.engine = engine
        self.digest = digest
        self.calls: list[str] = []  # the calls in progress, innermost last (fit's validation runs evaluate)
        self.follows = False  # whether this call's data is read by the first stage alone

    @property
    def phase(self) -> str:
        return self.PHASES[self.calls[-1]] if self.calls else "train"

    def substitute(self, arguments: dict) -> None:
        """In place of ``x`` and the validation data, a :class:`Following` on every stage but the first (collective).

        Where ``x`` (or the validation data) is a dataset, ``PyDataset`` or
        generator: the first stage of replica 0 counts its batches and tells
        every rank. Arguments that already are followers (``fit`` passes its
        validation data on to ``evaluate``) stay as they are.
        """
        engine = self.engine
        sources = {"x": arguments.get("x")}
        validation = arguments.get("validation_data")
        if validation is not None:
            sources["validation_data"] = validation[0] if isinstance(validation, (tuple, list)) else validation
        wanted = {key: value for key, value in sources.items() if followed(value)}
        if engine.num_stages == 1 or not wanted:
            return
        root = engine.layout.rank_of(0, 0)
        counts = {key: num_batches(value) for key, value in wanted.items()} if engine.world.rank == root else None
        counts = engine.world.bcast_json(counts, root=root)
        if engine.stage == 0:
            return
        for key, value in wanted.items():
            if isinstance(value, Following):
                continue
            follower = Following(self, counts[key], type(value).__name__)
            if key == "x":
                arguments["x"] = follower
            else:
                arguments["validation_data"] = follower

    # -- a step's batch -------------------------------------------------------

    @staticmethod
    def agreed(iterator) -> bool:
        """Whether ``iterator``'s batches are agreed on as they are drawn (else the step function agrees)."""
        return isinstance(iterator, (_Reader, _Follower))

    @staticmethod
    def is_drawn(dataset) -> bool:
        """Whether ``dataset`` already draws its batches through a :class:`Feeding` (or follows)."""
        return isinstance(dataset, (Drawing, Following))

    def drawing(self, dataset):
        """``dataset`` as Keras' loop iterates it: each batch agreed on by every rank as it is drawn."""
        return dataset if self.is_drawn(dataset) else Drawing(self, dataset)

    def read(self, iterator) -> Drawn:
        """A reader's next batch, after every rank agreed on it; ``StopIteration`` on every rank at the end."""
        error = None
        try:
            data = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            data = None
        except Exception as exception:  # (the user's map, __getitem__ or generator; every rank raises it)
            data, error = None, f"{type(exception).__name__}: {exception}"
            self._draw(FAILED, error=error)
            raise
        if data is None:
            self._draw(0)
            raise StopIteration
        x_y_weight = keras.utils.unpack_x_y_sample_weight(data)
        size = _batch_size(x_y_weight)
        description = describe(data)
        text = json.dumps(description, sort_keys=True)
        key = int(np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), np.int64)[0]) or 1
        self._draw(1, size, self.digest(data), description, key)
        return Drawn(data)

    def follow(self) -> Drawn:
        """A follower's next batch: stand-ins of the readers' (``StopIteration`` where they have none)."""
        has_data, size, description = self._draw(FOLLOWS)
        if not has_data:
            raise StopIteration
        return Drawn(stand_in(description, size))

    def _draw(self, state, size=0, digest=0, description=None, key=0, error=None):
        return self.engine.steps.draw(self.phase, state, size, digest, description, key, error)


class Drawing:
    """A dataset whose batches are drawn through :meth:`Feeding.read` (Keras' loop calls ``iter`` each epoch)."""

    def __init__(self, feeding: Feeding, dataset):
        self.feeding = feeding
        self.dataset = dataset

    def __iter__(self):
        return _Reader(self.feeding, iter(self.dataset))

    def __getattr__(self, name):  # (what else Keras asks of a dataset, e.g. its cardinality)
        if name in ("feeding", "dataset"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _Reader:
    def __init__(self, feeding: Feeding, iterator):
        self.feeding = feeding
        self.iterator = iterator

    def __iter__(self):
        return self

    def __next__(self) -> Drawn:
        return self.feeding.read(self.iterator)


class Following(compat.DataAdapter):
    """What a stage that does not read sees in place of the data: the readers' batches, as stand-ins.

    A Keras ``DataAdapter`` (Keras' ``get_data_adapter`` takes one as it is):
    ``num_batches`` is the first stage's; iterating it draws each batch with
    :meth:`Feeding.follow`.
    """

    def __init__(self, feeding: Feeding, batches: int | None, kind: str):
        self.feeding = feeding
        self.batches = batches
        self.keras_pipe_described = kind  # (what every rank compares of a nested call's data: its kind)

    def get_tf_dataset(self):
        return self

    def get_numpy_iterator(self):
        return self

    def __iter__(self):
        return _Follower(self.feeding)

    @property
    def num_batches(self):
        return self.batches

    @property
    def batch_size(self):
        return None

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None


class _Follower:
    def __init__(self, feeding: Feeding):
        self.feeding = feeding

    def __iter__(self):
        return self

    def __next__(self) -> Drawn:
        return self.feeding.follow()


# -- a batch's description, and the stand-in made from it -------------------------------------------


def describe(data):
    """A batch's structure, dtypes and shapes (without the batch dimension), as JSON."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {"dict": [[key, describe(value)] for key, value in data.items()]}
    if isinstance(data, (tuple, list)):
        return {"tuple" if isinstance(data, tuple) else "list": [describe(value) for value in data]}
    dtype = tf.as_dtype(data.dtype).name
    if isinstance(data, tf.RaggedTensor):
        return {"ragged": [dtype, [int(d) for d in data.shape[2:]]]}
    if isinstance(data, tf.SparseTensor):
        return {"sparse": [dtype, [int(d) for d in data.dense_shape[1:]]]}
    return {"dense": [dtype, [int(d) for d in data.shape[1:]]]}


def stand_in(description, size: int):
    """A batch of ``size`` described by ``description``, in arrays that hold no bytes."""
    if description is None:
        return None
    ((kind, value),) = description.items()
    if kind == "dict":
        return {key: stand_in(item, size) for key, item in value}
    if kind in ("tuple", "list"):
        items = [stand_in(item, size) for item in value]
        return tuple(items) if kind == "tuple" else items
    dtype, shape = tf.as_dtype(value[0]), value[1]
    if kind == "ragged":
        return tf.RaggedTensor.from_row_lengths(tf.zeros([0, *shape], dtype), tf.zeros([size], tf.int64))
    if kind == "sparse":
        return tf.SparseTensor(tf.zeros([0, 1 + len(shape)], tf.int64), tf.zeros([0], dtype), [size, *shape])
    zero = np.array(b"", object) if dtype == tf.string else np.zeros((), dtype.as_numpy_dtype)
    return np.broadcast_to(zero, (size, *shape))


def _batch_size(x_y_weight) -> int:
    first = next((a for a in tf.nest.flatten(x_y_weight[:2]) if a is not None), None)
    if first is None:
        return 0
    if isinstance(first, tf.SparseTensor):
        return int(first.dense_shape[0])
    return int(first.shape[0])
