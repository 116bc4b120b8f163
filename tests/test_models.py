"""Models this project did not write, pipelined, equal to the unsplit model (tests/mpi_scripts/hub.py, graphs.py).

keras_hub's layers and models built from constructor arguments (nothing is
downloaded), keras.applications, and hand-written Functional graphs, each
against the unsplit model on the same weights and data, under real mpirun.
"""

import pytest
from mpi import require_keras_hub, run_mpi

HUB = ["encoder", "decoder", "gpt2", "bert"]
GRAPHS = ["skip", "multi", "dynamic", "resnet", "child", "partial"]


# Two ranks: BERT's two-output Functional model (several inputs, the backbone nested, two outputs with a loss each;
# its one-output classifier over the same nested backbone is in the slow tier), with AdamW the forms of
# sparse gradients (issue 39) of T5 (encoder-decoder), Llama and GPT-2 under interleaved 1F1B and ZB-V (the
# embedding on the first and the last virtual stage: GPT-2's tied one under ZB-V). Four ranks: the encoder's and
# decoder's masks micro-batched and crossing three boundaries, Llama (rotary, untied embeddings). The slow tier
# (docs/suite_time.md): Mixtral (a mixture of experts; a layer's batch-statistic loss, warned of on every rank, is
# tests/test_features.py's batch-statistic-loss; benchmarks/hub_zoo.py trains every MoE family), GPT-2 under 1F1B
# on four ranks (its tied embedding crosses from the first to the last rank; GPT-2 on two ranks trains again in
# test_saving.py, resumed there, equal to an uninterrupted run), the chunked language models on four ranks, ViT
# (its fixed position ids: the lookup of fixed ids in tests/test_optimizers.py, with every optimizer), and the
# encoder and BERT with two chunks a rank (ZB-V, interleaved 1F1B; tests/engine/test_chunks.py runs chunked
# schedules on two ranks) with schedule="auto" cutting a Llama again for ZB-V (tests/test_fine_tuning.py's
# llama_lora_auto cuts a LoRA Llama again on two ranks).
@pytest.mark.parametrize(
    "nprocs, cases",
    [
        (2, ["bert_two_outputs", "t5", "shared_chunks"]),
        (4, ["encoder", "decoder", "llama"]),
        pytest.param(2, ["chunked", "vit", "bert"], marks=pytest.mark.slow),
        pytest.param(4, ["gpt2", "shared_chunks", "mixtral"], marks=pytest.mark.slow),
    ],
    ids=["2", "4", "2-slow", "4-slow"],
)
def test_keras_hub_models_equal_the_unsplit_model(nprocs, cases):
    require_keras_hub()
    launch = run_mpi(nprocs, "hub.py", *cases, timeout=900)
    launch.assert_cases("HUB OK {} ", cases, nprocs)


# 4 ranks (a skip edge over two stages); the two-stage cut of Functional graphs: the keras_hub models
@pytest.mark.parametrize("nprocs", [4])
def test_functional_graphs_equal_the_unsplit_model(nprocs):
    launch = run_mpi(nprocs, "graphs.py", *GRAPHS, timeout=900)
    launch.assert_cases("GRAPH OK {} ", GRAPHS, nprocs)
