"""Internal: this rank's chunks of a cut, built: each chunk's compute and links, and the executor that runs them.

:meth:`keras_pipe.engine.engine.Engine.build_on` calls :func:`build_chunks`
once the cut and this rank's placement are known (and again for another
placement while ``schedule="auto"`` times its candidates).
"""

from __future__ import annotations

from keras_pipe.engine.allreduce import ReplicaReducer, TiedReducer
from keras_pipe.engine.chunks import Chunk, ChunkComm, Mailbox
from keras_pipe.engine.executor import Executor
from keras_pipe.engine.links import Links
from keras_pipe.stage.compute import StageCompute


def build_chunks(engine) -> None:
    """Sets ``engine.chunks``, ``compute``, ``links`` and ``executor``: this rank's virtual stages of
    ``engine.cut`` under its placement, and the executor over them (``engine``: an
    :class:`~keras_pipe.engine.engine.Engine` whose ``graph`` and ``cut`` are set)."""
    the_cut, model_graph = engine.cut, engine.graph
    mailbox = Mailbox()  # (what this rank's chunks hand each other: engine.chunks)
    engine.chunks = [_chunk(engine, k, mailbox) for k in engine.placement[engine.stage]]
    engine.compute, engine.links = engine.chunks[0].compute, engine.chunks[0].links
    reducer = ReplicaReducer(engine.replicas) if engine.replicas is not None else None
    tied = TiedReducer.create(engine.pipeline, the_cut, engine.stage, model_graph, engine.virtual_ranks)
    pipeline_sum = engine.pipeline.allreduce_sum if engine.num_stages > 1 else None
    engine.executor = Executor(
        engine.compute,
        engine.links,
        reducer,
        is_first=engine.is_first,
        is_last=engine.is_last,
        status=engine.world,
        where=engine.where,
        pipeline_sum=pipeline_sum,
        tied=tied,
        chunks=engine.chunks,
    )
    engine.executor.tracer = engine.tracer


def _chunk(engine, k: int, mailbox: Mailbox) -> Chunk:
    """Virtual stage ``k`` of the cut (this rank's stage, with one chunk a rank): its compute and links.

    ``mailbox``: what this rank's chunks hand each other (:class:`~keras_pipe.engine.chunks.Mailbox`)."""
    the_cut, model_graph = engine.cut, engine.graph
    plain = model_graph.plain
    stage = the_cut.stages[k]
    own = [model_graph.units[unit] for unit in stage.units]
    calls = [model_graph.calls[n] for n in stage.nodes]
    last = len(the_cut.stages) - 1
    output_structure = model_graph.output_structure() if k == last else None
    regularized = [model_graph.units[u] for u in stage.units if min(the_cut.shared.get(u, [k])) == k]
    compute = StageCompute(
        stage,
        calls,
        plain,
        own,
        jit=engine.jit,
        eager=engine.eager,
        recompute=engine.recompute,
        output_structure=output_structure,
        regularized=regularized,
        frozen=engine.frozen,
    )
    links = None
    if engine.num_chunks > 1:
        links = Links(ChunkComm(engine.pipeline, engine.virtual_ranks, k, mailbox), stage, plain.tensors)
    elif engine.num_stages > 1:
        links = Links(engine.pipeline, stage, plain.tensors)
    return Chunk(compute, links, k == 0, k == last)
