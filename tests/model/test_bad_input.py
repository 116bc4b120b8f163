"""Mistakes give a clear error on every rank, never a hang or silently wrong training."""

import re

from mpi import run_mpi

EXPECTED = {
    "layers differ": 'layers: ranks [0, 2, 3]: "1: Dense(units=16, activation=tanh) #',
    "batch size differs": "batch_size: ranks [0, 1, 2]: 32; ranks [3]: 16",
    "data size differs": 'x: ranks [0, 2, 3]: {"shape": [256, 12]}; ranks [1]: {"shape": [200, 12]}',
    "num_microbatches differs": "num_microbatches: ranks [0]: 2; ranks [1, 2, 3]: 4",
    "fewer batches on one rank": "rank 2: train, call 1, step 5, no more data",
    "balance does not cover the layers": "balance [1, 1, 1, 1] covers 4 layers but the model has 6",
    "num_microbatches < 1": "num_microbatches=0: it must be a positive integer",
    "num_stages does not divide the ranks": "num_stages=3 does not divide the 4 ranks of the job into whole "
    "pipelines; use a num_stages in [1, 2, 4]",
    "num_stages differs": "the ranks disagree on num_stages: ranks [0, 1, 2]: 4; ranks [3]: 1",
    "a layer used twice": "appears twice in the layer list",
    "not a chain": "layer 2 (concatenate, Concatenate) cannot be called on an input of shape (None, 16)",
    "loss without reduction": "reduction=None cannot be combined over micro-batches",
    "stall_timeout": "stall_timeout=0: give the seconds a rank may wait",
    "stall_timeout not a number": "stall_timeout='abc': give the seconds",
    "compute_loss override": "OwnLoss overrides compute_loss()",
    "keras.saving.save_model": "keras.saving.save_model(model, ...) writes one process's objects, and with 4 stages",
    "tf.train.Checkpoint": "tf.train.Checkpoint or tf.saved_model.save of the pipeline writes one process's objects",
    "validation_split of a dataset": "only supported for tensors or NumPy arrays; fit() was given a _BatchDataset",
    "save_to_preset of a chain": "save_to_preset() is a keras_hub task's or backbone's; this pipeline's model is a",
    "train_step of the model given": "OwnTrainStep overrides train_step(): a PipelineModel runs its own steps",
    "compute_loss of the model given": "OwnComputeLoss overrides compute_loss(): a PipelineModel runs its own steps",
    "predict_step of the model given": "OwnPredictStep overrides predict_step(): a PipelineModel runs its own steps",
    "a pipeline pipelined again": "is a PipelineModel already (of class PipelineModel): a pipeline cannot be",
    "run_eagerly": "same as graphs",
    "loss reductions": "same as Sequential",
}


def test_every_mistake_is_a_clear_error_on_every_rank():
    launch = run_mpi(4, "bad_input.py", timeout=600)
    assert launch.returncode == 0, launch.output
    problems = []
    for case, expected in EXPECTED.items():
        messages = re.findall(rf"CASE {re.escape(case)}: (.*?)(?=CASE |\n|$)", launch.output)
        matching = [m for m in messages if expected in m]
        if len(matching) != 4:
            problems.append(f"{case}: expected 4 ranks to say {expected!r}, got {messages}")
    assert not problems, "\n".join(problems) + "\n\n" + launch.output


def test_a_hanging_rank_ends_the_job_with_a_report():
    launch = run_mpi(4, "stall.py", "hang", timeout=180)
    assert launch.returncode != 0, launch.output
    assert launch.seconds_after("STALLING AT") < 15 + 25, launch.output  # stall_timeout=15
    assert "PipelineStallError" in launch.output, launch.output
    assert "rank 2: no answer within" in launch.output, launch.output
    report = re.search(r"What each rank was doing:\n((?:  rank \d: .*\n){4})", launch.output)
    assert report, launch.output
    assert "waiting" in report.group(1), report.group(1)
    assert "finished without noticing" not in launch.output


def test_a_hanging_replica_ends_the_job_with_a_report_naming_every_rank():
    launch = run_mpi(4, "stall.py", "hang-replicas", timeout=180)
    assert launch.returncode != 0, launch.output
    assert launch.seconds_after("STALLING AT") < 15 + 25, launch.output
    report = re.search(r"What each rank was doing:\n((?:  rank \d: .*\n){4})", launch.output)
    assert report, launch.output
    assert "rank 2: no answer within" in report.group(1), report.group(1)
    assert "of replica" in report.group(1), report.group(1)  # the others say where they are
    assert "gradient allreduce" in launch.output, launch.output  # stage 0 of replica 0 waits for rank 2 there
    assert "finished without noticing" not in launch.output


def test_a_killed_rank_ends_the_job_within_the_timeout():
    launch = run_mpi(4, "stall.py", "kill", timeout=180)
    assert launch.returncode != 0, launch.output
    # stall_timeout is 15 s; the launcher or the watchdog ends the others.
    assert launch.seconds_after("STALLING AT") < 15 + 25, launch.output
    assert "finished without noticing" not in launch.output
