"""The most important test: pipelined training gives what keras.Sequential gives.

For P = 4 ranks (1 and 3 in the slow tier), micro-batch counts 1, 2 and 4 and every schedule, with a
final partial batch, sample weights, weight and activity regularizers and a
validation split: loss and metric history, final weights, evaluate() and
predict() equal single-process Sequential to float32 round-off. The
configurations of ``mpi_scripts/equivalence.py`` train on four ranks, seven of the twelve (those with
several chunks a rank too, interleaved 1F1B over 8 virtual stages and ZB-V, which
``test_chunks.py`` trains on two ranks as well; the five others, one micro-batch, the plain
chain under GPipe and the split one under 1F1B, train on one and three ranks in the slow tier),
with the checks that depend only on which rank is the first stage (data in another order on the
other ranks, the labels' zero-size stand-ins, the update cut by layers); in the slow tier three
ranks train a subset again on stages of unequal size, and one rank four of them as a single stage.
"""

import pytest
from mpi import run_mpi


# 4 ranks: seven configurations and the checks that depend on which rank is the first stage (--extras). The slow tier:
# 1 rank (micro-batching alone) and 3 (stages of unequal size, a middle stage: tests/test_property.py and
# tests/model/test_dropin.py train on three ranks in the suite). Two stages are covered by the many 2-rank launches
# elsewhere (replicas, callbacks, drop-in, features).
@pytest.mark.parametrize("nprocs", [pytest.param(n, marks=pytest.mark.slow) for n in (1, 3)] + [4])
def test_pipeline_equals_sequential(nprocs):
    launch = run_mpi(nprocs, "equivalence.py", *(["--extras"] if nprocs == 4 else []), timeout=900)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("EQUIVALENCE OK") == nprocs, launch.output
