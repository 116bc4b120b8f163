"""Data-parallel replicas of the pipeline train as Sequential on the global batch.

On 2 ranks as 1 stage x 2 replicas, on 4 ranks as 2 x 2 and 1 x 4, each
with 1 and 3 micro-batches: history, weights, evaluate and predict equal
single-process Sequential; a one-sample last batch (replicas without a
share); save, load on another layout and train on; shuffle without a seed;
replicas given different data fail with a clear error; summary's layout;
balance="time" agreed by every rank.
"""

import pytest
from mpi import run_mpi


# 4 ranks (2 x 2): the same script and cases in test_network.py, over TCP between "hosts" (the harder transport),
# in the default suite; 2 ranks (one stage, two replicas: the same all-reduce, no crossing) in the slow tier (four
# replicas of one stage read a checkpoint in test_saving.py's default launches).
@pytest.mark.parametrize("nprocs", [pytest.param(2, marks=pytest.mark.slow)])
def test_replicas_equal_sequential(nprocs):
    launch = run_mpi(nprocs, "replicas.py", timeout=600)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("REPLICAS OK") == nprocs, launch.output
