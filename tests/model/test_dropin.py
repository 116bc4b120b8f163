"""Drop-in: the cases where PipelineModel once differed from Sequential now behave as it does.

An unseeded script (rank 0's model is the model), Embedding with Adam (a
sparse gradient), int64 token ids for an int32 input, evaluate()'s list with
weighted metrics and (n, 1) binary labels, an uncompiled plain-Keras file, a
Lambda and a custom layer without get_config(), count_params(), fit() without y, and
PipelineModel(inputs, outputs) taken positionally with its output_names (a loss and metrics by output name).
"""

import pytest
from mpi import run_mpi


# 3 ranks: a first, a middle and a last stage (2-rank launches elsewhere cover the two-stage case)
@pytest.mark.parametrize("nprocs", [3])
def test_drop_in_cases_behave_as_sequential(nprocs):
    launch = run_mpi(nprocs, "dropin.py", timeout=300)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("DROPIN done") == nprocs, launch.output
