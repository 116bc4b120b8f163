"""The Functional side of Keras' model contract (issue 41), on one rank and on two (functional_contract.py).

Built once constructed, quantize(), None for inputs, from_config of a
Functional config, trainable=False at construction, the inputs' structure
checked on every rank in eager calls and nesting in TimeDistributed, pickle
(the whole model on every rank), the model handed to from_model saying
that the pipeline holds its layers, and keras.models.clone_model: each
against keras.Model or the same error on every rank.
"""

import pytest
from mpi import run_mpi

CASES = ["built", "quantize", "none inputs", "from_config", "frozen", "calls", "pickle", "handed in", "clone_model"]


@pytest.mark.parametrize("nprocs", [pytest.param(1, marks=pytest.mark.slow), 2])  # (one stage: the slow tier)
def test_a_pipeline_keeps_the_functional_contract(nprocs):
    launch = run_mpi(nprocs, "functional_contract.py", timeout=300)
    launch.assert_cases("CONTRACT {} ok ", CASES, nprocs)
    assert launch.output.count("CONTRACT done") == nprocs, launch.output[-4000:]
