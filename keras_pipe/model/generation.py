"""Generation on a pipeline: keras_hub's ``generate()``, each stage running its own decoder layers and their cache.

``PipelineModel.generate`` on a pipelined keras_hub ``*CausalLM`` is the
task's own ``generate()`` (its arguments, its checks, ``strip_prompt``, its
output) with the one function it compiles, ``generate_step``, replaced by
:class:`PipelinedGenerator`. The model's cached forward is cut into pieces
(:mod:`keras_pipe.model.causal_lms`): the embedding, each decoder layer, the
final norm and head. Each piece runs on the first rank, at or after the
previous piece's, that holds its weights (:func:`place`); a rank keeps the
key/value cache of its own layers only. The prompt's prefill goes through
the ranks once, then each token: the rank of the head samples with the
task's sampler and sends the token back to the rank of the embedding.

The batch is cut into groups, in flight together: while group ``g`` is on
one rank, group ``g + 1`` is on the rank before it, so that every rank works
at every step once the pipeline is full (3 ranks, 3 groups; ``P`` prefill,
``k`` the decode step, each rank taking its work in the same order)::

    rank 0: P0 P1 P2 00 01 02 10 11 12 20 ...
    rank 1:    P0 P1 P2 00 01 02 10 11 12 ...
    rank 2:       P0 P1 P2 00 01 02 10 11 12 ...
                           └──── token of 00 back to rank 0, for 10

The tokens are the unsplit model's: each row's token depends on its own row
only; a seeded sampler draws for a group as for the whole batch (the
group's logits in their rows of a batch-sized array, the seed generator at
the step's state), and the loop runs as many steps as the whole batch's
would (a group whose rows are all done goes on until the rank of the head
knows that every group is; what it wrote past the whole batch's last step
is put back). Every rank returns the result, broadcast from the rank of the head.

A ``*Seq2SeqLM`` (BART, T5) adds its encoder's pieces, run once in the prefill:
its embedding and the decoder's are each placed from the first rank on
(:func:`place_side_by_side`), the decoder's layers after both; in the
prefill the encoder's output travels beside the decoder's hidden states to
every rank holding a decoder layer, which keeps its self-attention cache and
the cross-attention cache of that output. Each decode step is then the
decoder's alone, its ranks in order (the encoder's ranks take no part).
T5's relative position bias, made by each stack's first layer, travels
beside the hidden states from that layer's rank to its stack's last
layer's (:meth:`PipelinedGenerator._sends_bias`).

With replicas, each replica generates its share of the batch (the rows
``replica_bounds`` gives it) and the shares are gathered between the
replicas at the end. The loop must still run as many steps as the whole
batch's: after each step the replicas' ranks of the head tell each other
whether their rows are all done, and a group stops once every replica's
are (one step later than one replica alone would know it; that step's
tokens are put back with the others past the end).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.model.causal_lms import FAMILIES, SEQ2SEQ_FAMILIES, Seq2SeqFamily, family_of
from keras_pipe.model.transfer import numpy_dtype
from keras_pipe.mpi.comm import TAG_GENERATION, TAG_TOKENS
from keras_pipe.stage.microbatch import microbatch_bounds, replica_bounds

# keras_hub's samplers whose __call__ is the base Sampler's loop (one draw a step): beam and contrastive search
# keep several candidates a row, which the pipeline does not carry.
SAMPLERS = ("GreedySampler", "TopKSampler", "TopPSampler", "RandomSampler")


@dataclass(frozen=True)
class Piece:
    """One piece of the cached forward: ``kind`` ``"embedding"``, ``"layer"`` (decoder layer ``index``) or ``"head"``.

    ``holders``: the pipeline ranks holding every weight of the piece (``None``: it has none).
    """

    name: str
    kind: str
    index: int = -1
    holders: frozenset | None = None


def place_side_by_side(pieces: list[Piece]) -> list[int]:
    """:func:`place` where a ``*Seq2SeqLM``'s two embeddings run side by side: the decoder's steps and the
    encoder's each placed from rank 0 on, the decoder's layers and head after both."""
    decoder = [p for p in pieces if p.kind in ("lookup", "embedding")]
    encoder = [p for p in pieces if p.kind.startswith("encoder")]
    rest = [p for p in pieces if p not in decoder and p not in encoder]
    first, second = place(decoder), place(encoder)
    return first + second + place(rest, start=max(first + second))


def place(pieces: list[Piece], start: int = 0) -> list[int]:
    """The rank running each piece: the first holding its weights at or after the previous piece's rank.

    Pure data, the same on every rank. Raises :class:`PipelineConfigError`,
    naming the piece, where no such rank is (the pieces would go back to an
    earlier rank: two chunks a rank placed in a loop or a V).

    >>> place([Piece("embedding", "embedding", holders=frozenset({0, 1})),
    ...        Piece("layer_0", "layer", 0, frozenset({0})), Piece("layer_1", "layer", 1, frozenset({1})),
    ...        Piece("head", "head", holders=frozenset({1}))])
    [0, 0, 1, 1]
    """
    ranks, current = [], start
    for piece in pieces:
        if piece.holders is not None:
            later = sorted(r for r in piece.holders if r >= current)
            if not later:
                held = sorted(piece.holders) if piece.holders else "no rank"
                raise PipelineConfigError(
                    f"generate() runs the model's pieces in order, each on a rank holding its weights, the ranks in "
                    f"order; {piece.name} is held by {held}, before rank {current} that runs the piece before it "
                    f"({', '.join(f'{p.name}: rank {r}' for p, r in zip(pieces, ranks))}). Cut the model with one "
                    "chunk a rank (schedule '1f1b', 'gpipe' or 'zb-h1') to generate."
                )
            current = later[0]
        ranks.append(current)
    return ranks


def pieces_of(engine, task, family) -> list[Piece]:
    """The pieces of ``task``'s cached forward, each with the pipeline ranks holding its weights (from the cut)."""
    backbone = task.backbone
    holders = engine.holder_ranks()
    unit_of = {}
    for unit, layer in engine.graph.units.items():
        for sub in [layer, *compat.sublayers(layer)]:
            unit_of.setdefault(id(sub), unit)

    def held_by(name, layers):
        ranks = None
        for layer in layers:
            if not layer.weights:
                continue
            if id(layer) not in unit_of:
                raise PipelineConfigError(
                    f"generate(): {name}'s layer {layer.name!r} is not among the pipeline's layers, so no rank "
                    "is known to hold it."
                )
            found = holders[unit_of[id(layer)]]
            ranks = set(found) if ranks is None else ranks & found
        return None if ranks is None else frozenset(ranks)

    pieces = []
    if isinstance(family, Seq2SeqFamily):
        # the decoder's embedding (its new tokens go there) and the encoder's, side by side: each a chain of steps
        lookup = held_by("the token embedding", [backbone.token_embedding])
        pieces.append(Piece("the decoder's token embedding", "lookup", holders=lookup))
        for index, (name, _) in enumerate(family.decoder_steps):
            pieces.append(Piece(f"the decoder's {name}", "embedding", index, held_by(name, [getattr(backbone, name)])))
        pieces.append(Piece("the encoder's token embedding", "encoder_lookup", holders=lookup))
        for index, (name, _) in enumerate(family.encoder_steps):
            layers = [getattr(backbone, name)]
            pieces.append(Piece(f"the encoder's {name}", "encoder_embedding", index, held_by(name, layers)))
        for index, layer in enumerate(backbone.encoder_transformer_layers):
            pieces.append(Piece(f"encoder layer {layer.name!r}", "encoder_layer", index, held_by(layer.name, [layer])))
        for index, (name, _) in enumerate(family.encoder_end):
            layers = [getattr(backbone, name)]
            pieces.append(Piece(f"the encoder's {name}", "encoder_end", index, held_by(name, layers)))
    else:
        pieces.append(
            Piece("the embedding", "embedding", holders=held_by("the embedding", _layers(backbone, family.embedding)))
        )
    for index, layer in enumerate(decoder_layers(backbone, family)):
        pieces.append(Piece(f"decoder layer {layer.name!r}", "layer", index, held_by(layer.name, [layer])))
    for index, (name, _) in enumerate(getattr(family, "decoder_end", ())):
        pieces.append(Piece(f"the decoder's {name}", "decoder_end", index, held_by(name, [getattr(backbone, name)])))
    pieces.append(Piece("the final norm and head", "head", holders=held_by("the head", _layers(backbone, family.head))))
    return pieces


