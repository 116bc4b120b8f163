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
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.errors import PipelineConfigError
from keras_pipe.model.causal_lms import FAMILIES, family_of
from keras_pipe.model.transfer import numpy_dtype
from keras_pipe.mpi.comm import TAG_GENERATION, TAG_TOKENS
from keras_pipe.stage.microbatch import microbatch_bounds

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


def place(pieces: list[Piece]) -> list[int]:
    """The rank running each piece: the first holding its weights at or after the previous piece's rank.

    Pure data, the same on every rank. Raises :class:`PipelineConfigError`,
    naming the piece, where no such rank is (the pieces would go back to an
    earlier rank: two chunks a rank placed in a loop or a V).

    >>> place([Piece("embedding", "embedding", holders=frozenset({0, 1})),
    ...        Piece("layer_0", "layer", 0, frozenset({0})), Piece("layer_1", "layer", 1, frozenset({1})),
    ...        Piece("head", "head", holders=frozenset({1}))])
    [0, 0, 1, 1]
    """
    ranks, current = [], 0
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

    pieces = [
        Piece("the embedding", "embedding", holders=held_by("the embedding", _layers(backbone, family.embedding)))
    ]
    for index, layer in enumerate(backbone.transformer_layers):
        pieces.append(Piece(f"decoder layer {layer.name!r}", "layer", index, held_by(layer.name, [layer])))
    pieces.append(Piece("the final norm and head", "head", holders=held_by("the head", _layers(backbone, family.head))))
    return pieces


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
            raise PipelineConfigError(
                f"generate() on a pipeline runs keras_hub's causal language models {sorted(FAMILIES)}, each checked "
                f"against the unsplit model; this pipeline's model is a {type(task).__name__}. Generate with the "
                "whole model in one process: whole = model.to_keras() (rank 0; collective), then "
                "whole.generate(...)."
            )
        self.engine, self.task, self.family, self.backbone = engine, task, family, task.backbone
        self.pieces = pieces_of(engine, task, family)
        self.ranks = place(self.pieces)
        self.chain = list(dict.fromkeys(self.ranks))  # the ranks taking part, in order
        self.mine = [piece for piece, rank in zip(self.pieces, self.ranks) if rank == engine.stage]
        self.num_groups = engine.num_stages
        jit = bool(getattr(task, "jit_compile", True)) and not task.run_eagerly  # (as keras_hub compiles generate)
        self.compiled = {}
        self.jit, self.eager = jit, bool(task.run_eagerly)

    # -- what each rank computes ---------------------------------------------------------

    def _function(self, name, fn):
        if name not in self.compiled:
            self.compiled[name] = fn if self.eager else tf.function(fn, jit_compile=self.jit, reduce_retracing=True)
        return self.compiled[name]

    def _segment(self, x, caches, index, head: bool):
        """This rank's pieces on ``x`` (token ids on the rank of the embedding): ``(output, its layers' caches)``."""
        backbone, family = self.backbone, self.family
        caches, updated = list(caches), []
        for piece in self.mine:
            if piece.kind == "embedding":
                x = family.embed(backbone, x, index)
            elif piece.kind == "layer":
                x, cache = family.run_layer(backbone.transformer_layers[piece.index], x, caches[len(updated)], index)
                updated.append(cache)
            elif head:
                x = family.run_head(backbone, x)
        return x, updated

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
        token_ids = np.asarray(keras.ops.convert_to_numpy(inputs["token_ids"]))
        mask = np.asarray(keras.ops.convert_to_numpy(inputs["padding_mask"])).astype(bool)
        if self.engine.num_stages > 1:  # (the first stage's prompts and stop tokens, on every rank)
            shape, dtype, stop = comm.bcast_json(
                [list(token_ids.shape), token_ids.dtype.str, _listed(stop_token_ids)], root=0
            )
            token_ids = comm.bcast_array(
                np.ascontiguousarray(token_ids, dtype) if comm.rank == 0 else np.empty(shape, dtype), root=0
            )
            mask = comm.bcast_array(mask if comm.rank == 0 else np.empty(shape, bool), root=0)
            stop_token_ids = stop
        stop_token_ids = _listed(stop_token_ids)
        start = int(mask.sum(axis=-1).min())
        if start < 1:
            raise PipelineConfigError(
                "generate(): every prompt needs at least one token (a row's padding_mask is empty)."
            )
        seed = getattr(sampler, "seed_generator", None)
        initial = None if seed is None else np.asarray(keras.ops.convert_to_numpy(seed.state.value))
        tokens, steps = self._generate(token_ids, mask, start, stop_token_ids, sampler, initial)
        if seed is not None:  # (one draw a step, as the unsplit model's loop)
            seed.state.assign(initial + np.asarray([0, steps], initial.dtype))
        if stop_token_ids is None:
            padding_mask = np.ones_like(tokens, dtype=bool)
        else:
            ends = (np.isin(tokens, stop_token_ids) & ~mask).astype("int32")
            padding_mask = (np.cumsum(ends, axis=-1) - ends) == 0
        return {"token_ids": tokens, "padding_mask": padding_mask}

    def _generate(self, token_ids, mask, start, stop, sampler, initial):
        """The pipelined loop on this rank; ``(every row's tokens, steps the whole batch's loop ran)`` on every rank."""
        comm, me = self.engine.pipeline, self.engine.stage
        batch, length = token_ids.shape
        bounds = microbatch_bounds(batch, min(self.num_groups, batch))
        prompt = token_ids.copy()
        most = length - start  # (keras_hub's loop runs at most this many steps)
        done = [[_all_done(prompt[a:b], mask[a:b], stop)] for a, b in bounds]  # done[g][k]: after k steps
        steps = 0 if most == 0 else _first_all_done(done, 0)
        if me in self.chain and (steps is None or steps > 0):
            self._loop(prompt, mask, bounds, start, most, stop, sampler, initial, done)
        last = self.chain[-1]
        if me == last:
            steps = _first_all_done(done, most)
            steps = most if steps is None else min(steps, most)
            prompt[:, start + steps :] = token_ids[:, start + steps :]  # (steps past the whole batch's, put back)
        if self.engine.num_stages > 1:
            steps = comm.bcast_json(steps, root=last)
            prompt = comm.bcast_array(prompt, root=last)
        return prompt, steps

    def _loop(self, prompt, mask, bounds, start, most, stop, sampler, initial, done):
        comm, me, chain = self.engine.pipeline, self.engine.stage, self.chain
        where = chain.index(me)
        first, last = where == 0, where == len(chain) - 1
        previous = None if first else chain[where - 1]
        following = None if last else chain[where + 1]
        width = self.backbone.hidden_dim
        hidden_dtype = numpy_dtype(self.task.compute_dtype)
        segment = self._function("segment", self._segment)
        draw = self._function(
            ("draw", id(sampler)), lambda logits: sampler.get_next_token(sampler.compute_probabilities(logits))
        )
        comm.doing = "generating (prefill)"
        caches = []
        for a, b in bounds:  # the prompts, once through the ranks
            x = prompt[a:b] if first else comm.recv(previous, TAG_GENERATION, (prompt.shape[1], width), hidden_dtype)
            y, group_caches = segment(x, self._empty_caches(b - a, prompt.shape[1]), 0, False)
            caches.append(group_caches)
            if not last:
                comm.send(np.asarray(y), following, TAG_GENERATION)
        comm.doing = "generating (decoding)"
        active, answers, step = list(range(len(bounds))), {}, 0
        while active:
            for g in list(active):
                a, b = bounds[g]
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
                y, caches[g] = segment(x, caches[g], np.int32(start + step - 1), last)
                if not last:
                    comm.send(np.asarray(y), following, TAG_GENERATION)
                    continue
                column = self._sample(sampler, draw, np.asarray(y)[:, 0, :], a, b, prompt.shape[0], initial, step)
                position = start + step
                column = np.where(mask[a:b, position], prompt[a:b, position], column.astype(prompt.dtype))
                prompt[a:b, position] = column
                done[g].append(_all_done(prompt[a:b], mask[a:b], stop))
                known = _first_all_done(done, step + 1)
                stopped = step + 1 >= most or (known is not None and known <= step + 1)
                if first:
                    answers[g] = (column, stopped)
                else:
                    comm.send(np.append(column, stopped).astype(np.int64), chain[0], TAG_TOKENS)
            step += 1
        comm.flush()

    def _sample(self, sampler, draw, logits, a, b, batch, initial, step):
        """The group's next tokens; a seeded sampler draws as for the whole batch, at the step's seed state."""
        if initial is None:
            return np.asarray(draw(logits))
        sampler.seed_generator.state.assign(initial + np.asarray([0, step], initial.dtype))
        whole = np.zeros((batch,) + logits.shape[1:], logits.dtype)
        whole[a:b] = logits
        return np.asarray(draw(whole))[a:b]


def _listed(stop_token_ids):
    return None if stop_token_ids is None else [int(t) for t in stop_token_ids]


def _all_done(prompt, mask, stop) -> bool:
    """keras_hub's loop condition for these rows: each holds a stop token outside its prompt."""
    if stop is None:
        return False
    return bool(np.all(np.any(np.isin(prompt, stop) & ~mask, axis=-1)))


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
