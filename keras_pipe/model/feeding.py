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
digests are compared); the other stages read nothing. Data given per replica
(:class:`~keras_pipe.model.datasets.PerReplica`, from
``model.distribute_strategy.distribute_datasets_from_function``) is read
through a :class:`Joined` instead: each replica's first stage draws its own
batch, the step's global batch is the replicas' joined (their labels and
sample weights gathered between the first stages), and each replica's
inputs are its own rows alone.

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
from keras_pipe.errors import PipelineDataError
from keras_pipe.model.datasets import PerReplica, without_autotuning


class Drawn:
    """A batch whose step the ranks have already agreed on (the step function does not agree again).

    ``shares``: where each replica read its own share
    (``distribute_datasets_from_function``), each replica's rows of the global
    batch (``data``'s inputs are this replica's rows alone); else ``None``.
    """

    __slots__ = ("data", "shares")

    def __init__(self, data, shares=None):
        self.data = data
        self.shares = shares


def followed(x) -> bool:
    """Whether ``x`` is data only the first stage reads: a dataset, a ``PyDataset``, a generator or each replica's
    own data (or a follower)."""
    return isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, types.GeneratorType, PerReplica, Following, Joined))


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
        validation data on to ``evaluate``) stay as they are. Where it is a
        :class:`~keras_pipe.model.datasets.PerReplica`, each replica's first
        stage makes its own data and reads it through a :class:`Joined`; an
        epoch has as many steps as the longest replica's data.
        """
        engine = self.engine
        sources = {"x": arguments.get("x")}
        if arguments.get("validation_split") and followed(sources["x"]) and not isinstance(sources["x"], Following):
            # (Keras' own error names the class it was given: a follower's on the ranks that do not read)
            raise ValueError(
                "Argument `validation_split` is only supported for tensors or NumPy arrays; fit() was given a "
                f"{type(sources['x']).__name__}. Pass validation_data instead."
            )
        validation = arguments.get("validation_data")
        if validation is not None:
            sources["validation_data"] = validation[0] if isinstance(validation, (tuple, list)) else validation
        wanted = {key: value for key, value in sources.items() if followed(value)}
        joined = {key for key, value in wanted.items() if isinstance(value, PerReplica)}
        if not wanted or (engine.num_stages == 1 and not joined):
            return
        readers = [pipeline[0] for pipeline in engine.layout.pipelines]
        counts = None
        if engine.stage == 0:
            try:
                made = {key: wanted[key].make(engine.num_replicas, engine.replica) for key in joined}
            except Exception as exception:  # (the user's dataset function: every rank raises)
                counts = {"error": f"{type(exception).__name__}: {exception}"}
            else:
                wanted.update(made)
                counts = {key: num_batches(value) for key, value in wanted.items()}
        everyone = engine.world.allgather_json(counts)
        failed = [rank for rank in readers if "error" in everyone[rank]]
        if failed:
            raise PipelineDataError(
                f"rank {engine.world.world_rank_of(failed[0])}, which reads the data, could not make its replica's "
                f"data: {everyone[failed[0]]['error']}"
            )
        agreed = {key: everyone[readers[0]][key] for key in wanted}
        for key in joined:  # (each replica's own count: the longest sets the epoch)
            known = [everyone[rank][key] for rank in readers]
            agreed[key] = None if None in known else max(known)
        for key, value in wanted.items():
            if engine.stage == 0 and key in joined:
                class_weight = arguments.get("class_weight") if key == "x" else None
                shuffle = bool(arguments.get("shuffle")) if key == "x" else False
                # (one replica: its data is the whole data, read as any other)
                substituted = Joined(self, value, agreed[key], class_weight, shuffle, engine.num_replicas > 1)
            elif engine.stage == 0 or isinstance(value, Following):
                continue
            else:
                kind = "PerReplica" if key in joined else type(value).__name__
                substituted = Following(self, agreed[key], kind)
            if key == "x":
                arguments["x"] = substituted
            else:
                arguments["validation_data"] = substituted

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

    def read(self, iterator, joined: bool = False) -> Drawn:
        """A reader's next batch, after every rank agreed on it; ``StopIteration`` on every rank at the end.

        ``joined``: the replicas each read their own batch (a :class:`Joined`);
        the step's global batch is theirs joined (:meth:`_joined`).
        """
        if joined:
            return self._joined(iterator)
        data = self._next(iterator, joined=False)
        if data is None:
            self._draw(0)
            raise StopIteration
        size = _batch_size(keras.utils.unpack_x_y_sample_weight(data))
        description, key = _described(data)
        self._draw(1, size, self.digest(data), description, key)
        return Drawn(data)

    def follow(self) -> Drawn:
        """A follower's next batch: stand-ins of the readers' (``StopIteration`` where they have none)."""
        has_data, size, description = self._draw(FOLLOWS)
        if not has_data:
            raise StopIteration
        shares = self.engine.steps.shares
        return Drawn(stand_in(description, size), shares=shares)

    def _joined(self, iterator) -> Drawn:
        """A replica's own batch, with the labels and sample weights of the global batch the replicas' join into.

        Every replica's first stage draws at once; the other stages follow
        with the global batch's size and the replicas' shares. A replica whose
        data ended before the first replica's has an empty share of the step.
        """
        data = self._next(iterator, joined=True)
        size, description, key = 0, None, 0
        if data is not None:
            size = _batch_size(keras.utils.unpack_x_y_sample_weight(data))
            description, key = _described(data)
        has_data, _, agreed = self._draw(1 if data is not None else 0, size, 0, description, key, joined=True)
        if not has_data:
            raise StopIteration
        if data is None:  # (this replica's share of the step is empty)
            data = stand_in(agreed, 0)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        shares = self.engine.steps.shares
        gather = self.engine.replicas.allgather_rows

        def joined(value):
            return value if value is None else gather(np.asarray(value), list(shares))

        y, sample_weight = (keras.tree.map_structure(joined, part) for part in (y, sample_weight))
        return Drawn(keras.utils.pack_x_y_sample_weight(x, y, sample_weight), shares=shares)

    def _next(self, iterator, joined: bool):
        """A reader's next batch of the user's data, ``None`` at its end; an exception inside the user's ``map``,
        ``__getitem__`` or generator is told to every rank (each raises it) before it is raised here."""
        try:
            return next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            return None
        except Exception as exception:
            self._draw(FAILED, error=f"{type(exception).__name__}: {exception}", joined=joined)
            raise

    def _draw(self, state, size=0, digest=0, description=None, key=0, error=None, joined=False):
        return self.engine.steps.draw(self.phase, state, size, digest, description, key, error, joined)


class Drawing:
    """A dataset whose batches are drawn through :meth:`Feeding.read` (Keras' loop calls ``iter`` each epoch)."""

    def __init__(self, feeding: Feeding, dataset, joined: bool = False):
        self.feeding = feeding
        self.dataset = dataset
        self.joined = joined

    def __iter__(self):
        return _Reader(self.feeding, iter(self.dataset), self.joined)

    def __getattr__(self, name):  # (what else Keras asks of a dataset, e.g. its cardinality)
        if name in ("feeding", "dataset", "joined"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _Reader:
    def __init__(self, feeding: Feeding, iterator, joined: bool = False):
        self.feeding = feeding
        self.iterator = iterator
        self.joined = joined

    def __iter__(self):
        return self

    def __next__(self) -> Drawn:
        return self.feeding.read(self.iterator, self.joined)


class _AgreedBatches(compat.DataAdapter):
    """A Keras ``DataAdapter`` whose epoch has ``self.batches`` batches, the number every rank agreed on; their
    sizes are known only as each is drawn."""

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


class Joined(_AgreedBatches):
    """What a replica's first stage gives Keras' loop in place of its own data (``distribute_datasets_from_function``).

    Keras' own adapter of that data (``class_weight`` applied as ``fit``
    applies it) read through :meth:`Feeding.read` with ``joined``: each batch
    becomes the replica's share of a global batch (with one replica, the
    global batch). ``num_batches`` is the longest replica's, so that every
    rank's loop runs the same steps.
    """

    keras_pipe_described = "PerReplica"

    def __init__(self, feeding: Feeding, data, batches: int | None, class_weight=None, shuffle=False, joined=True):
        self.feeding = feeding
        self.inner = compat.data_adapter(data, class_weight=class_weight, shuffle=shuffle)
        self.batches = batches
        self.joined = joined

    def get_tf_dataset(self):
        return Drawing(self.feeding, without_autotuning(self.inner.get_tf_dataset()), self.joined)

    def get_numpy_iterator(self):
        return Drawing(self.feeding, self.inner.get_numpy_iterator(), self.joined)

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


class Following(_AgreedBatches):
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


def _described(data):
    """A batch's description and a digest of it (the key a follower compares with the one it holds)."""
    description = describe(data)
    text = json.dumps(description, sort_keys=True)
    return description, int(np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), np.int64)[0]) or 1


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
