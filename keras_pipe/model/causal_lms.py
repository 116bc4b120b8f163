"""keras_hub's language models, each family's cached forward cut into embedding, decoder layers and head.

keras_hub's ``*CausalLM.call_with_cache`` runs the whole model on one token
(or the prompt) with every layer's key/value cache. A pipeline runs it in
pieces, each on the rank that holds the piece's weights: the embedding, each
decoder layer with its own cache, the final norm and the head. A
:class:`Family` says how one family's pieces are called, as its
``call_with_cache`` and ``_build_cache`` call them (keras_hub 0.32); only
the families listed in :data:`FAMILIES` generate, each checked token for
token against the unsplit model's ``generate()`` (tests/mpi_scripts/generation.py).

A ``*Seq2SeqLM`` (:class:`Seq2SeqFamily`) has an encoder before: its
embedding and each encoder layer are pieces too, run once on the prompts
given to the encoder; each decoder layer keeps its self-attention cache and
the cross-attention cache of the encoder's output, as the family's
``call_decoder_with_cache`` and ``_build_cache`` keep them. T5's
(:class:`T5Family`) first layer of each stack computes the relative position
bias, the attention mask folded in, and hands it to the layers after it: the
bias travels beside the hidden states to the ranks of those layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from keras import ops


@dataclass(frozen=True)
class Family:
    """How one keras_hub family's ``call_with_cache`` calls its pieces.

    Args:
        embedding: the backbone's attributes the embedding uses (the layers
            whose weights decide which rank runs it).
        embed: ``(backbone, token_ids, cache_update_index) -> hidden states``.
        cache_keywords: the decoder layer's keyword arguments for its cache and its update index.
        cache_heads: ``backbone -> (key/value heads, head size)``: one layer's cache is
            ``(batch, 2, length, heads, head size)``, as the family's ``_build_cache`` makes it.
        head: the final norm's attribute and the embedding's.
        tensor_index: whether ``_build_cache`` gives the prefill's cache index
            as a tensor (SmolLM3's layers take their cache in ``**kwargs``,
            where Keras refuses a Python int beside a tensor) or an int.
    """

    embedding: tuple[str, ...]
    embed: Callable
    cache_keywords: tuple[str, str]
    cache_heads: Callable
    head: tuple[str, ...] = ("layer_norm", "token_embedding")  # final norm, then the (reversible) embedding
    tensor_index: bool = False  # the prefill's cache index a tensor, as the family's _build_cache passes it

    def run_head(self, backbone, x):
        """The final norm (``head[0]``) and the logits, as ``call_with_cache`` ends."""
        x = getattr(backbone, self.head[0])(x)
        return backbone.token_embedding(x, reverse=True)

    def run_layer(self, layer, x, cache, index):
        """One decoder layer on ``x`` with its cache: ``(x, cache)``."""
        cache_keyword, index_keyword = self.cache_keywords
        return layer(x, **{cache_keyword: cache, index_keyword: index})


def _tokens(backbone, token_ids, index):
    return backbone.token_embedding(token_ids)


def _gpt2(backbone, token_ids, index):
    tokens = backbone.token_embedding(token_ids)
    positions = backbone.position_embedding(tokens, start_index=index)
    x = backbone.embeddings_add((tokens, positions))
    return backbone.embeddings_dropout(x)


def _gemma(backbone, token_ids, index):
    x = backbone.token_embedding(token_ids)
    return x * ops.cast(ops.sqrt(backbone.hidden_dim), x.dtype)


def _bloom(backbone, token_ids, index):
    return backbone.embeddings_layer_norm(backbone.token_embedding(token_ids))


def _neox(backbone, token_ids, index):
    return backbone.embeddings_dropout(backbone.token_embedding(token_ids))


def _opt(backbone, token_ids, index):
    return backbone.embeddings(token_ids, start_index=index)


def _query_heads(backbone):
    return backbone.num_key_value_heads, backbone.hidden_dim // backbone.num_query_heads


def _all_heads(backbone):
    return backbone.num_heads, backbone.hidden_dim // backbone.num_heads


def _head_dim(backbone):
    return backbone.num_key_value_heads, backbone.head_dim


def _like_llama(cache_heads=_query_heads, head=("layer_norm", "token_embedding"), tensor_index=False):
    """A family whose ``call_with_cache`` is Llama's: the token embedding, each layer with its
    ``self_attention_cache``, the final norm (``head[0]``) and the reversed embedding."""
    return Family(("token_embedding",), _tokens, _SELF_ATTENTION, cache_heads, head, tensor_index)


_SELF_ATTENTION = ("self_attention_cache", "self_attention_cache_update_index")

# The families checked against the unsplit model's generate(); any other task is refused by name.
FAMILIES: dict[str, Family] = {
    "GPT2CausalLM": Family(("token_embedding", "position_embedding"), _gpt2, _SELF_ATTENTION, _all_heads),
    "LlamaCausalLM": Family(("token_embedding",), _tokens, _SELF_ATTENTION, _query_heads),
    "MistralCausalLM": Family(
        ("token_embedding",),
        _tokens,
        _SELF_ATTENTION,
        lambda b: (b.num_key_value_heads, b.head_dim or b.hidden_dim // b.num_query_heads),
    ),
    "QwenCausalLM": Family(("token_embedding",), _tokens, _SELF_ATTENTION, _query_heads),
    "GemmaCausalLM": Family(
        ("token_embedding",), _gemma, ("cache", "cache_update_index"), lambda b: (b.num_key_value_heads, b.head_dim)
    ),
    "Phi3CausalLM": Family(
        ("token_embedding",), _tokens, ("attention_cache", "attention_cache_update_index"), _query_heads
    ),
    "OPTCausalLM": Family(("embeddings",), _opt, _SELF_ATTENTION, _all_heads),
    # (each checked as the families above: tests/mpi_scripts/generation.py, case "more_families")
    "Llama3CausalLM": _like_llama(),
    "MixtralCausalLM": _like_llama(),
    "QwenMoeCausalLM": _like_llama(),
    "Qwen3CausalLM": _like_llama(_head_dim),
    "Qwen3MoeCausalLM": _like_llama(_head_dim),
    "GptOssCausalLM": _like_llama(lambda b: (b.num_key_value_heads, b.head_dim or b.hidden_dim // b.num_query_heads)),
    "SmolLM3CausalLM": _like_llama(
        lambda b: (b.num_key_value_heads, b.hidden_dim // b.num_attention_heads), ("norm", "token_embedding"), True
    ),
    "FalconCausalLM": Family(
        ("token_embedding",),
        _tokens,
        ("attention_cache", "attention_cache_update_index"),
        lambda b: (b.num_attention_heads, b.hidden_dim // b.num_attention_heads),
        ("final_layernorm", "token_embedding"),
    ),
    "BloomCausalLM": Family(
        ("token_embedding", "embeddings_layer_norm"), _bloom, ("cache", "cache_update_index"), _all_heads
    ),
    "GPTNeoXCausalLM": Family(("token_embedding",), _neox, _SELF_ATTENTION, _all_heads),
}


@dataclass(frozen=True)
class Seq2SeqFamily:
    """How one keras_hub encoder-decoder family's ``call_encoder`` and ``call_decoder_with_cache`` call their pieces.

    Each embedding is cut into steps, each a piece of its own: the token
    lookup (``backbone.token_embedding``, shared by the encoder, the decoder
    and the head, often held by the first and the last rank alone), then
    each of ``encoder_steps`` or ``decoder_steps``, ``(the backbone's
    attribute whose weights decide the rank, (backbone, x, cache_update_index)
    -> x)``, so that each runs where the pipeline holds it. The decoder's
    embedding does not wait for the encoder: in the prefill both run side by
    side on the ranks, and each new token's lookup and embedding run on their
    ranks before the decoder's layers.

    Args:
        encoder_steps, decoder_steps: the embeddings' steps after the lookup.
        head: the backbone's attributes the head uses.
        cache_heads: ``backbone -> (heads, head size)`` of both caches.
        encoder_end, decoder_end: steps after each stack's last layer (its
            final norm), each a piece of its own, as the embeddings' steps.
    """

    encoder_steps: tuple
    decoder_steps: tuple
    head: tuple[str, ...]
    cache_heads: Callable
    encoder_end: tuple = ()
    decoder_end: tuple = ()
    position_bias = False  # (whether a stack's first layer hands a bias to the layers after it)

    def run_encoder_layer(self, layer, x, padding_mask, bias):
        """One encoder layer: ``(x, the bias for the next layer)`` (None: the family has none)."""
        return layer(x, padding_mask=padding_mask), None

    def run_layer(self, layer, x, encoded, padding_mask, cache, cross, index, cross_index, bias):
        """One decoder layer: ``(x, its self-attention cache, its cross-attention cache, the bias for the next)``."""
        x, cache, cross = layer(
            decoder_sequence=x,
            encoder_sequence=encoded,
            encoder_padding_mask=padding_mask,
            self_attention_cache=cache,
            self_attention_cache_update_index=index,
            cross_attention_cache=cross,
            cross_attention_cache_update_index=cross_index,
        )
        return x, cache, cross, None

    def run_head(self, backbone, x):
        return backbone.token_embedding(x, reverse=True)


class T5Family(Seq2SeqFamily):
    """T5's layers, as ``T5Seq2SeqLM.call_encoder`` and ``call_decoder_with_cache`` call them.

    Each stack's first layer computes the relative position bias with the
    attention mask folded in (the padding mask in the encoder, the causal
    mask at the cache index in the decoder) and returns it; every later
    layer takes it and ignores its own mask, so the bias is what travels
    between the ranks, shape ``(rows, heads, queries, keys)``.
    """

    position_bias = True

    def run_encoder_layer(self, layer, x, padding_mask, bias):
        return layer(x, attention_mask=padding_mask[:, None, :], position_bias=bias, use_causal_mask=False)

    def run_layer(self, layer, x, encoded, padding_mask, cache, cross, index, cross_index, bias):
        x, bias, cache, cross = layer(
            x,
            position_bias=bias,
            encoder_hidden_states=encoded,
            encoder_attention_mask=padding_mask[:, None, :],
            use_causal_mask=True,
            self_attention_cache=cache,
            self_attention_cache_update_index=index,
            cross_attention_cache=cross,
            cross_attention_cache_update_index=cross_index,
        )
        return x, cache, cross, bias

    def run_head(self, backbone, x):
        """``T5Seq2SeqLM._logits``: scaled by ``hidden_dim ** -0.5`` where the head is the tied embedding."""
        if backbone.tie_embedding_weights:
            x = ops.multiply(x, ops.cast(backbone.hidden_dim**-0.5, x.dtype))
        return backbone.token_embedding(x, reverse=True)


def _bart_positions(side):
    def positions(backbone, tokens, index):
        embedding = getattr(backbone, f"{side}_position_embedding")
        found = embedding(tokens) if index is None else embedding(tokens, start_index=index)
        return backbone.decoder_embeddings_add((tokens, found))  # (BartSeq2SeqLM.call_encoder adds with it too)

    return positions


def _applied(*names):
    """A step calling the backbone's layers of these names in turn (a norm, then its dropout)."""

    def step(backbone, x, index):
        for name in names:
            x = getattr(backbone, name)(x)
        return x

    return step


