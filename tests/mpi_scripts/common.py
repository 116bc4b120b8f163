"""Models and data shared by the MPI test scripts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import fcntl  # noqa: E402
import hashlib  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
_REFERENCES = []  # a communicator of its own, made at the first on_rank_0 (collective: not at import, where a
# rank that failed in its first lines would leave the others waiting in it instead of keras_pipe's start timeout)


def _remembered(key: str, compute):
    """``compute()``, or what it returned for ``key`` in an earlier launch of the same test session.

    The unsplit references are the same numbers in every launch that trains them (the same seed, model, data and
    arguments: hub.py's GPT-2 on two ranks and on four, fine_tuning.py's cases on 1, 2 and 4 ranks), and their
    training is most of rank 0's time. ``$KERAS_PIPE_TEST_REFERENCES`` (``tests/conftest.py`` makes one a session)
    keeps each once, keyed by the caller (who vouches that the result depends on nothing else) with this script's
    name and TensorFlow's thread count (one rank on two cores runs its products on two threads, whose sums may round
    otherwise). Two launches asking at once: the second waits on the first's lock and reads its result.
    """
    directory = os.environ.get("KERAS_PIPE_TEST_REFERENCES")
    if not directory:
        return compute()
    import tensorflow as tf

    threads = tf.config.threading.get_intra_op_parallelism_threads()
    name = f"{os.path.basename(sys.argv[0])} {key} threads={threads}"
    path = os.path.join(directory, hashlib.sha1(name.encode()).hexdigest())
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            with open(path, "rb") as stored:
                return pickle.load(stored)
        result = compute()
        with open(path + ".part", "wb") as stored:
            pickle.dump(result, stored)
        os.replace(path + ".part", path)
        return result


def digest(*structures) -> str:
    """A short hash of nested arrays, numbers and strings: part of a :func:`_remembered` key."""
    hashed = hashlib.sha1()
    for item in keras.tree.flatten(structures):
        if hasattr(item, "shape") and hasattr(item, "dtype"):
            array = np.asarray(item)
            hashed.update(f"{array.shape}{array.dtype}".encode())
            hashed.update(np.ascontiguousarray(array).tobytes())
        else:
            hashed.update(repr(item).encode())
    return hashed.hexdigest()[:16]


def on_rank_0(compute, *args, key: str | None = None):
    """``compute(*args)`` on rank 0 alone; every rank returns its result (pickled), or raises rank 0's error.

    For the unsplit references the scripts compare the pipeline with, which
    every rank would otherwise train again: in ``hub.py`` on four ranks that
    was half of each rank's time. The other ranks wait with sleeps (MPICH's
    blocking receive would spin a core each). ``key``: the result is the same
    wherever it is computed with this key (see :func:`_remembered`).
    """
    if not _REFERENCES:
        _REFERENCES.append(MPI.COMM_WORLD.Dup())
    comm = _REFERENCES[0]
    if RANK == 0:
        try:
            result = (True, compute(*args) if key is None else _remembered(key, lambda: compute(*args)))
        except BaseException as error:
            for rank in range(1, SIZE):
                comm.send((False, f"{type(error).__name__}: {error}"), dest=rank)
            raise
        for rank in range(1, SIZE):
            comm.send(result, dest=rank)
        return result[1]
    while not comm.iprobe(source=0):
        time.sleep(0.005)
    ok, result = comm.recv(source=0)
    if not ok:
        raise RuntimeError(f"rank 0 failed to compute the reference: {result}")
    return result


def trained_on_rank_0(
    model, fit: dict, evaluate: dict | None = None, predict: dict | None = None, key: str | None = None
) -> dict:
    """``model.fit(**fit)`` on rank 0 alone (see :func:`on_rank_0`): what every rank compares its pipeline with.

    ``model`` is the unsplit reference, built and compiled on every rank alike
    (so that Keras' auto-named objects are named alike on every rank). Returns
    its ``history``, ``weights`` and ``steps`` (the optimizer's iterations)
    after the fit, then ``evaluate`` and ``predict`` called with those
    arguments (``None`` where not given), on every rank. ``key``: see
    :func:`on_rank_0` (rank 0's ``model`` is then not always the trained one).
    """

    if key is not None:  # (the reference's initial weights and every array it is given are part of the key)
        key = f"{key} {digest(model.get_weights(), fit, evaluate, predict)}"

    def run():
        history = model.fit(**fit).history
        return dict(
            history=history,
            weights=model.get_weights(),
            steps=int(model.optimizer.iterations),
            evaluate=None if evaluate is None else model.evaluate(**{"verbose": 0, **evaluate}),
            predict=None if predict is None else model.predict(**{"verbose": 0, **predict}),
        )

    return on_rank_0(run, key=key)


def data(n=203, features=12, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=n)
    sample_weight = rng.uniform(0.5, 1.5, size=n).astype("float32")
    return x, y, sample_weight


def layers(features=12, classes=3, width=16, regularize=True):
    """A chain of 6 layers without dropout, with weight and activity regularizers."""
    reg = keras.regularizers.L2(0.01) if regularize else None
    act = keras.regularizers.L1(1e-3) if regularize else None
    return [
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu", kernel_regularizer=reg),
        keras.layers.Dense(width, activation="tanh"),
        keras.layers.Dense(width, activation="relu", activity_regularizer=act),
        keras.layers.Reshape((width // 4, 4)),
        keras.layers.Flatten(),
        keras.layers.Dense(classes, activation="softmax"),
    ]


def split_layers(features=12, classes=3, width=16):
    """A chain every stage of which runs the split backward (I + batched W), with both kinds of regularizer."""
    return [
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(width, activation="tanh"),
        keras.layers.Dense(width, activity_regularizer=keras.regularizers.L1(1e-3)),
        keras.layers.Activation("relu"),
        keras.layers.Reshape((width // 4, 4)),
        keras.layers.Flatten(),
        keras.layers.Dense(classes, activation="softmax"),
    ]


def compile_args(jit_compile=False):
    """Adam, sparse cross-entropy, two metrics. XLA off: the behaviour under test does not depend on it, and
    compiling each program for XLA doubles a short launch; equivalence.py tests XLA (the default) itself."""
    return dict(
        jit_compile=jit_compile,
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
    )


def assert_close(actual, expected, what, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=f"rank {RANK}: {what}")


@keras.saving.register_keras_serializable(package="tests")
class SaveFault(keras.layers.Dense):
    """A ``Dense`` whose weights' write raises, or kills this process, once armed (class-wide: saving copies layers)."""

    armed = None  # None, "raise" or "kill"

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if SaveFault.armed == "raise":
            raise RuntimeError("a layer failed while its weights were written")
        if SaveFault.armed == "kill":
            print(f"rank {RANK}: killed while it writes the weights of {self.name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def save_fault_chain():
    """Three Dense layers (the middle one a :class:`SaveFault`), large enough that a write takes a while."""
    return [
        keras.Input((12,)),
        keras.layers.Dense(256, activation="relu"),
        SaveFault(256, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ]


def tiny_llama(vocabulary=40, hidden=16):
    """keras_hub's ``LlamaCausalLM`` of 3 layers from constructor arguments (rotary, untied embeddings)."""
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=vocabulary,
        num_layers=3,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=hidden,
        intermediate_dim=32,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


class forced_pick:
    """``with forced_pick("zb-v"):`` ``schedule="auto"`` times its candidates as always, then takes ``name`` (where it
    is one): the path a pick that cuts the model otherwise takes, on models whose timing would not choose it here.
    The timing and the pick are keras_pipe's own (this replaces the comparison of the times, nothing of MPI or Keras).
    """

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        from keras_pipe.schedules.auto import SchedulePicker

        self.real = real = SchedulePicker.decide
        name = self.name

        def decide(picker, everyone):
            real(picker, everyone)
            if name in picker.candidates:
                picker.picked = name
            return picker.picked

        SchedulePicker.decide = decide
        return self

    def __exit__(self, *exc):
        from keras_pipe.schedules.auto import SchedulePicker

        SchedulePicker.decide = self.real
