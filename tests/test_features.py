"""What large models need, each equal to keras.Sequential under real mpirun (see mpi_scripts/features.py)."""

import pytest
from mpi import run_mpi

CASES = [
    "clipnorm",
    "clipnorm-replicas",
    "clipnorm-embedding",
    "dropout-stream",
    "bfloat16",
    "float16",
    "float16-overflow",
    "masks",
    "masked-outputs",
    "recompute",
    "deferred-batchnorm",
    "several-tensors",
    "batch-statistic-loss",
]


# 4 ranks: one pipeline of 4 stages (masks and skip connections cross three boundaries) and, for
# clipnorm-replicas, 2 stages x 2 replicas; features.py runs on any number of ranks.
@pytest.mark.parametrize("nprocs", [4])
def test_features_equal_sequential(nprocs):
    launch = run_mpi(nprocs, "features.py", *CASES, timeout=900)
    launch.assert_cases("FEATURE OK {} ", CASES, nprocs)
