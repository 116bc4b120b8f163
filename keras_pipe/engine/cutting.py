"""Internal: where the model is cut, as the options say, and what is checked of the graph before it is.

The engine calls these at build (:meth:`keras_pipe.engine.engine.Engine.build`)
with the same graph on every rank, so every rank decides alike and raises
alike: the nodes of each (virtual) stage (:func:`stage_sizes`), ZB-V's cut
of ``2P`` virtual stages for ``schedule="auto"`` (:func:`v_sizes`,
:func:`v_cut_problem`), and the graph's own problems (:func:`check_graph`).
"""

from __future__ import annotations

import warnings

from keras_pipe import compat
from keras_pipe.engine.options import PipelineOptions
from keras_pipe.engine.profile import balance_by_time
from keras_pipe.errors import PipelineConfigError
from keras_pipe.graph import cut as cuts


def check_graph(model_graph, num_stages: int, warn: bool) -> None:
    """Raises where the graph cannot be pipelined on ``num_stages`` ranks (no layers; a ``PipelineModel`` inside
    it); warns (where ``warn``: rank 0) where it has fewer layers than stages."""
    plain = model_graph.plain
    if not plain.nodes:
        raise PipelineConfigError("the PipelineModel has no layers; pass a list of layers.")
    nested = sorted(
        {
            sub.name
            for call in model_graph.calls
            if call.layer is not None
            for sub in compat.sublayers(call.layer)
            if getattr(sub, "_keras_pipe_pipeline", False)
        }
    )
    if nested and num_stages > 1:  # (the same graph on every rank: raised on every rank)
        raise PipelineConfigError(
            f"the PipelineModels {nested} are layers of this one: a pipeline over every rank cannot run inside "
            "one stage of another. Nest their keras.Model (pipeline.to_keras(), or the graph they were made of) "
            "and pipeline the whole."
        )
    if len(plain.nodes) < num_stages and warn:
        warnings.warn(
            f"{num_stages} stages but the model has only {len(plain.nodes)} layers: the last "
            f"{num_stages - len(plain.nodes)} stages hold none (the last receives the outputs and computes "
            f"the loss) and their ranks idle. Run with at most {len(plain.nodes)} ranks "
            f"(mpirun -n {len(plain.nodes)}) or add layers.",
            stacklevel=5,
        )


def stage_sizes(
    model_graph, options: PipelineOptions, num_stages: int, num_chunks: int, rows: int, world, stage: int
) -> list[int]:
    """Nodes per virtual stage (``num_stages * num_chunks`` of them), as ``split_before`` or ``balance`` say
    (``balance="time"``: measured on this job, collective, with ``rows`` rows)."""
    virtual = num_stages * num_chunks
    try:
        return _sizes(model_graph, options, num_stages, num_chunks, rows, world, stage)
    except PipelineConfigError as error:
        if num_chunks == 1:
            raise
        raise PipelineConfigError(
            f"{error} (with {num_chunks} chunks a rank there are {virtual} virtual stages: balance lists "
            f"{virtual} sizes, split_before {virtual - 1} names)"
        ) from None


def _sizes(model_graph, options, num_stages, num_chunks, rows, world, stage) -> list[int]:
    plain = model_graph.plain
    virtual = num_stages * num_chunks
    balance, split_before = options.balance, options.split_before
    if split_before is not None:
        return cuts.sizes_before(plain, list(split_before), virtual)
    if balance is None:
        return _by_cost(model_graph, virtual)
    if isinstance(balance, str) and balance == "time":
        if num_chunks > 1:
            raise PipelineConfigError(
                f"balance='time' times one stage a rank; with num_chunks={num_chunks} give balance=None "
                f"(parameter counts) or a list of {virtual} sizes, one a virtual stage."
            )
        return balance_by_time(model_graph, num_stages, world, stage, rows)
    return cuts.sizes_of_layers(plain, balance, virtual)


def v_sizes(model_graph, num_stages: int) -> list[int]:
    """The nodes of each of ZB-V's ``2P`` virtual stages, balanced by parameter count as ``balance=None`` does."""
    return _by_cost(model_graph, 2 * num_stages)


def _by_cost(model_graph, count: int) -> list[int]:
    """The nodes of each of ``count`` stages, balanced by the nodes' parameter counts."""
    return cuts.balance_by_cost([node.cost for node in model_graph.plain.nodes], count)


def v_cut_problem(model_graph, options: PipelineOptions, num_stages: int) -> str | None:
    """Why ZB-V's cut is not this model's to make for ``schedule="auto"`` (``None``: it is): a cut the user gave
    (``balance``, ``split_before``: for one stage a rank), fewer layers than its ``2P`` virtual stages, a cut
    that fails. The same on every rank."""
    if options.balance is not None or options.split_before is not None:
        return "balance or split_before give one stage a rank"
    if len(model_graph.plain.nodes) < 2 * num_stages:
        return f"{len(model_graph.plain.nodes)} layers, fewer than its {2 * num_stages} virtual stages"
    try:
        cuts.cut(model_graph.plain, v_sizes(model_graph, num_stages))
    except PipelineConfigError as error:
        return str(error)
    return None
