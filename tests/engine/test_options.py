"""The pipeline's options: defaults written once, resolved and checked once against the world (no MPI, no model)."""

import dataclasses
import inspect
import re

import pytest

from keras_pipe import PipelineModel
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.errors import PipelineConfigError


def test_the_models_arguments_default_to_the_options_defaults():
    parameters = inspect.signature(PipelineModel.__init__).parameters
    assert {name: parameters[name].default for name in PipelineOptions.defaults()} == PipelineOptions.defaults()


def test_given_is_what_differs_from_the_defaults():
    assert PipelineOptions().given() == {}
    assert PipelineOptions(num_microbatches=4, balance=[1, 2], schedule="1f1b").given() == {
        "num_microbatches": 4,
        "balance": [1, 2],
    }


def test_resolve_fills_the_worlds_defaults():
    assert PipelineOptions().resolve(1).num_microbatches == 1
    resolved = PipelineOptions().resolve(3)
    assert (resolved.num_microbatches, resolved.num_chunks, resolved.num_stages) == (6, 1, 3)
    assert PipelineOptions(schedule="zb-v").resolve(2).num_chunks == 2
    assert PipelineOptions(num_microbatches=5).resolve(2).num_microbatches == 5
    # "auto" stays "auto" (the engine's picker times P, 2P and 4P), under interleaved 1F1B's whole rounds too
    assert PipelineOptions(num_microbatches="auto", schedule="interleaved-1f1b").resolve(4).num_microbatches == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.num_microbatches = 2


@pytest.mark.parametrize(
    "options, num_stages, message",
    [
        (dict(num_microbatches=0), 2, "num_microbatches=0: it must be a positive integer"),
        (
            dict(num_microbatches="many"),
            2,
            "num_microbatches='many': it must be a positive integer (1 means no micro-batching; or \"auto\")",
        ),
        (dict(schedule="nope"), 2, "schedule='nope' is not known"),
        (dict(schedule="zb-v", num_chunks=3), 2, "runs two chunks a rank"),
        (dict(schedule="1f1b", num_chunks=2), 2, "runs one chunk a rank"),
        (dict(recompute="sometimes"), 2, "recompute='sometimes': give one of"),
        (dict(balance=[1, 1], split_before=["dense"]), 2, "give balance or split_before, not both"),
        (
            dict(schedule="interleaved-1f1b", num_microbatches=5),
            4,
            "schedule='interleaved-1f1b' runs micro-batches in rounds of the 4 ranks, but num_microbatches=5 is "
            "not a multiple of 4: use num_microbatches=8.",
        ),
    ],
)
def test_every_rule_is_checked_by_resolve(options, num_stages, message):
    with pytest.raises(PipelineConfigError, match=re.escape(message)):
        PipelineOptions(**options).resolve(num_stages)
