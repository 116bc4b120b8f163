"""Internal: what every ``fit``/``evaluate``/``predict`` does around Keras' own loop.

Before the call, the ranks check that they all made the same call on the
same model (:mod:`keras_pipe.model.fingerprint`), only rank 0 keeps its progress
bar, callbacks are adapted for several ranks (:mod:`keras_pipe.model.callbacks`)
and, with replicas, shuffling is seeded alike and weights are copied from
the first replica. Each step then starts with a tiny agreement that every
rank has a batch of the same size, and the call ends with one more.
"""

from __future__ import annotations

import contextlib
import inspect

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.engine.consistency import COMPARED_ARGUMENTS, batch_digest, describe_argument
from keras_pipe.model import compile_checks
from keras_pipe.model import weights as _weights
from keras_pipe.model.callbacks import adapt_callbacks
from keras_pipe.model.feeding import Feeding
from keras_pipe.model.fingerprint import model_fingerprint
from keras_pipe.mpi.agreement import check_same_everywhere


class CallPreparation:
    """The collective preamble and ending of one model's ``fit``/``evaluate``/``predict`` calls."""

    def __init__(self, model):
        self.model = model
        self.depth = 0  # calls in progress: fit's validation runs evaluate inside it
        self.feeding = Feeding(model.engine, self.digest)  # (who reads the data: see feeding.py)

    @contextlib.contextmanager
    def prepare(self, name: str, method, args, kwargs):
        """Binds the call's arguments and checks that every rank made the same call; yields them for Keras."""
        model, engine = self.model, self.model.engine
        built_before = engine.built
        bound = inspect.signature(method).bind(model, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        compile_checks.check_no_strategy(model)  # (before any communication: every rank raises)
        if name != "predict" and model.compiled:
            compile_checks.check_model(model)
        shared = {key: describe_argument(value) for key, value in arguments.items() if key in COMPARED_ARGUMENTS}
        if self.depth:  # (inside a call, the other stages' data may be stand-ins: their lengths are compared)
            shared.update({key: _lengths(arguments.get(key)) for key in ("x", "y", "validation_data")})
        shared["call"] = name
        check_same_everywhere(engine.world, f"the model and the {name}() call", {**model_fingerprint(model), **shared})
        engine.steps.begin_call()
        if model._builder.input_spec is not None or model._builder.source is not None:
            model.build()  # BackupAndRestore and friends expect a built model
        arguments["callbacks"] = adapt_callbacks(arguments.get("callbacks"), engine.world)
        if engine.world.rank != 0:
            arguments["verbose"] = 0
        if name == "fit" and engine.num_replicas > 1:
            if arguments.get("shuffle", True):
                seed_shuffling(engine.world)
            if built_before:
                _weights.copy_from_first_replica(engine)  # replicas start alike, as Horovod's broadcast does
        steps = model._steps
        outer = steps.stand_in_inputs
        steps.stand_in_inputs = stand_in_inputs(model, arguments)
        self.feeding.substitute(arguments)  # (datasets and generators: the first stage alone reads them)
        self.depth += 1
        self.feeding.calls.append(name)
        try:
            yield arguments
        finally:
            self.depth -= 1
            self.feeding.calls.pop()
            steps.stand_in_inputs = outer
        engine.steps.agree("end", False, 0)

    def digest(self, data) -> int:
        """With replicas, a first stage's digest of its batch (compared between replicas); else 0."""
        engine = self.model.engine
        if data is None or engine.num_replicas == 1 or engine.stage != 0:
            return 0
        return batch_digest(keras.utils.unpack_x_y_sample_weight(data))


def python_step_function(model, step, phase: str):
    """Keras' ``train_function``/``test_function``: Python around the step, so that every step communicates.

    The compute inside the step runs in compiled programs (see
    :mod:`keras_pipe.stage.compute`). Before each step the ranks agree that all of
    them have a batch of the same size: as Keras' loop draws it
    (:mod:`keras_pipe.model.feeding`), or here for ``train_on_batch``'s.
    """

    def function(iterator):
        logs = None
        agreed = model._calls.feeding.agreed(iterator)  # (Keras' loop's batches: agreed as they are drawn)
        for _ in range(model.steps_per_execution):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                data = None
            model._steps.drawn = data if agreed else None  # (a replica's own share: its place in the batch)
            if agreed:
                data = None if data is None else data.data
            else:  # (train_on_batch's data, given to every rank)
                size = 0 if data is None else batch_size_of(data)
                model.engine.steps.agree(phase, data is not None, size, model._calls.digest(data))
            if data is None:
                if logs is None:
                    raise StopIteration from None
                break
            logs = step(data)
        return logs

    return function


def stand_in_inputs(model, arguments: dict) -> bool:
    """A rank that does not read the data gets zero-size arrays in its place; whether ``x``'s are.

    Only the first stage reads ``x`` and ``y`` (the labels travel from it to
    the last), yet Keras' loop converts and holds whatever it is given: every
    rank would hold a copy of the data set and of each batch. Where ``x``
    (and the validation data's) are NumPy arrays and the model is built,
    every other stage gets arrays of shape ``(n, 0)``: the same samples
    (Keras draws the same batches and shuffles them alike), no bytes. Their
    shapes are first checked against the model's inputs on every rank, so
    that a mismatch is the same error everywhere. The labels, where they
    are arrays too, become ``(n, 0, *their shape[1:])`` of their dtype: no
    bytes, yet every rank still knows what the last stage will receive and
    builds the same loss (:func:`target_likes`; the step tells them by their
    shape, :func:`stood_in`). Not with ``class_weight``, which Keras turns
    into sample weights from the labels on every rank.
    Sample weights (a number a sample) stay as they are. Datasets and
    generators are left as they are; arrays that already are stand-ins
    (``fit`` passes its validation data on to ``evaluate``) are taken as
    they are.
    """
    engine = model.engine
    if not engine.built or model._builder.source is None:
        return False
    sources = [("x", arguments.get("x"))]
    validation = arguments.get("validation_data")
    if isinstance(validation, (tuple, list)) and validation:
        sources.append(("validation_data", validation[0]))
    if not all(_arrays(x) for _, x in sources):
        return False
    if engine.stage > 0 and all(_zero_width_already(x) for _, x in sources):
        return True
    for _, x in sources:  # (on every rank, the first stage too: the same error everywhere, at once)
        compat.check_input_shapes(model._builder.source, x)
    if engine.stage == 0:
        return False
    arguments["x"] = _zero_width(arguments["x"])
    if arguments.get("class_weight") is None and _arrays(arguments.get("y")):
        arguments["y"] = _zero_size(arguments["y"])
    if len(sources) > 1:
        rest = list(validation[1:])
        if rest and _arrays(rest[0]):
            rest[0] = _zero_size(rest[0])
        arguments["validation_data"] = (_zero_width(validation[0]), *rest)
    return True


def target_likes(y):
    """Stand-in labels (``(b, 0, *shape)``) as arrays of their whole shape and dtype that hold no bytes.

    What a stage that does not read the labels needs of them: their
    structure, shapes and dtypes, to build the loss as the last stage does
    and (on the last stage) to receive the first stage's.
    """
    return keras.tree.map_structure(lambda a: np.broadcast_to(np.zeros((), a.dtype), (a.shape[0], *a.shape[2:])), y)


def _arrays(x) -> bool:
    leaves = keras.tree.flatten(x) if x is not None else []
    return bool(leaves) and all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in leaves)


