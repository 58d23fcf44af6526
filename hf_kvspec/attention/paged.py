"""Paged attention: attention that reads K/V through a block table, registered with transformers as
``attn_implementation="kvspec_paged"`` (``AttentionInterface`` *and* ``AttentionMaskInterface``).

Boundary: this module owns the attention math over paged K/V and its registration; it imports no cache. The
block tables come from ``hf_kvspec.cache.paged.PagedCache``, which hands a ``PagedKV`` over through the one
cache -> attention channel (``hf_kvspec.stored_kv``) when it was built for a model running ``kvspec_paged``.
Given contiguous K/V and nothing handed over (any other cache, or none), the function is plain grouped
attention. Masks (missing, bool, float, custom 4D, per head) follow ``masks.py``, as transformers'
sdpa does.

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

import torch
import torch.nn.functional as F

from hf_kvspec import stored_kv
from hf_kvspec.attention.masks import explicit_mask, fold_mask, implicit_causal, masked_softmax, normalize_mask
from hf_kvspec.stored_kv import PagedKV

ATTN_NAME = PagedKV.reader  # "kvspec_paged"


# ---- the two paths ---------------------------------------------------------------------------------
def gather_blocks(pages: torch.Tensor, block_tables: torch.Tensor, kv_length: int) -> torch.Tensor:
    """K (or V) ``[B, Hkv, S, D]`` from pages ``[N, P, Hkv, D]``, one whole-block ``index_select``.

    The gather runs over the head-major view ``[Hkv, N, P, D]``: with ``PagedCache``'s storage (head-major
    in memory) that view is contiguous, and the result's token axis is contiguous per head — SDPA reads it
    as fast as ``DynamicCache``'s contiguous K/V, whereas a token-major gather leaves rows ``Hkv·D`` apart,
    which SDPA reads measurably slower (figures in ``docs/paged.md``). Any page layout gives the same values.
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
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool (True = attend) or additive float; None: rule 1
    scaling: float,
    softcap: float | None = None,
    is_causal: bool = True,
) -> torch.Tensor:  # [B, T, Hq, Dv]
    """Attention with the ``G`` query heads of each KV head folded into the query axis (no ``repeat_kv``).

    Masks follow ``hf_kvspec.attention.masks`` (missing mask, fully masked rows), as transformers' sdpa does.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} KV heads evenly.")
    groups = q_heads // kv_heads
    # query head h = kv_head · G + g, so [B, Hq, T, D] -> [B, Hkv, G·T, D] is a plain reshape
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = explicit_mask(attention_mask, q_len, kv_len, is_causal and q_len > 1, query.device)
    mask = fold_mask(normalize_mask(mask, query.dtype), groups, kv_heads)  # [B, 1|Hkv, G·T, S]
    if softcap is None:
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    else:
        scores = torch.einsum("bhqd,bhsd->bhqs", folded, key) * scaling
        scores = softcap * torch.tanh(scores / softcap)  # Gemma-2 logit soft-capping
        probs = masked_softmax(scores, mask).to(value.dtype)
        out = torch.einsum("bhqs,bhsd->bhqd", probs, value)
    return out.reshape(batch, q_heads, q_len, -1).transpose(1, 2)


def reference_paged_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    key_pages: torch.Tensor,  # [N, P, Hkv, D]
    value_pages: torch.Tensor,  # [N, P, Hkv, Dv]
    block_tables: torch.Tensor,  # [B, M]
    kv_length: int,
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool or float; None: rule 1 of masks.py
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
    q_len = query.shape[2]
    mask = explicit_mask(attention_mask, q_len, kv_length, q_len > 1, query.device)  # broadcasts over Hq
    probs = masked_softmax(scores, mask).to(value.dtype)
    return torch.einsum("bhqs,bhsd->bhqd", probs, value).transpose(1, 2)


# ---- the transformers-facing functions -------------------------------------------------------------
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # pages [N, P, Hkv, D] when a PagedKV is handed over, else [B, Hkv, S, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool or float, or None (masks.py rule 1)
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``(out [B, T, Hq, Dv], None)``."""
    if dropout and module.training:
        raise ValueError("kvspec_paged attention is inference-only; use attn_implementation='sdpa' to train.")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvspec_paged attention does not support attention sinks (s_aux).")
    paged_kv = stored_kv.take(kwargs, PagedKV)
    if paged_kv is not None:
        key = gather_blocks(key, paged_kv.block_tables, paged_kv.kv_length)
        value = gather_blocks(value, paged_kv.block_tables, paged_kv.kv_length)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = implicit_causal(attention_mask, query.shape[2], getattr(module, "is_causal", True), is_causal)
    return grouped_attention(query, key, value, attention_mask, scaling, softcap, causal), None


def paged_attention_mask(**kwargs) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry: SDPA's boolean mask ``[B, 1, T, S]``.

    Like SDPA's, it may return None when nothing but causality is to be masked (no padding, and a single
    query or an empty cache); ``grouped_attention`` then applies rule 1 of ``masks.py`` itself.
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
