"""The most important test: pipelined training gives what keras.Sequential gives.

For P = 1, 3 and 4 ranks, micro-batch counts 1, 2 and 4 and both schedules, with a
final partial batch, sample weights, weight and activity regularizers and a
validation split: loss and metric history, final weights, evaluate() and
predict() equal single-process Sequential to float32 round-off. The
configurations of ``mpi_scripts/equivalence.py`` are split between three and four
ranks, so that each trains on several stages at least once (four ranks: those with
several chunks a rank too, interleaved 1F1B over 8 virtual stages and ZB-V, which
``test_chunks.py`` trains on two ranks as well); one rank trains four of them
again, as a single stage. Three ranks also run the
checks that depend only on which rank is the first stage (data in another order on
the other ranks, the labels' zero-size stand-ins, the update cut by layers).
"""

import pytest
from mpi import run_mpi


# 1 rank (micro-batching alone), 3 (stages of unequal size, a middle stage) and 4; two stages
# are covered by the many 2-rank launches elsewhere (replicas, callbacks, drop-in, features).
@pytest.mark.parametrize("nprocs", [pytest.param(1, marks=pytest.mark.slow), 3, 4])  # (one stage: the slow tier)
def test_pipeline_equals_sequential(nprocs):
    launch = run_mpi(nprocs, "equivalence.py", timeout=900)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("EQUIVALENCE OK") == nprocs, launch.output
