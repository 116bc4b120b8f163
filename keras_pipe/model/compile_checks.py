"""The ``compile()`` options a pipeline cannot honour, refused on every rank with the reason.

Each check runs identically on every rank (they all compile the same
model), so the errors are raised everywhere before any communication.
"""

from __future__ import annotations

import keras

from keras_pipe.errors import PipelineConfigError


def check_arguments(arguments: dict) -> None:
    """Checks ``compile()``'s arguments before Keras sees them."""
    jit = arguments.get("jit_compile", "auto")
    if jit not in (True, False, "auto"):
        raise refuse(f"compile(jit_compile={jit!r}): give True, False or 'auto' (XLA where the layers allow it).")


def check_model(model) -> None:
    """Refuses what the pipeline would get wrong: each reason says why and what to use instead."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        raise refuse(
            f"{type(model).__name__} overrides compute_loss(): the pipeline computes the loss per micro-batch "
            "on the last stage from the compiled loss, so an override would be ignored. Pass the loss to "
            "compile() instead (a keras.losses.Loss subclass can hold custom logic)."
        )
    if model.loss is not None:
        check_loss(model.loss)  # raises for what cannot be split into micro-batches


def refuse(message: str) -> PipelineConfigError:
    return PipelineConfigError(message)


MICROBATCH_REDUCTIONS = ("sum_over_batch_size", "mean", "sum", "mean_with_sample_weight")


def check_loss(loss) -> None:
    """Refuses a compiled loss (one, or a list or dict of them, one per output) that micro-batches cannot split."""
    for item in keras.tree.flatten(loss):
        if item is None:
            continue
        try:
            resolved = keras.losses.get(item) if isinstance(item, (str, dict)) else item
        except (ValueError, TypeError):
            continue  # Keras' own compile() says what is wrong with it
        reduction = getattr(resolved, "reduction", "sum_over_batch_size")
        if reduction not in MICROBATCH_REDUCTIONS:
            raise refuse(
                f"a loss with reduction={reduction!r} cannot be combined over micro-batches; use one of "
                f"{', '.join(map(repr, MICROBATCH_REDUCTIONS))}."
            )
