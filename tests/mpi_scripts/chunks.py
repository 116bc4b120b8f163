"""Several model chunks a rank (interleaved 1F1B, ZB-V) train as keras.Sequential does, under real mpirun.

Run as ``mpirun -n P python chunks.py [case ...]``; prints ``CHUNKS OK <case> rank R`` per case and rank.

- ``equivalence``: the split backward's test chain under interleaved 1F1B
  with 2 and 3 chunks and ZB-V, a last batch too short for interleaving's
  rounds (GPipe over chunks): history, weights, ``evaluate`` and ``predict``;
- ``features``: ``global_clipnorm`` (the whole model's norm over every
  chunk), a Keras mask crossing chunks (a recorded chunk among split ones),
  a masked output under a mean loss (counted over the whole batch first);
- ``saving``: ``model.save`` of a chunked pipeline, ``keras_pipe.load_model``
  into a chunked and a one-chunk pipeline, ``to_keras``; ``summary()``;
- ``errors``: what chunks do not run is a clear error on every rank.
"""

import os
import sys
import tempfile

import keras
import numpy as np
from common import RANK, SIZE, assert_close, compile_args, data, forced_pick, split_layers, trained_on_rank_0

import keras_pipe
from keras_pipe import PipelineConfigError, PipelineModel

x, y, sw = data()
x_test, y_test, _ = data(n=57, seed=1)
# 182 training rows in batches of 30: the last has 2 rows, fewer micro-batches than interleaving's rounds
fit_args = dict(batch_size=30, epochs=2, shuffle=False, validation_split=0.1, verbose=0)
SCHEDULES = [("interleaved-1f1b", 2, 2 * SIZE), ("zb-v", 2, 4), ("interleaved-1f1b", 3, SIZE)]