def _lengths(value):
    """What every rank agrees on about data that may be a stand-in: each array's length."""
    return keras.tree.map_structure(lambda a: len(a) if hasattr(a, "shape") else describe_argument(a), value)


def _zero_width_already(x) -> bool:
    return all(a.shape[1:] == (0,) for a in keras.tree.flatten(x))


def _zero_width(x):
    return keras.tree.map_structure(lambda a: np.zeros((len(a), 0), np.float32), x)


def _zero_size(y):
    return keras.tree.map_structure(lambda a: np.zeros((len(a), 0, *a.shape[1:]), a.dtype), y)


def stood_in(y) -> bool:
    """Whether the labels ``y`` are stand-ins (``train_on_batch`` inside ``fit`` gives real ones)."""
    leaves = keras.tree.flatten(y) if y is not None else []
    return bool(leaves) and all(isinstance(a, np.ndarray) and a.ndim >= 2 and a.shape[1] == 0 for a in leaves)


def seed_shuffling(world) -> None:
    """Makes every rank's ``shuffle=True`` draw the same order (replicas share each global batch).

    Keras shuffles arrays with ``tf.random.shuffle`` under TensorFlow's
    global seed; without one, each process draws its own order. If the
    script set no seed, rank 0 draws one and every rank sets it.
    """
    if all(world.allgather_json(compat.global_seed() is None)):
        seed = int(np.random.default_rng().integers(2**31 - 1)) if world.rank == 0 else None
        tf.random.set_seed(world.bcast_json(seed, root=0))


def batch_size_of(data) -> int:
    x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    # (the first input that is there: None stands for an optional input, or is Keras' error to raise)
    first = next((a for a in tf.nest.flatten((x, y)) if a is not None), None)
    return 0 if first is None else int(first.shape[0])
