"""Attention of the fast forward over a transformers ``DynamicCache``: store the new keys/values, attend with sdpa.

Boundary: one forward's attention callback (``program.Attend``): the cache's public ``update`` and torch's
``scaled_dot_product_attention``; builds the forward's mask once from what ``generate``'s callers pass. Other
cache layouts (paged, quantized, static) keep the reference forward (``runner.FastForward.supports``).

Masks, as the speculative loop passes them (``S`` = cached + new tokens):
    None            every cached token is visible; the new tokens are causal among themselves
    [B, S] 0/1      as None, and key columns marked 0 (left padding, holes of shorter rows) are hidden
    [B, 1, T, S]    used as given (a tree's mask: additive float, or bool where True attends)

A query whose every key is hidden (a padding column's own query) still sees itself: sdpa would return NaN for
it, and its keys/values are cached (hidden from every real query by the key mask), so NaN must not reach them.

Shapes: ``B`` rows, ``Hq``/``Hkv`` heads, ``T`` new tokens, ``S`` cached + new tokens, ``D`` head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CacheAttention:
    """``attend(i, q, k, v)`` for one forward of ``T`` new tokens on ``cache`` (a ``DynamicCache``)."""

    def __init__(self, cache, attention_mask: torch.Tensor | None, tokens: int, scaling: float):
        self.cache, self.scaling = cache, scaling
        past = cache.get_seq_length()
        self.mask = attention_bias(attention_mask, tokens, past)

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.update(k, v, index)  # [B, Hkv, S, D] each
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=self.scaling,
                                             enable_gqa=q.shape[1] != keys.shape[1])  # [B, Hq, T, D]
        return out.transpose(1, 2)  # [B, T, Hq, D]


def attention_bias(attention_mask: torch.Tensor | None, tokens: int, past: int) -> torch.Tensor | None:
    """The sdpa mask of a forward of ``tokens`` new tokens after ``past`` cached ones (module docstring):
    None, bool [T, S] or [B, 1, T, S], or a 4D mask passed through."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is None and tokens == 1:
        return None
    total = past + tokens
    query = torch.arange(past, total)[:, None]  # [T, 1] each new token's column
    visible = torch.arange(total)[None, :] <= query  # [T, S] causal
    if attention_mask is None:
        return visible
    if attention_mask.shape[-1] != total:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} columns; the cache holds {past} and "
                         f"{tokens} are new (pass a mask over cached + new tokens).")
    keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    itself = torch.arange(total)[None, :] == query  # [T, S]
    return (visible & keys) | itself  # [B, 1, T, S]
