"""Attention of the fast forward over a transformers ``DynamicCache``: store the new keys/values, attend with sdpa.

Boundary: one forward's attention callback (``program.Attend``): the cache's public ``update`` and torch's
``scaled_dot_product_attention``; builds the forward's mask once from what ``generate``'s callers pass. Other
cache layouts (paged, quantized, static) keep the reference forward (``runner.FastForward.supports``).

Masks, as the speculative loop passes them (``S`` = cached + new tokens):
    None            every cached token is visible; the new tokens are causal among themselves
    [B, S] 0/1      as None, and key columns marked 0 (left padding, holes of shorter rows) are hidden
    [B, 1, T, S]    used as given (a tree's mask: additive float, or bool where True attends)

Appending: ``DynamicCache.update`` concatenates a layer's whole history with the new tokens on every call, a copy
that grows with the context (measured on the bundled model: ~3 ms a step at 128 cached tokens, ~14 at 600, against
a ~40 ms step). Here a layer's keys/values are views of the first ``S`` columns of a buffer with spare columns
(``_SPARE``), so appending writes only the new tokens. The cache stays an ordinary ``DynamicCache``: its layers'
public ``keys``/``values`` are those views, which every other operation (crop, row selection, keeping a tree's
path, the model's own forward) reads or replaces as it would any tensor; a layer whose tensors are no longer a
prefix of its buffer (replaced by such an operation) is copied into a new buffer at its next append.

A query whose every key is hidden (a padding column's own query) still sees itself: sdpa would return NaN for
it, and its keys/values are cached (hidden from every real query by the key mask), so NaN must not reach them.

Shapes: ``B`` rows, ``Hq``/``Hkv`` heads, ``T`` new tokens, ``S`` cached + new tokens, ``D`` head dim.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

#: layer -> (keys, values) buffers [B, Hkv, capacity, D] whose first columns the layer's tensors view
_SPARE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MIN_CAPACITY = 256  # columns of a new buffer at least; a full one grows by half its need


class CacheAttention:
    """``attend(i, q, k, v)`` for one forward of ``T`` new tokens on ``cache`` (a ``DynamicCache``)."""

    def __init__(self, cache, attention_mask: torch.Tensor | None, tokens: int, scaling: float):
        self.cache, self.scaling = cache, scaling
        past = cache.get_seq_length()
        self.mask = attention_bias(attention_mask, tokens, past)

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = append(self.cache.layers[index], k, v)  # [B, Hkv, S, D] each
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=self.scaling,
                                             enable_gqa=q.shape[1] != keys.shape[1])  # [B, Hq, T, D]
        return out.transpose(1, 2)  # [B, T, Hq, D]


def append(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``DynamicLayer.update`` without the copy of the history: new keys/values [B, Hkv, T, D] are written after
    the layer's ``S`` columns into its buffer; returns (and sets) the layer's keys/values [B, Hkv, S + T, D]."""
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    held, need = layer.get_seq_length(), layer.get_seq_length() + keys.shape[2]
    spare = _SPARE.get(layer)
    if spare is None or not _fits(spare[0], layer.keys, keys, held, need):
        spare = _SPARE[layer] = _grown(layer, keys, values, held, need)
    key_buffer, value_buffer = spare
    key_buffer[:, :, held:need] = keys
    value_buffer[:, :, held:need] = values
    layer.keys, layer.values = key_buffer[:, :, :need], value_buffer[:, :, :need]
    return layer.keys, layer.values


def _fits(buffer: torch.Tensor, stored: torch.Tensor, new: torch.Tensor, held: int, need: int) -> bool:
    """The buffer has room for ``need`` columns of ``new``'s rows/heads, and the layer's ``held`` columns are its
    first ones (the layer's tensor views it from its start with its strides)."""
    if need > buffer.shape[2] or buffer.shape[:2] != new.shape[:2] or buffer.shape[3] != new.shape[3]:
        return False
    return held == 0 or (stored.data_ptr() == buffer.data_ptr() and stored.stride() == buffer.stride())


def _grown(layer, keys: torch.Tensor, values: torch.Tensor, held: int, need: int):
    """New buffers with room for ``need`` columns and spare, holding the layer's ``held`` columns."""
    batch, heads, _, dim = keys.shape
    capacity = max(MIN_CAPACITY, need * 3 // 2)
    buffers = (keys.new_empty(batch, heads, capacity, dim), values.new_empty(batch, heads, capacity, values.shape[3]))
    if held:
        buffers[0][:, :, :held] = layer.keys
        buffers[1][:, :, :held] = layer.values
    return buffers


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
