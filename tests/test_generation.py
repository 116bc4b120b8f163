"""``generate()`` on pipelined keras_hub language models equals the unsplit model's (tests/mpi_scripts/generation.py).

The placement of the model's pieces on the ranks is pure data, checked here in
one process; the tokens under real ``mpirun``, against the unsplit model's
``generate()`` on the same weights.
"""

import pytest
from mpi import require_keras_hub, run_mpi

from keras_pipe.errors import PipelineConfigError
from keras_pipe.model.generation import Piece, place


def pieces(*holders):
    return [Piece(f"piece {i}", "layer", i, None if h is None else frozenset(h)) for i, h in enumerate(holders)]


def test_each_piece_runs_on_the_first_rank_holding_it_at_or_after_the_previous():
    # GPT-2 on 2 ranks: the tied embedding held by both, looked up on rank 0 and projected with on rank 1
    assert place(pieces({0, 1}, {0}, {1}, {1}, {0, 1})) == [0, 0, 1, 1, 1]
    # a piece without weights stays where the previous ran; a rank holding nothing is passed over
    assert place(pieces({0}, None, {2}, {3})) == [0, 0, 2, 3]


def test_a_piece_held_only_before_the_previous_piece_is_refused_naming_it():
    # ZB-V on 2 ranks: the last virtual stage (the head) is rank 0's again
    with pytest.raises(PipelineConfigError, match="piece 3 is held by \\[0\\], before rank 1"):
        place(pieces({0, 1}, {0}, {1}, {0}))


# One launch on two ranks. In the slow tier: Mistral, Qwen and keras_hub's other families on two ranks (they call
# their pieces as Llama does, or as one of the default launch's; it runs GPT-2, Llama, Gemma, Phi-3, OPT and Bloom,
# each way a family's pieces are called), and one launch
# on four (seeded sampling, 3 groups on 4 stages: the two-rank launch samples seeded too, one group and two; two
# replicas of two stages: the two-rank launch runs two of one stage; BART's embeddings and encoder over more ranks
# than the decoder; T5's position bias travelling inside both stacks, where two ranks cut inside its decoder only).
@pytest.mark.parametrize(
    "nprocs, cases",
    [
        (2, ["each_call", "refused", "sampling", "lora", "callback", "dataset", "int8", "replicas", "seq2seq"]),
        pytest.param(2, ["like_llama", "more_families", "seq2seq_more"], marks=pytest.mark.slow),
        pytest.param(4, ["sampling", "replicas", "seq2seq", "seq2seq_more"], marks=pytest.mark.slow),
    ],
    ids=lambda value: str(value) if isinstance(value, int) else "-".join(value),
)
def test_generate_equals_the_unsplit_model(nprocs, cases):
    require_keras_hub()
    launch = run_mpi(nprocs, "generation.py", *cases, timeout=600)
    launch.assert_cases("GENERATE OK {} ", cases, nprocs)
