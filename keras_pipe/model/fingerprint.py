"""Internal: what every rank's model must agree on, as a fingerprint the ranks compare.

When ``fit``, ``evaluate`` or ``predict`` starts, each rank shares
:func:`model_fingerprint` of its model (:mod:`keras_pipe.model.calls`), and
:func:`keras_pipe.mpi.agreement.check_same_everywhere` raises on every rank,
naming the ranks and the field, where they differ.
"""

from __future__ import annotations

import hashlib
import json

from keras_pipe import compat


def _digest(value) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def model_fingerprint(model) -> dict:
    """What every rank must agree on, as JSON-friendly values (configs as short digests)."""
    layers = [_layer_summary(i, layer) for i, layer in enumerate(model.layers)]
    options = model.engine.options  # (as resolved against the world)
    fingerprint = {
        "layers": layers,
        "stages x replicas": [model.num_stages, model.num_replicas],
        "balance": list(model.balance or []),
        "num_microbatches": options.num_microbatches,
        "schedule": options.schedule,
        "chunks a rank": options.num_chunks,
        "input": list(map(str, model._builder.input_spec or [])),
        "dtype_policy": str(getattr(model.dtype_policy, "name", model.dtype_policy)),
    }
    if model.compiled:
        fingerprint["loss"] = _digest(_serialized(model.loss))
        # Without their names: a metric object created once more on one rank
        # is auto-named "precision_1" there, which changes nothing (the logs
        # take the last stage's names).
        metrics = _without_names(_serialized(compat.compile_config_metrics(model)))
        fingerprint["metrics"] = f"{_metric_classes(metrics)} #{_digest(metrics)[:6]}"
        fingerprint["optimizer"] = type(model.optimizer).__name__ if model.optimizer is not None else None
    return fingerprint


_SHOWN_CONFIG = ("units", "filters", "kernel_size", "activation", "rate", "target_shape", "axis")


def _layer_summary(index, layer) -> str:
    """``'2: Dense(units=24, activation=tanh) #b46ddd'``: readable, and exact through the digest."""
    config = _layer_config(layer) or {}
    shown = ", ".join(f"{k}={config[k]}" for k in _SHOWN_CONFIG if k in config)
    return f"{index}: {type(layer).__name__}({shown}) #{_digest(config)[:6]}"


def _layer_config(layer):
    try:
        config = layer.get_config()
    except Exception:  # noqa: BLE001 - a layer without a config is compared by type only
        return None
    config.pop("name", None)  # auto-generated names may differ between ranks
    return config


def _without_names(value):
    """A serialized Keras config with every ``"name"`` entry left out."""
    if isinstance(value, dict):
        return {k: _without_names(v) for k, v in value.items() if k != "name"}
    if isinstance(value, list):
        return [_without_names(v) for v in value]
    return value


def _metric_classes(value) -> str:
    """``'accuracy, Precision, AUC'``: what a metrics config holds, readably."""
    if isinstance(value, dict) and "class_name" in value:
        return str(value["class_name"])
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_metric_classes(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_metric_classes(v)}" for k, v in value.items()) + "}"
    return str(value)


def _serialized(value):
    try:
        import keras

        return keras.saving.serialize_keras_object(value)
    except Exception:  # noqa: BLE001
        return repr(value)
