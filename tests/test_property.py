"""Random ranks, micro-batch counts, batch and data sizes and widths: training equals Sequential.

Each launch trains three random configurations one after another (a launch
costs ~15 s of TensorFlow imports on 2 cores), under a real ``mpirun`` with
a timeout, so an example that hung would fail the test instead of the
suite. The examples are drawn from a fixed seed per rank count, so that CI
runs the same ones every time.
"""

import json
import random
import re

import pytest
from mpi import run_mpi


def configurations(ranks: int, count: int = 3) -> list[dict]:
    rng = random.Random(f"property-{ranks}")
    return [
        dict(
            m=rng.randint(1, 6),
            batch=rng.randint(1, 24),
            n=rng.randint(1, 60),
            width=rng.randint(1, 9),
            depth=rng.randint(0, 4),
            schedule=rng.choice(["1f1b", "gpipe", "zb-h1"]),
        )
        for _ in range(count)
    ]


# (four ranks: two middle stages, and stages left without a layer; one, two and three ranks in the slow tier: every
# other launch of the suite trains on two ranks already, and on three dropin.py and saving.py's resume cut stages of
# unequal size)
@pytest.mark.parametrize("ranks", [pytest.param(n, marks=pytest.mark.slow) for n in (1, 2, 3)] + [4])
def test_training_equals_sequential_or_fails_clearly(ranks):
    configs = configurations(ranks)
    launch = run_mpi(ranks, "property.py", json.dumps(configs), timeout=300)
    assert launch.returncode == 0, launch.output
    for config in configs:
        text = json.dumps(config)
        # (searched, not split into lines: the launcher may join two ranks' lines)
        equal = [f"PROPERTY equal rank {r} of {ranks}: {text}" in launch.output for r in range(ranks)]
        error = [re.search(rf"PROPERTY error rank {r}: .* :: {re.escape(text)}", launch.output) for r in range(ranks)]
        assert all(equal) or all(error), (config, equal, error, launch.output)  # the same on every rank
        layers = config["depth"] + 1
        if layers < ranks:  # the last stages hold no layer (a warning, once): training still equals Sequential
            assert f"{ranks} stages but the model has only {layers} layers" in launch.output, launch.output
