"""What ``PipelineModel.summary()`` prints: each node with its stage, shape and parameters, what crosses, the ranks.

>>> for line in describe(model.engine, model.name):  # doctest: +SKIP
...     print(line)
PipelineModel "mlp": 2 stages, 4 micro-batches, schedule 1f1b
-------------------------------------------------------
Layer (type)      Stage  Output Shape  Param #
...
Params per stage: 0: 100,480, 1: 1,290
"""

from __future__ import annotations

import numpy as np

from keras_pipe.graph import cut as cuts


def print_summary(model, builder, print_fn) -> None:
    """``model.summary()`` (collective): rank 0 prints :func:`describe`'s lines, or an unbuilt model's layers.

    ``builder``: the model's :class:`~keras_pipe.model.building.ModelBuilder`. A model whose input is not
    known yet is listed unbuilt, as ``Sequential`` lists it.
    """
    engine = model.engine
    if not engine.built and builder.source is None and builder.input_spec is None:
        if engine.world.rank == 0:
            print_fn(f'PipelineModel "{model.name}": not built yet (its input shape is unknown); layers:')
            for layer in builder.layers:
                print_fn(f"  {layer.name} ({type(layer).__name__})")
        return
    model.build()
    if engine.world.rank != 0:
        return
    for line in describe(engine, model.name):
        print_fn(line)


def describe(engine, name: str) -> list[str]:
    """Every line of a built model's summary: the header, the table, the crossings and the ranks."""
    replicas = f" x {engine.num_replicas} replicas" if engine.num_replicas > 1 else ""
    chunks = engine.num_chunks
    chunked = f" of {chunks} chunks each ({engine.num_stages * chunks} virtual stages)" if chunks > 1 else ""
    lines = [
        f'PipelineModel "{name}": {engine.num_stages} stages{chunked}{replicas}, '
        f"{engine.num_microbatches}{' (auto)' if engine.options.num_microbatches == 'auto' else ''} micro-batches, "
        f"schedule {engine.schedule}"
    ]
    if engine.picker is not None:
        lines.append("Schedule " + engine.picker.describe())
    lines += summary_lines(engine)
    notes = getattr(engine.graph, "notes", None) or []
    if notes:
        lines.append("Not split (each runs whole on one stage):")
        lines += ["  " + note for note in notes]
    if engine.num_stages > 1:
        lines.append("Crossings:")
        lines += ["  " + line for line in cuts.describe(engine.cut)]
    if engine.world.size > 1:
        lines.append("Ranks:")
        lines += ["  " + line for line in engine.layout.describe()]
    return lines


def summary_lines(engine) -> list[str]:
    """A table of every node with its stage, output shape and parameters, and the parameters per stage."""
    the_cut, model_graph = engine.cut, engine.graph
    rows = [("Layer (type)", "Stage", "Output Shape", "Param #")]
    per_stage = []
    counted = set()
    for stage in the_cut.stages:
        params = 0
        for n in stage.nodes:
            node = the_cut.graph.nodes[n]
            shapes = [the_cut.graph.tensors[t].shape for t in node.outputs]
            shape = str(shapes[0]) if len(shapes) == 1 else str(tuple(shapes))
            count = 0
            if node.unit is not None and node.unit not in counted:
                counted.add(node.unit)
                count = int(sum(np.prod(w.shape, dtype=np.int64) for w in model_graph.units[node.unit].weights))
            params += count
            where = str(stage.index)
            if engine.num_chunks > 1:  # (a virtual stage, and the rank that holds it)
                where += f" (rank {engine.virtual_ranks[stage.index]})"
            rows.append((f"{node.name} ({node.kind})", where, shape, f"{count:,}"))
        per_stage.append(params)
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    rule = "-" * (sum(widths) + 6)
    lines = [rule]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append(rule)
    lines += [rule, f"Total params: {sum(per_stage):,}"]
    lines.append("Params per stage: " + ", ".join(f"{s}: {n:,}" for s, n in enumerate(per_stage)))
    return lines