def _t5_heads(backbone):
    return backbone.num_heads, backbone.key_value_dim or backbone.hidden_dim // backbone.num_heads


SEQ2SEQ_FAMILIES: dict[str, Seq2SeqFamily] = {
    "BartSeq2SeqLM": Seq2SeqFamily(
        encoder_steps=(
            ("encoder_position_embedding", _bart_positions("encoder")),
            ("encoder_embeddings_layer_norm", _applied("encoder_embeddings_layer_norm", "encoder_embeddings_dropout")),
        ),
        decoder_steps=(
            ("decoder_position_embedding", _bart_positions("decoder")),
            ("decoder_embeddings_layer_norm", _applied("decoder_embeddings_layer_norm", "decoder_embeddings_dropout")),
        ),
        head=("token_embedding",),
        cache_heads=_all_heads,
    ),
    "T5Seq2SeqLM": T5Family(
        encoder_steps=(("encoder_embedding_dropout", _applied("encoder_embedding_dropout")),),
        decoder_steps=(("decoder_embedding_dropout", _applied("decoder_embedding_dropout")),),
        head=("token_embedding",),
        cache_heads=_t5_heads,
        encoder_end=(("encoder_layer_norm", _applied("encoder_layer_norm", "encoder_dropout")),),
        decoder_end=(("decoder_layer_norm", _applied("decoder_layer_norm", "decoder_dropout")),),
    ),
}


def family_of(task) -> Family | Seq2SeqFamily | None:
    """The family of a keras_hub task (by its exact class: a subclass may call its pieces otherwise)."""
    if not type(task).__module__.startswith("keras_hub"):
        return None
    name = type(task).__name__
    return FAMILIES.get(name) or SEQ2SEQ_FAMILIES.get(name)