def reference(chain, compiled, fit, evaluate=None, predict=None):
    """``Sequential(chain())`` (every rank builds it) trained on rank 0: its initial weights, and what it gave."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(chain())
    initial = model.get_weights()
    model.compile(**compiled)
    return initial, trained_on_rank_0(model, fit, evaluate, predict)


def equal(what, model, history, expected):
    assert sorted(history) == sorted(expected["history"]), (what, sorted(history), sorted(expected["history"]))
    for key in expected["history"]:
        assert_close(history[key], expected["history"][key], f"{what} history {key}")
    for i, (a, b) in enumerate(zip(model.get_weights(), expected["weights"])):
        assert_close(a, b, f"{what} weight {i}")
    steps = (int(model.optimizer.iterations), expected["steps"])
    assert steps[0] == steps[1], (what, "optimizer steps", steps)


TRAIN = dict(x=x, y=y, sample_weight=sw, **fit_args)


def equivalence():
    # (the recorded backward's chain, layers(), trains under ZB-V in equivalence.py on 4 ranks; chunks
    # whose backward is recorded train here in features(): a Keras mask crosses them)
    for chain in (split_layers,):
        initial, expected = reference(
            chain, compile_args(), TRAIN, evaluate=dict(x=x_test, y=y_test), predict=dict(x=x_test)
        )
        for schedule, chunks, m in SCHEDULES:
            model = PipelineModel(chain(), num_microbatches=m, schedule=schedule, num_chunks=chunks)
            model.set_weights(initial)
            model.compile(**compile_args())
            history = model.fit(x, y, sample_weight=sw, **fit_args).history
            what = f"P={SIZE} {chain.__name__} {schedule} v={chunks} m={m}"
            assert len(model.engine.chunks) == chunks, (what, model.engine.chunks)
            equal(what, model, history, expected)
            assert_close(model.evaluate(x_test, y_test, verbose=0), expected["evaluate"], f"{what} evaluate")
            assert_close(model.predict(x_test, verbose=0), expected["predict"], f"{what} predict")
        # schedule="auto" times 1F1B and ZB-H1 on one stage a rank and ZB-V on its V of 2P virtual stages (the
        # weights that place elsewhere copied there), none of it training; whichever it takes trains as Sequential:
        # ZB-V (the V kept, one stage a rank freed), ZB-H1 (back to one stage a rank), and its own pick
        for forced in ("zb-v", "zb-h1", None):
            with forced_pick(forced):
                model = PipelineModel(chain(), num_microbatches=4, schedule="auto")
                model.set_weights(initial)
                model.compile(**compile_args())
                history = model.fit(x, y, sample_weight=sw, **fit_args).history
            picker = model.engine.picker
            what = f"P={SIZE} {chain.__name__} auto, picked {picker.picked} (forced {forced})"
            assert forced in (None, picker.picked) and picker.schedules() == ("1f1b", "zb-h1", "zb-v"), what
            assert len(model.engine.chunks) == (2 if picker.picked == "zb-v" else 1), what
            assert len(set(model.engine.world.allgather_json(picker.picked))) == 1, (what, "ranks picked apart")
            held = {v.path for v in model.weights}  # (Keras' own list: the layers this rank holds, no other)
            assert held == {v.path for layer in model.engine.own_layers() for v in layer.weights}, what
            equal(what, model, history, expected)
            assert_close(model.evaluate(x_test, y_test, verbose=0), expected["evaluate"], f"{what} evaluate")
            assert_close(model.predict(x_test, verbose=0), expected["predict"], f"{what} predict")
            print(f"rank {RANK}: {what}: {picker.describe()}", flush=True) if RANK == 0 else None
        # a chunked schedule given, its m timed (num_microbatches="auto"): the timing stays on its own placement
        model = PipelineModel(chain(), num_microbatches="auto", schedule="interleaved-1f1b", num_chunks=3)
        model.set_weights(initial)
        model.compile(**compile_args())
        history = model.fit(x, y, sample_weight=sw, **fit_args).history
        what = f"P={SIZE} {chain.__name__} interleaved-1f1b v=3 m=auto, picked {model.engine.picker.picked}"
        assert len(model.engine.chunks) == 3 and model.engine.num_chunks == 3, what
        equal(what, model, history, expected)


def features():
    # global_clipnorm: one norm over every chunk of every rank, one update (iterations counted once)
    def clipped():
        return {**compile_args(), "optimizer": keras.optimizers.SGD(0.5, global_clipnorm=0.05)}

    initial, expected = reference(split_layers, clipped(), TRAIN)
    model = PipelineModel(split_layers(), num_microbatches=4, schedule="zb-v")
    model.set_weights(initial)
    model.compile(**clipped())
    history = model.fit(x, y, sample_weight=sw, **fit_args).history
    equal(f"P={SIZE} zb-v global_clipnorm", model, history, expected)

    # a Keras mask crossing chunks (their backward recorded) and a masked output under a mean loss
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, 20, size=(97, 10))
    lengths = rng.integers(2, 11, size=97)
    tokens[np.arange(10)[None, :] >= lengths[:, None]] = 0
    tags = rng.integers(0, 3, size=(97, 10))

    def tagger():
        return [
            keras.Input((10,), dtype="int32"),
            keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3, activation="softmax"),
        ]

    def tagging():
        return dict(
            optimizer=keras.optimizers.Adam(1e-2),
            loss="sparse_categorical_crossentropy",
            metrics=["sparse_categorical_accuracy"],
            jit_compile=False,
        )

    tagged = dict(x=tokens, y=tags, batch_size=32, epochs=2, shuffle=False, verbose=0)
    initial, expected = reference(tagger, tagging(), tagged, evaluate=dict(x=tokens, y=tags, batch_size=48))
    for schedule, m in (("zb-v", 3), ("interleaved-1f1b", 2 * SIZE)):
        model = PipelineModel(tagger(), num_microbatches=m, schedule=schedule)
        model.set_weights(initial)
        model.compile(**tagging())
        history = model.fit(tokens, tags, batch_size=32, epochs=2, shuffle=False, verbose=0).history
        equal(f"P={SIZE} {schedule} masked tagger", model, history, expected)
        evaluated = model.evaluate(tokens, tags, batch_size=48, verbose=0)
        assert_close(evaluated, expected["evaluate"], "tagger evaluate")


def saving():
    directory = tempfile.mkdtemp(prefix="keras_pipe_chunks_") if RANK == 0 else None
    directory = model_comm().bcast(directory, root=0)
    path = os.path.join(directory, "chunked.keras")
    keras.utils.set_random_seed(7)
    initial = keras.Sequential(split_layers()).get_weights()
    model = PipelineModel(split_layers(), num_microbatches=4, schedule="zb-v")
    model.set_weights(initial)
    model.compile(**compile_args())
    model.fit(x, y, sample_weight=sw, **fit_args)
    lines = []
    model.summary(print_fn=lines.append)
    if RANK == 0:
        header = f"{SIZE} stages of 2 chunks each ({2 * SIZE} virtual stages)"
        assert header in lines[0], lines
        assert any(f"{2 * SIZE - 1} (rank 0)" in line for line in lines), lines  # the V ends on rank 0
    model.save(path)
    expected_pred = model.predict(x_test, verbose=0)
    # the same file into a chunked and a one-chunk pipeline: the same weights, optimizer and predictions
    for options, chunks in ((dict(schedule="interleaved-1f1b", num_microbatches=2 * SIZE), 2), (dict(), 1)):
        loaded = keras_pipe.load_model(path, **options)
        assert loaded.engine.num_chunks == chunks, (options, loaded.engine.num_chunks)
        assert_close(loaded.predict(x_test, verbose=0), expected_pred, f"loaded {options} predict")
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            assert_close(a, b, f"loaded {options} weights")
        assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations), options
        # training goes on as it would have
        loaded.fit(x, y, sample_weight=sw, **dict(fit_args, epochs=1))
    whole = model.to_keras()
    if RANK == 0:
        assert_close(whole.predict(x_test, verbose=0), expected_pred, "to_keras predict")


def model_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def errors():
    def raises(text, **options):
        try:
            PipelineModel(split_layers(), **options)
        except PipelineConfigError as error:
            assert text in str(error), (options, str(error))
        else:
            raise AssertionError(f"no error for {options}")

    raises("not a multiple of", schedule="interleaved-1f1b", num_microbatches=2 * SIZE + 1)
    raises("two chunks a rank", schedule="zb-v", num_chunks=3)
    raises("one chunk a rank", schedule="1f1b", num_chunks=2)
    model = PipelineModel(split_layers(), schedule="zb-v", balance="time")
    try:
        model.build((None, 12))
    except PipelineConfigError as error:
        assert "balance='time'" in str(error) and f"{2 * SIZE} sizes" in str(error), str(error)
    else:
        raise AssertionError("balance='time' with chunks built")
    model = PipelineModel(split_layers(), schedule="zb-v", balance=[1] * SIZE)
    try:
        model.build((None, 12))
    except PipelineConfigError as error:
        assert f"there are {2 * SIZE} virtual stages: balance lists {2 * SIZE} sizes" in str(error), str(error)
    else:
        raise AssertionError("a balance of one size a rank built with two chunks a rank")


def replicas():
    """Virtual stages with replicas (issue 49): two pipelines of SIZE / 2 ranks, each with two chunks a rank;
    every replica's gradients of every chunk summed before the one update, with Adam and global_clipnorm. And
    ``schedule="auto"`` taking ZB-V with replicas: each pipeline cuts its model again after the timing, the
    weights moving within it, and the replicas stay alike."""

    def clipped():
        return {**compile_args(), "optimizer": keras.optimizers.Adam(1e-2, global_clipnorm=1.0)}

    for compiled in (compile_args, clipped):
        initial, expected = reference(split_layers, compiled(), TRAIN)
        runs = (("zb-v", 4), ("interleaved-1f1b", SIZE)) + ((("auto", 4),) if compiled is clipped else ())
        for schedule, m in runs:
            with forced_pick("zb-v" if schedule == "auto" else None):
                model = PipelineModel(split_layers(), num_microbatches=m, schedule=schedule, num_stages=SIZE // 2)
                model.set_weights(initial)
                model.compile(**compiled())
                history = model.fit(x, y, sample_weight=sw, **fit_args).history
            what = f"P={SIZE // 2} x 2 replicas {schedule} {compiled.__name__}"
            assert model.num_replicas == 2 and len(model.engine.chunks) == 2, what
            equal(what, model, history, expected)


CASES = {"equivalence": equivalence, "features": features, "saving": saving, "errors": errors, "replicas": replicas}
for name in sys.argv[1:] or list(CASES):
    CASES[name]()
    print(f"CHUNKS OK {name} rank {RANK}", flush=True)
sys.exit(0)
