"""A save that fails part way leaves the previous file intact and loadable by plain Keras.

Usage: save_faults.py TMPDIR errors|kill

``errors`` (2 ranks): saves a good ``model.keras`` and ``model.weights.h5``, trains
on, then saves over them while (1) a layer raises in the middle of the write and
(2) rank 0's file-size limit (``RLIMIT_FSIZE``, what a full disk looks like) is
too small for the file; each is a ``PipelineIOError`` on every rank, and the
previous files still load, in plain Keras, with the first weights. Then: a
damaged, an empty and a random-bytes file are reported as such, not "File not
found"; ``overwrite=False`` over an existing file is refused.

``kill``: the good files are saved, then the rank writing the failing layer's
values is killed (SIGKILL) in the middle of writing each again: into the one file
rank 0 writes (``model``, ``weights``: the layer's stage sends them), or into its
own shard of ``model.weights.json`` (``sharded``); the test then opens them with
plain Keras.
"""

import os
import resource
import sys

import keras
import numpy as np
from common import RANK, SaveFault, compile_args, data, save_fault_chain

import keras_pipe
from keras_pipe import PipelineIOError, PipelineModel

tmp, mode = sys.argv[1], sys.argv[2]
x, y, _ = data(n=64)


model = PipelineModel(save_fault_chain(), num_microbatches=2)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
model_file, weights_file = f"{tmp}/model.keras", f"{tmp}/model.weights.h5"
sharded_file = f"{tmp}/model.weights.json"
model.save(model_file)
model.save_weights(weights_file)
model.save_weights(sharded_file)
saved = model.get_weights()
if RANK == 0:
    np.save(f"{tmp}/saved.npy", np.concatenate([w.ravel() for w in saved]))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # the weights differ from the saved ones now


def expect_io_error(action, what, expected):
    try:
        action()
    except PipelineIOError as error:
        assert expected in str(error), (what, str(error))
        print(f"rank {RANK}: {what}: PipelineIOError: {error}", flush=True)
    else:
        raise AssertionError(f"{what} did not fail")


def check_previous_files_intact(what):
    if RANK != 0:
        return
    plain = keras.models.load_model(model_file)  # plain Keras, no keras_pipe
    for a, b in zip(plain.get_weights(), saved):
        np.testing.assert_array_equal(a, b, err_msg=f"{model_file} after {what}")
    for path in (weights_file, sharded_file):
        sequential = keras.Sequential(save_fault_chain())
        sequential.load_weights(path)
        for a, b in zip(sequential.get_weights(), saved):
            np.testing.assert_array_equal(a, b, err_msg=f"{path} after {what}")
    left = [name for name in os.listdir(tmp) if "partial" in name]
    assert not left, f"partial files left after {what}: {left}"
    shards = sorted(name for name in os.listdir(tmp) if name.startswith("model_stage"))
    assert len(shards) == 2, f"a failed sharded save's shards are removed, the previous save's kept: {shards}"
    print(f"PREVIOUS FILES INTACT after {what}", flush=True)


if mode == "kill":
    target = sys.argv[3]
    SaveFault.armed = "kill"  # (on every rank: the one holding the layer writes it)
    if target == "model":
        model.save(model_file)
    elif target == "sharded":  # (whichever rank holds the failing layer is killed writing its shard)
        model.save_weights(sharded_file)
    else:
        model.save_weights(weights_file)
    print(f"rank {RANK}: the save completed although the layer's writer was to be killed", flush=True)
    sys.exit(3)

# -- an exception part way through the write
SaveFault.armed = "raise"
expect_io_error(lambda: model.save(model_file), "save with a failing layer", "a layer failed while")
expect_io_error(lambda: model.save_weights(weights_file), "save_weights with a failing layer", "a layer failed")
expect_io_error(lambda: model.save_weights(sharded_file), "a sharded save with a failing layer", "a layer failed")
SaveFault.armed = None
check_previous_files_intact("an exception part way")

# -- a full disk: rank 0 may not write files larger than half the previous ones
limit = resource.getrlimit(resource.RLIMIT_FSIZE)
if RANK == 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(weights_file) // 2, limit[1]))
expect_io_error(lambda: model.save(model_file), "save beyond the file-size limit", "File too large")
expect_io_error(lambda: model.save_weights(weights_file), "save_weights beyond the file-size limit", "")
resource.setrlimit(resource.RLIMIT_FSIZE, limit)
check_previous_files_intact("a full disk")

# -- the same saves, completed, replace the files
model.save(model_file)
model.save_weights(weights_file)
current = model.get_weights()
if RANK == 0:
    for a, b in zip(keras.models.load_model(model_file).get_weights(), current):
        np.testing.assert_array_equal(a, b)

# -- overwrite=False is refused over an existing file (Keras would prompt on the terminal)
expect_io_error(lambda: model.save(model_file, overwrite=False), "save(overwrite=False)", "overwrite=False")

# -- damaged files are described, not "File not found"
if RANK == 0:
    whole = open(model_file, "rb").read()
    open(f"{tmp}/truncated.keras", "wb").write(whole[: len(whole) // 2])
    open(f"{tmp}/empty.keras", "wb").close()
    open(f"{tmp}/random.keras", "wb").write(np.random.default_rng(0).bytes(5000))
    weights = open(weights_file, "rb").read()
    open(f"{tmp}/truncated.weights.h5", "wb").write(weights[: len(weights) // 2])
expect_io_error(lambda: keras_pipe.load_model(f"{tmp}/truncated.keras"), "truncated", "written only in part")
expect_io_error(lambda: keras_pipe.load_model(f"{tmp}/empty.keras"), "empty", "empty.keras is empty")
expect_io_error(lambda: keras_pipe.load_model(f"{tmp}/random.keras"), "random", "(5000 bytes) but is not a readable")
expect_io_error(lambda: keras_pipe.load_model(f"{tmp}/missing.keras"), "missing", "missing.keras does not exist")
expect_io_error(lambda: model.load_weights(f"{tmp}/truncated.weights.h5"), "truncated weights", "written only in part")
print(f"SAVE FAULTS OK rank {RANK}", flush=True)
