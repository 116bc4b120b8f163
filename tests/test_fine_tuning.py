"""Fine-tuning pretrained models, as users write it, equals the unsplit model (issue 46).

``mpi_scripts/fine_tuning.py`` on 2 and 4 ranks (two cases on 1 too): a frozen composite layer with a trainable
child, LoRA at every depth (and on int8-quantized layers), Keras' transfer-learning guide in both its forms,
keras_hub's ``backbone.enable_lora`` (also under ``schedule="auto"`` cutting the model again for ZB-V), a tied
embedding on two ranks of an unseeded script created unallocated, and a keras_hub preset opened inside
``keras_pipe.unallocated()``, each rank reading its own stage's weights. Each case trains the unsplit model on rank
0 and the pipeline from the same weights.
"""

import pytest
from mpi import require_keras_hub, run_mpi

CASES = {
    # (one rank: the nested training=False over micro-batches and a preset opened unallocated, in one process; the
    # other cases run the same stage code on 2 and 4 ranks, and were cut from one rank for the suite's time)
    1: ["guide_subclassed", "preset"],
    2: ["child", "lora", "qlora", "guide", "llama_lora_auto", "unseeded_shared"],
    # (unseeded_shared on 2 ranks only: its second holder is rank P - 1 on 4 too, by the same mapping. child, lora
    # and guide too: guide_unallocated runs the guide's phases with a frozen base on middle stages)
    4: ["guide_unallocated", "preset"],
}
# The slow tier (docs/suite_time.md): the cases above on two ranks as well, and LoRA at every depth of a keras_hub
# Llama on four (llama_lora_auto trains keras_hub's LoRA on a Llama on two ranks in the default suite)
SLOW = {2: ["guide_subclassed", "guide_unallocated", "llama_lora", "preset"], 4: ["llama_lora"]}


@pytest.mark.parametrize(
    "nprocs, cases",
    [(n, cases) for n, cases in sorted(CASES.items())]
    + [pytest.param(n, cases, marks=pytest.mark.slow) for n, cases in sorted(SLOW.items())],
    ids=[str(n) for n in sorted(CASES)] + [f"{n}-slow" for n in sorted(SLOW)],
)
def test_fine_tuning_equals_keras(nprocs, cases):
    require_keras_hub()
    launch = run_mpi(nprocs, "fine_tuning.py", *cases, timeout=1200)
    # (each rank prints its line; two ranks' lines may run together, and "lora" is inside "qlora")
    launch.assert_cases("FINE-TUNING OK {} rank ", cases, nprocs)
