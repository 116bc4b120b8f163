"""Splitting layers over stages, and knowing every shape without other stages' weights."""

import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import pytest  # noqa: E402

from keras_pipe.errors import PipelineConfigError  # noqa: E402
from keras_pipe.partition import (  # noqa: E402
    balance_by_params,
    check_balance,
    check_num_stages,
    infer_specs,
    stage_bounds,
    summary_lines,
)


def seed_layers():
    return [
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(10, activation="softmax"),
    ]


def test_specs_without_creating_weights():
    layers = seed_layers()
    specs = infer_specs(layers, (None, 28, 28), "float32")
    assert [s.output_shape for s in specs] == [
        (None, 784),
        (None, 128),
        (None, 128),
        (None, 128),
        (None, 128),
        (None, 10),
    ]
    assert [s.num_params for s in specs] == [0, 100480, 16512, 16512, 0, 1290]
    assert specs[1].weight_shapes == (((784, 128), "float32"), ((128,), "float32"))
    assert not any(layer.weights for layer in layers), "probing must not build the real layers"


def _resident_gib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 2**20


def test_specs_allocate_none_of_the_weights():
    # 4 x Dense(8192): 1 GiB of weights, which Keras' plain StatelessScope
    # allocates when it exits; every rank probes every layer.
    layers = [keras.layers.Dense(8192) for _ in range(4)]
    before = _resident_gib()
    specs = infer_specs(layers, (None, 8192), "float32")
    with keras.StatelessScope():  # a later scope must not allocate them either
        pass
    assert sum(s.num_params for s in specs) == 4 * (8192 * 8192 + 8192)
    assert _resident_gib() - before < 0.25


def test_balance_by_params_spreads_the_cost():
    specs = infer_specs(seed_layers(), (None, 28, 28), "float32")
    assert balance_by_params(specs, 1) == [6]
    balance = balance_by_params(specs, 2)
    assert balance == [2, 4]  # the 784x128 layer alone outweighs the rest
    assert sum(balance_by_params(specs, 4)) == 6
    assert all(b >= 1 for b in balance_by_params(specs, 6))


def test_more_stages_than_layers():
    with pytest.raises(PipelineConfigError, match="5 ranks but the model has only 3 layers"):
        check_num_stages(3, 5)


def test_balance_must_cover_the_layers():
    with pytest.raises(PipelineConfigError, match=r"balance \[3, 3\] covers 6 layers but the model has 7"):
        check_balance([3, 3], 7, 2)
    with pytest.raises(PipelineConfigError, match="has 3 stages but the job has 2 ranks"):
        check_balance([1, 1, 5], 7, 2)
    with pytest.raises(PipelineConfigError, match="positive integers"):
        check_balance([0, 7], 7, 2)
    assert check_balance((3, 4), 7, 2) == [3, 4]


def test_stage_bounds():
    assert stage_bounds([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]


def test_a_layer_that_cannot_take_the_input_is_named():
    layers = [keras.layers.Dense(4), keras.layers.Conv2D(2, 3)]
    with pytest.raises(PipelineConfigError, match="layer 1"):
        infer_specs(layers, (None, 8), "float32")


def test_summary_shows_each_layer_with_its_stage():
    specs = infer_specs(seed_layers(), (None, 28, 28), "float32")
    lines = summary_lines(specs, [2, 4])
    table = "\n".join(lines)
    assert re.search(r"dense(_\d+)? \(Dense\)\s+0\s+\(None, 128\)\s+100,480", table), table
    assert lines[-1] == "Params per stage: 0: 100,480, 1: 34,314"
    assert lines[-2] == "Total params: 134,794"