def decoder_layers(backbone, family) -> list:
    """The decoder layers whose caches generation keeps, in order."""
    if isinstance(family, Seq2SeqFamily):
        return list(backbone.decoder_transformer_layers)
    return list(backbone.transformer_layers)


def _layers(backbone, names):
    return [getattr(backbone, name) for name in names]


class PipelinedGenerator:
    """keras_hub's ``generate_step`` over the pipeline (collective): what ``task.generate()`` calls instead of its own.

    Made once per pipeline cut; checks the family and the placement on
    every rank alike (the same graph, the same cut).
    """

    def __init__(self, model):
        engine = model.engine
        task = model._builder.source
        family = family_of(task)
        if family is None:
            known = sorted(FAMILIES) + sorted(SEQ2SEQ_FAMILIES)
            raise PipelineConfigError(
                f"generate() on a pipeline runs keras_hub's language models {known}, "
                f"each checked against the unsplit model; this pipeline's model is a {type(task).__name__}. Generate "
                "with the whole model in one process: whole = model.to_keras() (rank 0; collective), then "
                "whole.generate(...)."
            )
        self.engine, self.task, self.family, self.backbone = engine, task, family, task.backbone
        self.seq2seq = isinstance(family, Seq2SeqFamily)
        # the prompts' names in keras_hub's generate_step (the decoder's first, then the encoder's) and its output's
        self.names = (
            ("decoder_token_ids", "decoder_padding_mask", "encoder_token_ids", "encoder_padding_mask")
            if self.seq2seq
            else ("token_ids", "padding_mask")
        )
        self.decoder_layers = decoder_layers(task.backbone, family)
        self.pieces = pieces_of(engine, task, family)
        self.ranks = place_side_by_side(self.pieces) if self.seq2seq else place(self.pieces)
        self.prefill_chain = sorted(set(self.ranks))  # the ranks taking part in the prefill, in order
        # the ranks taking part in each decode step, in order (a *Seq2SeqLM's encoder runs once, in the prefill)
        self.chain = sorted({r for p, r in zip(self.pieces, self.ranks) if not p.kind.startswith("encoder")})
        self.mine = [piece for piece, rank in zip(self.pieces, self.ranks) if rank == engine.stage]
        # T5's relative position bias: made by each stack's first layer, it travels from that layer's rank to the
        # rank of the stack's last layer (the ranks from, up to: each rank in between sends it on)
        self.bias_spans = {}
        if getattr(family, "position_bias", False):
            for kind in ("encoder_layer", "layer"):
                ranks = [r for p, r in zip(self.pieces, self.ranks) if p.kind == kind]
                self.bias_spans[kind] = (ranks[0], ranks[-1]) if ranks else (0, 0)
        self.num_groups = engine.num_stages
        jit = bool(getattr(task, "jit_compile", True)) and not task.run_eagerly  # (as keras_hub compiles generate)
        self.compiled = {}
        self.jit, self.eager = jit, bool(task.run_eagerly)

    # -- what each rank computes ---------------------------------------------------------

    def _function(self, name, fn):
        if name not in self.compiled:
            self.compiled[name] = fn if self.eager else tf.function(fn, jit_compile=self.jit, reduce_retracing=True)
        return self.compiled[name]

    def _sends_bias(self, kind: str, rank: int) -> bool:
        """Whether ``rank``'s output of stack ``kind`` (``"encoder_layer"``, ``"layer"``) has a bias beside it."""
        span = self.bias_spans.get(kind)
        return span is not None and span[0] <= rank < span[1]

    def _segment(self, x, bias, caches, index, head: bool):
        """This rank's decoder pieces on ``x`` (token ids on the rank of the embedding): ``(output, bias, caches)``.

        ``caches``: its decoder layers' caches (a ``*Seq2SeqLM``'s: ``(self-attention
        caches, cross-attention caches, the encoder's output, its padding mask)``).
        ``bias``: T5's position bias from the decoder's first layer (else None).
        """
        backbone, family = self.backbone, self.family
        if self.seq2seq:
            own, cross, encoded, padding_mask = caches
        else:
            own = caches
        own, updated = list(own), []
        for piece in self.mine:
            if piece.kind == "lookup":
                x = backbone.token_embedding(x)
            elif piece.kind == "embedding" and self.seq2seq:
                x = family.decoder_steps[piece.index][1](backbone, x, index)
            elif piece.kind == "embedding":
                x = family.embed(backbone, x, index)
            elif piece.kind == "layer":
                layer, k = self.decoder_layers[piece.index], len(updated)
                if self.seq2seq:
                    x, cache, _, bias = family.run_layer(
                        layer, x, encoded, padding_mask, own[k], cross[k], index, None, bias
                    )
                else:
                    x, cache = family.run_layer(layer, x, own[k], index)
                updated.append(cache)
            elif piece.kind == "decoder_end":
                x = family.decoder_end[piece.index][1](backbone, x, index)
            elif piece.kind == "head" and head:
                x = family.run_head(backbone, x)
        return x, bias, ((updated, cross, encoded, padding_mask) if self.seq2seq else updated)

    def _encode_segment(self, encoded, encoder_bias, x, bias, encoder_ids, padding_mask, decoder_ids, own, cross):
        """A ``*Seq2SeqLM``'s prefill on this rank: its encoder pieces, then its decoder pieces over the decoder's
        prompts, seeding both caches (``_build_cache``); ``(encoder output, its bias, decoder hidden, its bias,
        own, cross)`` (the biases T5's, else None). The decoder's final norm and head are not run: keras_hub's
        prefill keeps their output for contrastive search alone, which the pipeline refuses."""
        backbone, family = self.backbone, self.family
        own_updated, cross_updated = [], []
        for piece in self.mine:
            if piece.kind == "lookup":
                x = backbone.token_embedding(decoder_ids)
            elif piece.kind == "encoder_lookup":
                encoded = backbone.token_embedding(encoder_ids)
            elif piece.kind == "encoder_embedding":
                encoded = family.encoder_steps[piece.index][1](backbone, encoded, None)
            elif piece.kind == "encoder_layer":
                layer = backbone.encoder_transformer_layers[piece.index]
                encoded, encoder_bias = family.run_encoder_layer(layer, encoded, padding_mask, encoder_bias)
            elif piece.kind == "encoder_end":
                encoded = family.encoder_end[piece.index][1](backbone, encoded, None)
            elif piece.kind == "embedding":
                x = family.decoder_steps[piece.index][1](backbone, x, 0)
            elif piece.kind == "layer":
                k = len(own_updated)
                layer = self.decoder_layers[piece.index]
                x, cache, cross_cache, bias = family.run_layer(
                    layer, x, encoded, padding_mask, own[k], cross[k], 0, 0, bias
                )
                own_updated.append(cache)
                cross_updated.append(cross_cache)
        return encoded, encoder_bias, x, bias, own_updated, cross_updated

    def _empty_caches(self, rows: int, length: int) -> list:
        heads, size = self.family.cache_heads(self.backbone)
        count = sum(piece.kind == "layer" for piece in self.mine)
        return [keras.ops.zeros((rows, 2, length, heads, size), dtype=self.task.compute_dtype) for _ in range(count)]

    def _check_sampler(self):
        sampler = self.task.sampler
        if type(sampler).__name__ not in SAMPLERS or not type(sampler).__module__.startswith("keras_hub"):
            raise PipelineConfigError(
                f"generate() on a pipeline samples with {list(SAMPLERS)} (one token a row a step); the task's "
                f"sampler is a {type(sampler).__name__}. compile(sampler=...) the task with one of them, or generate "
                "with the whole model in one process (model.to_keras())."
            )
        return sampler

    # -- generate_step ----------------------------------------------------------------

    def __call__(self, inputs, stop_token_ids=None):
        """keras_hub's ``generate_step(inputs, stop_token_ids)``: ``{"token_ids", "padding_mask"}`` on every rank."""
        sampler = self._check_sampler()
        comm = self.engine.pipeline
        arrays = [np.asarray(keras.ops.convert_to_numpy(inputs[name])) for name in self.names]
        arrays = [a.astype(bool) if "mask" in name else a for a, name in zip(arrays, self.names)]
        if self.engine.num_stages > 1:  # (the first stage's prompts and stop tokens, on every rank)
            described = [[list(a.shape), a.dtype.str] for a in arrays] if comm.rank == 0 else None
            described, stop = comm.bcast_json([described, _listed(stop_token_ids)], root=0)
            arrays = [
                comm.bcast_array(np.ascontiguousarray(a) if comm.rank == 0 else np.empty(shape, dtype), root=0)
                for a, (shape, dtype) in zip(arrays, described)
            ]
            stop_token_ids = stop
        token_ids, mask, *extra = arrays
        stop_token_ids = _listed(stop_token_ids)
        start = int(mask.sum(axis=-1).min())
        if start < 1:
            raise PipelineConfigError(
                "generate(): every prompt needs at least one token (a row's padding_mask is empty)."
            )
        seed = getattr(sampler, "seed_generator", None)
        initial = None if seed is None else np.asarray(keras.ops.convert_to_numpy(seed.state.value))
        rows = self._share([token_ids, mask, *extra], stop_token_ids, initial)
        if rows is None:  # (one replica, or fewer prompts than replicas: every replica generates the whole batch)
            tokens, steps = self._generate(token_ids, mask, start, stop_token_ids, sampler, initial, extra)
        else:
            first, last = rows[self.engine.replica]
            mine = [a[first:last] for a in extra]
            part, steps = self._generate(
                token_ids[first:last], mask[first:last], start, stop_token_ids, sampler, initial, mine, first, len(mask)
            )
            tokens = self.engine.replicas.allgather_rows(part, [b - a for a, b in rows])
        if seed is not None:  # (one draw a step, as the unsplit model's loop)
            seed.state.assign(initial + np.asarray([0, steps], initial.dtype))
        if stop_token_ids is None:
            padding_mask = np.ones_like(tokens, dtype=bool)
        else:
            ends = (np.isin(tokens, stop_token_ids) & ~mask).astype("int32")
            padding_mask = (np.cumsum(ends, axis=-1) - ends) == 0
        return {self.names[0]: tokens, self.names[1]: padding_mask}

    def _share(self, arrays, stop, initial):
        """Each replica's rows of the batch, where the replicas split it (collective over the replicas); else None.

        The replicas must have been given the same prompts (and stop tokens, and
        seed state): their digests are compared, and a difference is an error
        on every rank, never one replica's rows joined to another's.
        """
        engine = self.engine
        if engine.num_replicas == 1 or len(arrays[0]) < engine.num_replicas:
            return None
        parts = [*arrays, np.asarray(stop or [], np.int64), np.asarray([] if initial is None else initial)]
        digest = hashlib.blake2b(b"".join(np.ascontiguousarray(p).tobytes() for p in parts), digest_size=8)
        everyone = engine.replicas.allgather_array(np.frombuffer(digest.digest(), np.int64))
        if len(set(everyone[:, 0].tolist())) > 1:
            raise PipelineConfigError(
                "generate(): the replicas were given different prompts, stop tokens or sampler seeds; each replica "
                "generates its share of one batch, so every rank must call generate() with the same inputs."
            )
        return replica_bounds(len(arrays[0]), engine.num_replicas)

    def _generate(self, token_ids, mask, start, stop, sampler, initial, extra, offset=0, batch=None):
        """The pipelined loop on this rank; ``(every row's tokens, steps the whole batch's loop ran)`` on every rank.

        ``offset``, ``batch``: where the replicas split the batch, this
        replica's rows start at row ``offset`` of a batch of ``batch`` rows
        (a seeded sampler draws as for it) and the loop runs, on every
        replica, as many steps as the whole batch's would. ``extra``: a
        ``*Seq2SeqLM``'s encoder prompts and their padding mask (these rows').
        """
        comm, me = self.engine.pipeline, self.engine.stage
        rows, length = token_ids.shape
        split = batch is not None
        groups = min(self.num_groups, batch // self.engine.num_replicas if split else rows)
        bounds = microbatch_bounds(rows, groups)
        prompt = token_ids.copy()
        most = length - start  # (keras_hub's loop runs at most this many steps)
        done = [[_all_done(prompt[a:b], mask[a:b], stop)] for a, b in bounds]  # done[g][k]: after k steps
        # everywhere[k]: whether the whole batch (every replica's rows) is done after k steps, where split
        everywhere = [self._everywhere(all(group[0] for group in done))] if split else None
        steps = 0 if most == 0 else (_first_true(everywhere) if split else _first_all_done(done, 0))
        if me in self.prefill_chain and (steps is None or steps > 0):
            split_at = (offset, batch, everywhere)
            self._loop(prompt, mask, bounds, start, most, stop, sampler, initial, done, split_at, extra)
        last = self.chain[-1]
        if me == last:
            steps = _first_all_done(done, most) if not split else _first_true(everywhere)
            steps = most if steps is None else min(steps, most)
            prompt[:, start + steps :] = token_ids[:, start + steps :]  # (steps past the whole batch's, put back)
        if self.engine.num_stages > 1:
            steps = comm.bcast_json(steps, root=last)
            prompt = comm.bcast_array(prompt, root=last)
        return prompt, steps

    def _everywhere(self, mine: bool) -> bool:
        """Whether every replica's rows are done (collective over this stage's replicas)."""
        flags = self.engine.replicas.allgather_array(np.asarray([int(mine)], np.int64))
        return bool(flags.all())

    def _loop(self, prompt, mask, bounds, start, most, stop, sampler, initial, done, split_at, extra):
        comm, me, chain = self.engine.pipeline, self.engine.stage, self.chain
        offset, batch, everywhere = split_at
        batch = prompt.shape[0] if batch is None else batch
        width = self.backbone.hidden_dim
        hidden_dtype = numpy_dtype(self.task.compute_dtype)
        segment = self._function("segment", self._segment)
        comm.doing = "generating (prefill)"
        if self.seq2seq:
            caches = self._encode(prompt, bounds, extra, width, hidden_dtype)
        else:
            caches = self._prefill(prompt, bounds, segment, width, hidden_dtype)
        if me not in chain:  # (a rank of the encoder alone: done)
            comm.flush()
            return
        previous, following = self._neighbours(chain)
        first, last = previous is None, following is None
        draw = self._function(
            ("draw", id(sampler)), lambda logits: sampler.get_next_token(sampler.compute_probabilities(logits))
        )
        comm.doing = "generating (decoding)"
        active, answers, step = list(range(len(bounds))), {}, 0
        bias_shape = (self.backbone.num_heads, 1, prompt.shape[1]) if self.bias_spans else None
        while active:
            sampled = False
            for g in list(active):
                a, b = bounds[g]
                bias = None
                if first:
                    if step == 0:
                        column, stopped = prompt[a:b, start - 1], False
                    elif last:
                        column, stopped = answers.pop(g)
                    else:
                        message = comm.recv_exact(chain[-1], TAG_TOKENS, (b - a + 1,), np.int64)
                        column, stopped = message[:-1].astype(prompt.dtype), bool(message[-1])
                    if stopped:
                        active.remove(g)
                        if not last:  # (no rows: the group is done, on every rank of the chain)
                            comm.send(np.empty((0, 1, width), hidden_dtype), following, TAG_GENERATION)
                        continue
                    x = np.asarray(column)[:, None]
                else:
                    x = comm.recv(previous, TAG_GENERATION, (1, width), hidden_dtype)
                    if not len(x):
                        active.remove(g)
                        if not last:
                            comm.send(x, following, TAG_GENERATION)
                        continue
                    if self._sends_bias("layer", previous):
                        bias = comm.recv(previous, TAG_GENERATION, bias_shape, np.float32)
                y, bias, caches[g] = segment(x, bias, caches[g], np.int32(start + step - 1), last)
                if not last:
                    comm.send(np.asarray(y), following, TAG_GENERATION)
                    if self._sends_bias("layer", me):
                        comm.send(_exact_float32(bias), following, TAG_GENERATION)
                    continue
                logits = np.asarray(y)[:, 0, :]
                column = self._sample(sampler, draw, logits, offset + a, offset + b, batch, initial, step)
                position = start + step
                column = np.where(mask[a:b, position], prompt[a:b, position], column.astype(prompt.dtype))
                prompt[a:b, position] = column
                done[g].append(_all_done(prompt[a:b], mask[a:b], stop))
                sampled = True
                if everywhere is None:
                    known = _first_all_done(done, step + 1)
                else:  # (what the replicas have told each other, up to the last step: the same on each)
                    known = _first_true(everywhere)
                stopped = step + 1 >= most or (known is not None and known <= step + 1)
                if first:
                    answers[g] = (column, stopped)
                else:
                    comm.send(np.append(column, stopped).astype(np.int64), chain[0], TAG_TOKENS)
            if sampled and everywhere is not None:  # (every replica's last rank sampled this step, for every group)
                everywhere.append(self._everywhere(all(group[step + 1] for group in done)))
            step += 1
        comm.flush()

    def _neighbours(self, chain):
        me = self.engine.stage
        where = chain.index(me)
        return (chain[where - 1] if where else None), (chain[where + 1] if where < len(chain) - 1 else None)

    def _prefill(self, prompt, bounds, segment, width, hidden_dtype) -> list:
        """The prompts, once through the ranks, each group's; this rank's caches of each group."""
        comm = self.engine.pipeline
        previous, following = self._neighbours(self.chain)
        caches = []
        for a, b in bounds:
            if previous is None:
                x = prompt[a:b]
            else:
                x = comm.recv(previous, TAG_GENERATION, (prompt.shape[1], width), hidden_dtype)
            index = np.int32(0) if self.family.tensor_index else 0  # (as the family's _build_cache gives it)
            y, _, group_caches = segment(x, None, self._empty_caches(b - a, prompt.shape[1]), index, False)
            caches.append(group_caches)
            if following is not None:
                comm.send(np.asarray(y), following, TAG_GENERATION)
        return caches

    def _encode(self, prompt, bounds, extra, width, hidden_dtype) -> list:
        """A ``*Seq2SeqLM``'s prefill, each group's: the encoder's prompts through the encoder's ranks, then the
        decoder's through the decoder's, the encoder's output travelling with them to every rank that holds a
        decoder layer (its cross-attention cache). This rank's caches of each group (decoder ranks)."""
        comm, me = self.engine.pipeline, self.engine.stage
        encoder_ids, padding_mask = extra
        previous, following = self._neighbours(self.prefill_chain)
        decoder_from = self.chain[0]  # (the rank of the decoder's token lookup: its output travels from there)
        encode = self._function("encode", self._encode_segment)
        lengths = (encoder_ids.shape[1], prompt.shape[1])
        heads = self.backbone.num_heads
        caches = []
        for a, b in bounds:
            encoded = x = encoder_bias = bias = None
            if previous is not None:
                encoded = comm.recv(previous, TAG_GENERATION, (lengths[0], width), hidden_dtype)
                if self._sends_bias("encoder_layer", previous):
                    encoder_bias = comm.recv(previous, TAG_GENERATION, (heads, lengths[0], lengths[0]), np.float32)
                if previous >= decoder_from:
                    x = comm.recv(previous, TAG_GENERATION, (lengths[1], width), hidden_dtype)
                if self._sends_bias("layer", previous):
                    bias = comm.recv(previous, TAG_GENERATION, (heads, lengths[1], lengths[1]), np.float32)
            own = self._empty_caches(b - a, lengths[1])
            cross = self._empty_caches(b - a, lengths[0])
            encoded, encoder_bias, x, bias, own, cross = encode(
                encoded, encoder_bias, x, bias, encoder_ids[a:b], padding_mask[a:b], prompt[a:b], own, cross
            )
            if following is not None:
                comm.send(np.asarray(encoded), following, TAG_GENERATION)
                if self._sends_bias("encoder_layer", me):
                    comm.send(_exact_float32(encoder_bias), following, TAG_GENERATION)
                if me >= decoder_from:
                    comm.send(np.asarray(x), following, TAG_GENERATION)
                if self._sends_bias("layer", me):
                    comm.send(_exact_float32(bias), following, TAG_GENERATION)
            caches.append((own, cross, encoded, padding_mask[a:b]) if me >= decoder_from else None)
        return caches

    def _sample(self, sampler, draw, logits, a, b, batch, initial, step):
        """The group's next tokens; a seeded sampler draws as for the whole batch, at the step's seed state."""
        if initial is None:
            return np.asarray(draw(logits))
        sampler.seed_generator.state.assign(initial + np.asarray([0, step], initial.dtype))
        whole = np.zeros((batch,) + logits.shape[1:], logits.dtype)
        whole[a:b] = logits
        return np.asarray(draw(whole))[a:b]


def _exact_float32(bias) -> np.ndarray:
    """T5's position bias as float32 (exact from any float16/bfloat16/float32 it was made in: the layers that take
    it cast it to their scores' dtype before any use)."""
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(bias, "float32")))


