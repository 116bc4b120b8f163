"""Internal: what one stage's step is given (:class:`Batch`) and what it gives back (:class:`StepResult`).

The executor (:mod:`keras_pipe.engine.executor`) walks the stage's actions
over a batch and the end of the step (:mod:`keras_pipe.engine.step_end`)
finishes it: both read these, so they live beside both, not in either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keras_pipe.stage.losses import divisor_shares
from keras_pipe.stage.microbatch import bounds_of, microbatch_bounds, replica_bounds


@dataclass(frozen=True)
class StepInputs:
    """What the model gives the engine for one step (:meth:`keras_pipe.engine.engine.Engine.run`).

    ``x``: the flat list of model inputs (read by the first stage); ``y`` and
    ``sample_weight``: the global batch's (the last stage's once
    :meth:`~keras_pipe.engine.engine.Engine.exchange_targets` has sent them
    there); ``loss``: the step's :class:`~keras_pipe.stage.losses.MicrobatchLoss`;
    ``optimizer``: the model's (``None`` outside training).
    """

    phase: str  # "train", "test" or "predict"
    x: Any
    batch_size: int
    y: Any = None
    sample_weight: Any = None
    loss: Any = None
    optimizer: Any = None
    # each replica's rows of the global batch, where each replica's first stage read its own (``x``: this
    # replica's rows alone); None: the replicas share the global batch as replica_bounds cuts it
    shares: tuple | None = None


@dataclass(frozen=True)
class StepDone:
    """What :meth:`keras_pipe.engine.engine.Engine.step` gives back of a training or test step.

    ``loss_part``: this stage's share of the batch loss; ``terms`` and
    ``predictions`` (the loss terms' values, the flat model outputs of the
    whole global batch, every replica's share gathered): the last stage's,
    ``None`` elsewhere; ``y`` and ``sample_weight``: the step's, as the last
    stage has them (the metrics' update reads them there).
    """

    loss_part: float
    terms: Any = None
    predictions: Any = None
    y: Any = None
    sample_weight: Any = None


@dataclass
class Batch:
    """What one stage needs to run one batch.

    ``bounds`` are the rows of each of this replica's micro-batches in the
    global batch of ``batch_size`` rows; ``x`` (the model inputs, a list) is
    read by the first stage, ``y`` and ``sample_weight`` by the last.
    ``shares[i, k]``: micro-batch ``i``'s share of loss term ``k``'s divisor
    (see :mod:`keras_pipe.stage.losses`), ``term_weights`` the terms' ``loss_weights``.
    """

    phase: str  # "train", "test" or "predict"
    batch_size: int
    bounds: list
    x: Any = None
    y: Any = None
    sample_weight: Any = None
    loss: Any = None  # a MicrobatchLoss (last stage)
    shares: Any = None
    term_weights: Any = None
    optimizer: Any = None
    regularize: bool = False  # count the weight regularizers (one replica does)
    # A term's divisor is known only once every forward counted it (a masked output under a
    # mean loss): the last stage sums each micro-batch's terms and divisors, and seeds its
    # backwards once the whole batch is counted.
    whole_batch_loss: bool = False
    x_first: int = 0  # the global batch's row where ``x`` starts (a replica that read only its share)


@dataclass
class StepResult:
    loss_part: float = 0.0  # this stage's share of the batch loss
    predictions: list = field(default_factory=list)  # last stage: per micro-batch, the flat model outputs
    terms: Any = None  # last stage: each loss term's value over this replica's share of the batch
    # last stage, whole_batch_loss: the summed terms and divisors of this replica's micro-batches
    # and, once counted, the whole global batch's divisors
    sums: Any = None
    divisors: Any = None
    batch_divisors: Any = None


def stage_batch(engine, inputs: StepInputs) -> Batch:
    """The batch as this rank's executor runs it (its micro-batches' rows; the loss's shares on the last rank).

    ``engine``: this rank's :class:`~keras_pipe.engine.engine.Engine`, measured on the first batch."""
    phase, x, batch_size, y = inputs.phase, inputs.x, inputs.batch_size, inputs.y
    sample_weight, loss, optimizer = inputs.sample_weight, inputs.loss, inputs.optimizer
    if loss is not None:
        loss.masked = engine.output_masked()  # (known once measured, on the first batch)
    first, last = replica_rows(batch_size, engine.num_replicas, inputs.shares)[engine.replica]
    bounds = (
        [(first + a, first + b) for a, b in microbatch_bounds(last - first, engine.num_microbatches)]
        if (last > first)
        else []
    )
    if bounds and phase == "train":
        engine.compute.estimate_holding(bounds[0][1] - bounds[0][0])
    whole = phase != "predict" and loss is not None and loss.whole_batch()
    shares = term_weights = None
    if loss is not None and engine.is_last:
        shares = divisor_shares(loss.reductions(), bounds, sample_weight, batch_size, [p for p, *_ in loss.terms])
        term_weights = np.asarray(loss.weights(), np.float64)
    return Batch(
        phase=phase,
        batch_size=batch_size,
        bounds=bounds,
        x=x,
        y=y,
        sample_weight=sample_weight,
        loss=loss if engine.is_last else None,
        shares=shares,
        term_weights=term_weights,
        optimizer=optimizer,
        regularize=engine.replica == 0 and phase != "predict",
        whole_batch_loss=whole,
        x_first=first if inputs.shares is not None else 0,
    )


def replica_rows(batch_size: int, num_replicas: int, shares=None) -> list[tuple[int, int]]:
    """Each replica's ``(start, stop)`` in the global batch: ``shares`` where the replicas read their own rows."""
    return replica_bounds(batch_size, num_replicas) if shares is None else bounds_of(list(shares))
