"""Only a pipeline's first stage reads a dataset, a PyDataset or a generator; the other stages never call it.

``tests/mpi_scripts/feeding.py`` counts, on every rank, the samples its data sources produce through whole
``fit`` (two epochs, with validation), ``evaluate`` and ``predict`` calls, and compares the losses, metrics,
weights and predictions with the unsplit model's: a tf.data pipeline, a PyDataset with sample weights, a generator of
unknown length, an infinite dataset with class weights, a fit from ``initial_epoch=1``, and dicts of inputs and of
outputs (a loss and a metric by output name) through tf.data.

Then each replica reads its own share (``model.distribute_strategy.distribute_datasets_from_function``, tf.distribute's
convention): a tf.data pipeline batched by the per-replica size and sharded, a PyDataset of every other batch with
class weights, a generator of unknown length; 150 samples, so that the last step's shares are uneven and a validation
step has an empty share. Across the replicas the samples produced are what one process reads, and training equals
the unsplit model on the joined global batches.
"""

import json
import re

import pytest
from mpi import run_mpi

# What Keras' loop reads in one process for each case (``mpirun -n 1 feeding.py`` prints it): a PyDataset's
# adapter reads some batches twice (Keras peeks at the first to learn their structure).
ONE_PROCESS = {
    "tf.data": 512,
    "PyDataset": 720,
    "generator": 512,
    "infinite with class weights": 416,
    "initial epoch": 304,  # (one epoch of two: 160 + 48 validation, then 48 evaluated and 48 predicted)
    "dicts": 512,
}

# Each replica reading its own share: samples produced by each replica's first stage (one replica: the one-process
# count; two: the same total, split 80 + 70 rows an epoch, 32 + 16 of validation). A PyDataset's adapter reads its
# first batch twice an epoch, each replica its own.
PER_REPLICA = {
    "per-replica tf.data": {1: [492], 2: [288, 204]},
    "per-replica PyDataset": {1: [556], 2: [320, 236]},
    "per-replica generator": {1: [492], 2: [288, 204]},
}


@pytest.mark.parametrize("ranks, stages", [(2, 2), (4, 2)], ids=["2 stages", "2 stages x 2 replicas"])
def test_only_first_stages_read_and_training_matches(ranks, stages):
    launch = run_mpi(ranks, "feeding.py", "--stages", str(stages), timeout=400)
    assert launch.returncode == 0, launch.output
    readers = set(range(0, ranks, stages))
    for case, needed in ONE_PROCESS.items():
        counts = re.findall(rf"FEED {re.escape(case)} counts (\[[0-9, ]*\])", launch.output)
        assert counts, launch.output
        counts = json.loads(counts[0])
        assert counts == [needed if rank in readers else 0 for rank in range(ranks)], (case, counts)
        assert launch.output.count(f"FEED {case} OK") == ranks, launch.output
    replicas = ranks // stages
    for case, by_replicas in PER_REPLICA.items():
        counts = re.findall(rf"FEED {re.escape(case)} counts (\[[0-9, ]*\])", launch.output)
        assert counts, launch.output
        own = iter(by_replicas[replicas])
        assert json.loads(counts[0]) == [next(own) if rank in readers else 0 for rank in range(ranks)], (case, counts)
        assert launch.output.count(f"FEED {case} OK") == ranks, launch.output
    failed = re.findall(r"FEED per-replica function error (.*?)(?=FEED |\n|$)", launch.output)
    assert (
        failed
        == [
            f"PipelineDataError: rank {ranks - stages}, which reads the data, could not make its replica's data: "
            "ValueError: no shard files for this replica"
        ]
        * ranks
    ), failed
    # (two ranks' lines may run into one another: a message ends at the next FEED)
    broken = re.findall(r"FEED broken map error (.*?)(?=FEED |\n|$)", launch.output)
    assert len(broken) == ranks and all(
        line.startswith("PipelineDataError: rank 0, which reads the data, could not read its batch")
        and "cannot decode sample 64" in line
        for line in broken
    ), broken
    wrong = re.findall(r"FEED wrong shape error (.*?)(?=FEED |\n|$)", launch.output)
    assert len(wrong) == ranks and len(set(wrong)) == 1 and wrong[0].startswith("ValueError: Input 0"), wrong
