"""Every optimizer Keras ships, on sparse gradients, equal to the unsplit model (mpi_scripts/sparse_optimizers.py).

An ``Embedding`` on a stage of its own and on a stage with other layers, one
looked up on two stages, a lookup of fixed ids (ViT's positions), a
``ReversibleEmbedding`` whose lookup and head sit on the first and last
stage, a weight nothing reads: each gets the form of gradient Keras' own step
gives it, so that optimizers that are not linear in the gradient (Adam
squares each slice) step as the unsplit model's do (issue 39).
"""

import pytest
from mpi import run_mpi

OPTIMIZERS = (
    "sgd sgd_nesterov adam adam_amsgrad adamw adamax nadam rmsprop adagrad adadelta adafactor lion ftrl lamb muon "
    "adam_global_clipnorm adam_clipnorm adam_clipvalue adamw_ema adam_accumulation loss_scale_adam"
).split()
# two replicas of two stages: the sparse gradients summed over replicas as over micro-batches
REPLICATED = ["adam", "adamw", "adam_global_clipnorm", "loss_scale_adam"]
# Four stages (the slow tier): the same forms of gradient cut at more places. Every optimizer meets every form on two
# stages, and Adam, AdamW and loss scaling on two replicas of two;
# on four, the ones whose update reads the form itself (squares or signs of slices, accumulators, factored
# moments, decay of an unread weight, accumulated steps) and SGD as the linear baseline. (All 21 on four
# ranks cost the suite about 100 s more of a 4-rank launch.)
FOUR_STAGES = ["sgd", "adam", "adamw", "adagrad", "ftrl", "lion", "adafactor", "adam_accumulation"]


# Two stages and two replicas of two also save the optimizer's state in a sharded checkpoint, which plain Keras and
# the pipeline read and train on from (issue 59: the unsplit optimizer's order, read from its own build). On two
# stages, the optimizers whose slots are not one a weight, or not in the weights' order: the positions of all 15
# optimizers' slots are checked in one process, without MPI, by tests/model/test_sharded.py.
# (Adam one slot a weight, Adafactor factored ones: the others, Muon's slots for some weights only among them, in
# the slow tier)
SHARDED_ON_TWO = "--sharded=" + ",".join(["adam", "adafactor"])
SHARDED_SLOW = ["muon", "ftrl", "adamw_ema", "adam_accumulation"]


@pytest.mark.parametrize(
    "nprocs, args, cases",
    [
        (2, [SHARDED_ON_TWO], OPTIMIZERS),
        pytest.param(4, [], FOUR_STAGES, marks=pytest.mark.slow),
        (4, ["--stages", "2", "--sharded"], REPLICATED),
        pytest.param(2, ["--sharded=" + ",".join(SHARDED_SLOW)], SHARDED_SLOW, marks=pytest.mark.slow),
    ],
    ids=["2", "4", "2x2", "2-slow"],
)
def test_every_optimizer_steps_as_the_unsplit_model_on_sparse_gradients(nprocs, args, cases):
    launch = run_mpi(nprocs, "sparse_optimizers.py", *args, *cases, timeout=900)
    launch.assert_cases("SPARSE OK {} ", cases, nprocs)
