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
    2: [
        "child",
        "lora",
        "qlora",
        "guide",
        "guide_subclassed",
        "guide_unallocated",
        "llama_lora",
        "llama_lora_auto",
        "unseeded_shared",
        "preset",
    ],
    # (unseeded_shared on 2 ranks only: its second holder is rank P - 1 on 4 too, by the same mapping; the suite has
    # no margin for a 4-rank Llama launch's worth more. child, lora and guide too: guide_unallocated runs the guide's
    # phases with a frozen base on middle stages, llama_lora LoRA at every depth)
    4: ["guide_unallocated", "llama_lora", "preset"],
}


@pytest.mark.parametrize("nprocs", sorted(CASES))
def test_fine_tuning_equals_keras(nprocs):
    require_keras_hub()
    cases = CASES[nprocs]
    launch = run_mpi(nprocs, "fine_tuning.py", *cases, timeout=1200)
    assert launch.returncode == 0, launch.output
    for case in cases:
        # (each rank prints its line; two ranks' lines may run together, and "lora" is inside "qlora")
        assert launch.output.count(f"FINE-TUNING OK {case} rank ") == nprocs, (case, launch.output)