def _listed(stop_token_ids):
    return None if stop_token_ids is None else [int(t) for t in stop_token_ids]


def _all_done(prompt, mask, stop) -> bool:
    """keras_hub's loop condition for these rows: each holds a stop token outside its prompt."""
    if stop is None:
        return False
    return bool(np.all(np.any(np.isin(prompt, stop) & ~mask, axis=-1)))


def _first_true(flags):
    """The first index whose flag is set, or None."""
    return next((k for k, flag in enumerate(flags) if flag), None)


def _first_all_done(done, upto: int):
    """The first step count ``<= upto`` after which every group is known done (the whole batch's loop ends), or None."""
    for k in range(upto + 1):
        if all(k < len(group) for group in done) and all(group[k] for group in done):
            return k
    return None


def generate(model, inputs, max_length=None, stop_token_ids="auto", strip_prompt=False, num_groups=None):
    """``task.generate(...)`` with its ``generate_step`` pipelined (collective); see :class:`PipelinedGenerator`."""
    engine = model.engine
    if not engine.built:
        model.build()
    generator = model.__dict__.get("_generator")
    if generator is None or generator.engine.cut is not engine.cut:
        generator = PipelinedGenerator(model)
        object.__setattr__(model, "_generator", generator)  # (untracked by Keras)
    if num_groups is not None and (not isinstance(num_groups, (int, np.integer)) or num_groups < 1):
        raise PipelineConfigError(f"generate(num_groups={num_groups!r}): a positive number of groups.")
    generator.num_groups = int(num_groups or engine.num_stages)
    task = generator.task
    previous = task.generate_function
    task.generate_function = generator
    try:
        # (strip_prompt passed only where given: Phi3CausalLM.generate has none, and refuses it as the unsplit would)
        extra = {"strip_prompt": strip_prompt} if strip_prompt else {}
        return task.generate(inputs, max_length=max_length, stop_token_ids=stop_token_ids, **extra)
    finally:
        task.generate_function = previous
