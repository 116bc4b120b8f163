"""The ``compile()`` options, and the models' step overrides, a pipeline cannot honour, refused on every rank with
the reason.

Each check runs identically on every rank (they all compile the same
model), so the errors are raised everywhere before any communication.
"""

from __future__ import annotations

import inspect

import keras

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError


def checked_arguments(model, args, kwargs) -> tuple[dict, object]:
    """``model.compile(*args, **kwargs)``'s arguments, bound as ``keras.Model.compile`` takes them and checked
    (a ``tf.distribute`` scope, the arguments); returns them without ``jit_compile``, and ``jit_compile``."""
    arguments = inspect.signature(keras.Model.compile).bind(model, *args, **kwargs).arguments
    arguments.update(arguments.pop("kwargs", {}))
    jit = arguments.pop("jit_compile", "auto")
    check_no_strategy(model)
    check_arguments(dict(arguments, jit_compile=jit))
    arguments.pop("self")
    return arguments, jit


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


# keras.Model's methods that decide what a step computes: the pipeline runs steps of its own, so a model handed to
# from_model that overrides one would train (or evaluate, or predict) otherwise than in Keras, silently.
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def check_source_steps(model) -> None:
    """Refuses, alike on every rank, a model to pipeline whose class overrides one of :data:`STEP_METHODS`."""
    if getattr(model, "_keras_pipe_pipeline", False):  # (PipelineModel's marker, as the engine finds nested ones)
        raise refuse(
            f"{model.name!r} is a PipelineModel already (of class {type(model).__name__}): a pipeline cannot be "
            "pipelined again. Pipeline its Keras model (model.to_keras() on rank 0 gives it whole), or use it as it is."
        )
    overridden = [name for name in STEP_METHODS if getattr(type(model), name) is not getattr(keras.Model, name)]
    if not overridden:
        return
    names = ", ".join(f"{name}()" for name in overridden)
    raise refuse(
        f"{type(model).__name__} overrides {names}: a PipelineModel runs its own steps (each micro-batch's forward "
        "and backward across the ranks, the loss and metrics compile() gives on the last stage), so the override "
        "would be ignored and training would differ from Keras' without a word. Give the loss and metrics to "
        "compile() (a keras.losses.Loss or keras.metrics.Metric subclass can hold custom logic), and pipeline a "
        "model without the override: for a Functional one, keras.Model(model.inputs, model.outputs) keeps its "
        "layers and weights."
    )


def check_no_preprocessor(model) -> None:
    """Refuses, alike on every rank, a keras_hub task holding a preprocessor.

    keras_hub's tasks apply ``task.preprocessor`` in their own ``fit``,
    ``evaluate`` and ``predict`` (resizing and rescaling images, tokenizing
    text, making a causal LM's labels from its inputs); a pipeline's own would
    feed the data to the network as given, training on other inputs than the
    task would, silently where the shapes still fit.
    """
    if getattr(model, "preprocessor", None) is None or not hasattr(model, "preprocess_samples"):
        return
    raise refuse(
        f"{type(model).__name__} holds a preprocessor ({type(model.preprocessor).__name__}), which keras_hub applies "
        "in the task's own fit(), evaluate() and predict(); a PipelineModel feeds the network the data as given, so "
        "it would train on other inputs. Make the task with preprocessor=None (from_preset(..., "
        "preprocessor=None)) and preprocess the data with the preprocessor first, e.g. "
        "tf.data.Dataset.from_tensor_slices(x).batch(8).map(preprocessor)."
    )


def check_no_strategy(model) -> None:
    """Refuses a ``tf.distribute`` strategy (the model made, compiled or called in its scope), on every rank.

    A ``PipelineModel`` is already distributed, over MPI ranks: one stage a
    rank, and data parallelism as replicas of the pipeline
    (``num_stages``); each rank's programs run on its own device. A strategy
    would replicate each stage over its devices inside Keras' step, which
    the pipeline's step (micro-batches sent between ranks) does not run in.
    """
    import tensorflow as tf

    if compat.distribute_strategy(model) is None and not tf.distribute.has_strategy():
        return
    strategy = compat.distribute_strategy(model) or tf.distribute.get_strategy()
    raise refuse(
        f"a PipelineModel under tf.distribute ({type(strategy).__name__}): the pipeline distributes the model over "
        "MPI ranks itself (one stage a rank; replicas of the pipeline with num_stages=... for data parallelism), "
        "and its steps cannot run inside a strategy's replicas. Make, compile and train the model outside "
        "strategy.scope(), one rank per device."
    )


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
