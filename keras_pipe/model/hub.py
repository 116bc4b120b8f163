"""keras_hub's task and backbone methods on a pipeline: presets, LoRA weights.

A pipeline made of a keras_hub task (``PipelineModel.from_model(causal_lm)``)
answers what a fine-tuning script asks of the task after training:
``save_to_preset`` (rank 0 writes the preset as each stage sends its layers) and
``save_lora_weights``/``load_lora_weights`` (keras_hub's own ``.lora.h5``
file, gathered from every stage or read by each rank for its own); its
``generate`` is pipelined in :mod:`keras_pipe.model.generation`. Each
function takes the :class:`~keras_pipe.model.model.PipelineModel` and is
collective where it says so.
"""

from __future__ import annotations

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.model import streaming
from keras_pipe.model import weights as _weights
from keras_pipe.model.transfer import on_root


def save_to_preset(model, preset_dir, max_shard_size=10) -> None:
    """keras_hub's own ``save_to_preset`` of the task, run by rank 0 on its layers while each stage sends its layers'
    values as the walk reaches them (collective): rank 0 holds its stage and one layer's values, not the whole model.

    The preset is what keras_hub writes for the unsplit model (its config,
    the tokenizer's assets, the trained weights, LoRA kernels merged as
    keras_hub merges them); plain ``from_preset`` opens it, and inside
    :func:`keras_pipe.unallocated` on any number of ranks, each reading its
    own stage's weights.
    """
    whole = model._saver.walked()
    if not hasattr(whole, "save_to_preset"):  # (every rank alike: its layers are every rank's)
        raise PipelineConfigError(
            f"save_to_preset() is a keras_hub task's or backbone's; this pipeline's model is a "
            f"{type(whole).__name__}: use save()"
        )
    streaming.save_through(
        model._saver,
        lambda whole: whole.save_to_preset(preset_dir, max_shard_size=max_shard_size),
        f"write the preset {preset_dir}",
    )


def lora_backbone(model):
    """The keras_hub backbone among the pipeline's layers on which ``enable_lora`` was called (every rank alike)."""
    source = model._builder.source
    layers = [source, *compat.sublayers(source)] if source is not None else []
    found = [layer for layer in layers if compat.lora_enabled_layers(layer)]
    if not found:
        raise PipelineConfigError(
            "save_lora_weights()/load_lora_weights() need a keras_hub backbone with LoRA enabled: call "
            "backbone.enable_lora(rank) before PipelineModel.from_model."
        )
    return found[0]


def save_lora_weights(model, filepath) -> None:
    """The LoRA kernels of every stage, gathered; rank 0 writes keras_hub's ``.lora.h5`` file (collective).

    Plain ``backbone.load_lora_weights`` reads the file, as one that
    keras_hub's ``save_lora_weights`` wrote.
    """
    backbone = lora_backbone(model)
    if not str(filepath).endswith(".lora.h5"):
        raise PipelineConfigError(f"The filename must end in `.lora.h5`. Received: filepath={filepath}")
    layers = [layer for layer in compat.sublayers(backbone)[1:] if layer.weights]  # (keras_hub's numbering)
    enabled = [(index, layers[index]) for index in compat.lora_enabled_layers(backbone)]
    variables = [v for _, layer in enabled for v in (layer.lora_kernel_a, layer.lora_kernel_b)]
    values = _weights.gather_variables(model.engine, variables)
    kernels = [(index, values[2 * k], values[2 * k + 1]) for k, (index, _) in enumerate(enabled)]
    rank = compat.lora_rank(backbone)
    on_root(
        model.engine.world,
        lambda: compat.write_lora_file(str(filepath), rank, kernels),
        f"save LoRA weights to {filepath}",
    )


def load_lora_weights(model, filepath) -> None:
    """keras_hub's ``backbone.load_lora_weights`` on every rank, each reading its own stage's kernels (collective).

    LoRA must be enabled, with the file's rank, before the pipeline was made
    (the stages hold the weights the layers had then).
    """
    backbone = lora_backbone(model)
    _weights.read_held(model.engine, lambda: backbone.load_lora_weights(filepath), f"load_lora_weights({filepath})")
