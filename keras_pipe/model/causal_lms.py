"""keras_hub's causal language models, each family's cached forward cut into embedding, decoder layers and head.

keras_hub's ``*CausalLM.call_with_cache`` runs the whole model on one token
(or the prompt) with every layer's key/value cache. A pipeline runs it in
pieces, each on the rank that holds the piece's weights: the embedding, each
decoder layer with its own cache, the final norm and the head. A
:class:`Family` says how one family's pieces are called, as its
``call_with_cache`` and ``_build_cache`` call them (keras_hub 0.32); only
the families listed in :data:`FAMILIES` generate, each checked token for
token against the unsplit model's ``generate()`` (tests/mpi_scripts/generation.py).
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
    """

    embedding: tuple[str, ...]
    embed: Callable
    cache_keywords: tuple[str, str]
    cache_heads: Callable
    head: tuple[str, ...] = ("layer_norm", "token_embedding")  # final norm, then the (reversible) embedding

    def run_head(self, backbone, x):
        """The final norm and the logits, as ``call_with_cache`` ends."""
        x = backbone.layer_norm(x)
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


def _opt(backbone, token_ids, index):
    return backbone.embeddings(token_ids, start_index=index)


def _query_heads(backbone):
    return backbone.num_key_value_heads, backbone.hidden_dim // backbone.num_query_heads


def _all_heads(backbone):
    return backbone.num_heads, backbone.hidden_dim // backbone.num_heads


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
}


def family_of(task) -> Family | None:
    """The :class:`Family` of a keras_hub task (by its exact class: a subclass may call its pieces otherwise)."""
    if not type(task).__module__.startswith("keras_hub"):
        return None
    return FAMILIES.get(type(task).__name__)
