"""Paged attention: attention that reads K/V through a block table, registered with transformers as
``attn_implementation="kvspec_paged"`` (``AttentionInterface`` *and* ``AttentionMaskInterface``).

Boundary: this module owns the attention math over paged K/V and its registration; the block tables
come from ``hf_kvspec.cache.paged.PagedCache``, which hands them over through the kwargs of
``cache.update`` (transformers passes that same dict on to the attention function). Given contiguous
K/V and no ``paged_kv`` (any other cache, or none), the function is plain grouped attention.

Two paths, compared in ``tests/attention/test_paged_attention.py``:
    fast       ``paged_attention_forward``: one block-level gather (whole pages, M·P slots per row, then
               a free slice drops the unwritten tail of the last block), query heads folded onto their
               KV head (no ``repeat_kv``), then SDPA — or an einsum softmax when logits are soft-capped.
    reference  ``reference_paged_attention``: gather token by token into contiguous K/V, ``repeat_kv``,
               eager softmax. Obviously correct, kept as the oracle.

Deviation from vLLM's kernel (arXiv 2309.06180): on CPU with stock torch ops we still materialise the
gathered pages once per layer instead of streaming them block by block through an online softmax;
what paging buys here is memory (no per-sequence pre-allocation, sharing, cheap rollback), not FLOPs.

Shape legend:
    B batch · Hq query heads · Hkv KV heads · G = Hq / Hkv · T new (query) tokens · S key tokens
    (cached + new) · D head dim · N physical blocks · P block size · M blocks per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "kvspec_paged"


@dataclass(frozen=True)
class PagedKV:
    """What a paged cache layer hands to the attention function (as kwarg ``paged_kv``)."""

    block_tables: torch.Tensor  # [B, M] int64 physical block ids, row b's token t in block [b, t // P]
    kv_length: int  # S: tokens per row, cached + new (the same for every row)


# ---- the two paths ---------------------------------------------------------------------------------
def gather_blocks(pages: torch.Tensor, block_tables: torch.Tensor, kv_length: int) -> torch.Tensor:
    """K (or V) ``[B, Hkv, S, D]`` from pages ``[N, P, Hkv, D]``, one whole-block ``index_select``.

    The gather runs over the head-major view ``[Hkv, N, P, D]``: with ``PagedCache``'s storage (head-major
    in memory) that view is contiguous, and the result's token axis is contiguous per head — SDPA reads it
    as fast as ``DynamicCache``'s contiguous K/V, whereas a token-major gather leaves rows ``Hkv·D`` apart
    (1.1-1.5x slower SDPA at bs 1-8, S 2048). Any page layout gives the same values.
    """
    batch, num_row_blocks = block_tables.shape
    _, block_size, heads, dim = pages.shape
    rows = pages.permute(2, 0, 1, 3).index_select(1, block_tables.reshape(-1))  # [Hkv, B·M, P, D]
    rows = rows.view(heads, batch, num_row_blocks * block_size, dim)
    return rows[:, :, :kv_length].transpose(0, 1)  # the slice never reads an unwritten slot


def grouped_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, S, D]
    value: torch.Tensor,  # [B, Hkv, S, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] bool (True = attend) or additive float; None = causal
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, T, Hq, Dv]
    """Attention with the ``G`` query heads of each KV head folded into the query axis (no ``repeat_kv``)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} KV heads evenly.")
    groups = q_heads // kv_heads
    # query head h = kv_head · G + g, so [B, Hq, T, D] -> [B, Hkv, G·T, D] is a plain reshape
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = _fold_mask(attention_mask, batch, groups, q_len, kv_len, query.device)
    if softcap is None:
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    else:
        scores = torch.einsum("bhqd,bhsd->bhqs", folded, key) * scaling
        scores = softcap * torch.tanh(scores / softcap)  # Gemma-2 logit soft-capping
        probs = _masked_softmax(scores, mask)
        out = torch.einsum("bhqs,bhsd->bhqd", probs, value)
    return out.reshape(batch, q_heads, q_len, -1).transpose(1, 2)


def reference_paged_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    key_pages: torch.Tensor,  # [N, P, Hkv, D]
    value_pages: torch.Tensor,  # [N, P, Hkv, Dv]
    block_tables: torch.Tensor,  # [B, M]
    kv_length: int,
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] bool or None (causal)
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, T, Hq, Dv]
    """Token-by-token gather, ``repeat_kv``, eager softmax: the plain oracle for the fast path."""
    block_size = key_pages.shape[1]
    positions = torch.arange(kv_length, device=block_tables.device)
    slots = block_tables[:, positions // block_size] * block_size + positions % block_size  # [B, S]
    key = key_pages.flatten(0, 1)[slots].transpose(1, 2)  # [B, Hkv, S, D]
    value = value_pages.flatten(0, 1)[slots].transpose(1, 2)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhqd,bhsd->bhqs", query, key) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = _fold_mask(attention_mask, query.shape[0], 1, query.shape[2], kv_length, query.device)
    probs = _masked_softmax(scores, mask)
    return torch.einsum("bhqs,bhsd->bhqd", probs, value).transpose(1, 2)


def _fold_mask(mask, batch: int, groups: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """``[B, 1, T, S]`` -> ``[B, 1, G·T, S]`` (row g·T + t is query t of group g); None -> bottom-right causal."""
    if mask is None:
        if q_len == 1:
            return None  # one query per row sees every key: no mask at all lets SDPA take its fastest path
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
        mask = mask.expand(batch, 1, q_len, kv_len)
    if mask.shape[1] != 1:
        raise ValueError(f"paged attention expects a mask shared by all heads, got shape {tuple(mask.shape)}.")
    if groups == 1:
        return mask
    return mask[:, :, None].expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # finfo.min rather than -inf: a fully masked row (a left-padding query) softmaxes to uniform, not NaN
    if mask is None:
        pass
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


# ---- the transformers-facing functions -------------------------------------------------------------
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # pages [N, P, Hkv, D] when paged_kv is given, else [B, Hkv, S, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    paged_kv: PagedKV | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``(out [B, T, Hq, Dv], None)``."""
    if dropout and module.training:
        raise ValueError("kvspec_paged attention is inference-only; use attn_implementation='sdpa' to train.")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvspec_paged attention does not support attention sinks (s_aux).")
    if paged_kv is not None:
        key = gather_blocks(key, paged_kv.block_tables, paged_kv.kv_length)
        value = gather_blocks(value, paged_kv.block_tables, paged_kv.kv_length)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return grouped_attention(query, key, value, attention_mask, scaling, softcap), None


def paged_attention_mask(**kwargs) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry: SDPA's boolean mask ``[B, 1, T, S]``.

    Like SDPA's, it may return None when nothing but causality is to be masked (no padding, and a single
    query or an empty cache); ``grouped_attention`` then applies the bottom-right causal mask itself.
    """
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


# name -> (attention fn, mask fn) that held it before our first register(); restored by unregister()
_previous: dict[str, tuple[object | None, object | None]] = {}


def register_paged_attention() -> None:
    """Register ``kvspec_paged`` with ``AttentionInterface`` and ``AttentionMaskInterface``. Idempotent."""
    from hf_kvspec.attention.patch import register_attention

    register_attention(ATTN_NAME, paged_attention_forward, paged_attention_mask, _previous)


def unregister_paged_attention() -> None:
    """Undo ``register_paged_attention``, restoring whatever held the name before. Safe to repeat."""
    from hf_kvspec.attention.patch import unregister_attention

    unregister_attention(ATTN_NAME, _previous)
