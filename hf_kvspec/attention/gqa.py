"""Grouped-query attention without ``repeat_kv``, as a transformers attention implementation.

Boundary: one attention function (``kvspec_gqa``) plus its registration with ``AttentionInterface`` and
``AttentionMaskInterface``, and ``enable_gqa(model)`` to switch a loaded model to it. It never sees a
cache or a model; masks arrive in transformers' conventions and follow the rules of ``masks.py`` (a missing
mask, custom 4D masks bool or float, per-head masks, fully masked rows) exactly as transformers' sdpa does:
both paths below are torch SDPA calls, given the same mask values, folded or not.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads, ``G = Hq / Hkv`` (GQA ratio),
``T`` query tokens, ``S`` key tokens, ``D`` head dim, ``Dv`` value head dim.

Why: eager, and transformers' SDPA path on CPU, copy K and V ``G`` times (``repeat_kv``) whenever a
mask is present with more than one query token (padded prefill, chunked prefill, speculative
verification with a tree mask): ``2·(G-1)·Hkv·S·D`` extra elements per layer and call.

Which path, per call (``_should_fold``; G > 1, measured on CPU in ``docs/attention.md``):

* **fold** the ``G`` query heads of a group onto their shared KV head, ``[B, Hq, T, D] -> [B, Hkv, G·T, D]``,
  and attend as plain multi-head attention, for a single query token (decode, with or without a
  padding mask) and for masked short queries (``T <= FOLD_MAX_QUERY_TOKENS``: verification, trees).
  Each K/V head is read once per group instead of once per query head, which beats transformers'
  ``enable_gqa`` call for an unpadded decode step with K/V out of cache, as in a real forward
  (figures in ``docs/attention.md``). Only the mask is repeated, ``G·T·S`` elements;
* **SDPA with** ``enable_gqa=True`` for everything else on CPU: no mask and ``T > 1`` (``is_causal``,
  exactly transformers' own call) and masked long queries (prefill chunks), where torch's CPU flash
  kernel indexes the shared head itself (no K/V copy) and is as fast as sdpa's ``repeat_kv`` + flash.
  On other devices a mask sends ``enable_gqa`` to the math kernel, so masked long queries fold there.

Masks are built by ``additive_sdpa_mask`` (float, once per forward) rather than ``sdpa_mask`` (bool,
which SDPA converts to float inside every layer's call); bool and integer masks still work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_kvspec.attention.masks import additive_sdpa_mask, fold_mask, implicit_causal, normalize_mask
from hf_kvspec.attention.patch import AttentionPatch, register_attention, switch_attention, unregister_attention

ATTN_NAME = "kvspec_gqa"
FOLD_MAX_QUERY_TOKENS = 64  # folded mask G·T·S floats stays below one repeat_kv copy at T <= 64

_saved_entries: dict[str, tuple] = {}  # what was registered under ATTN_NAME before register_gqa()


def gqa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, S, D]
    value: torch.Tensor,  # [B, Hkv, S, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool or additive float, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # out [B, T, Hq, Dv]
    """Attention function with transformers' ``AttentionInterface`` signature."""
    _reject_unsupported(kwargs)
    groups = _group_count(query, key)
    q_len = query.shape[2]
    mask = normalize_mask(attention_mask, query.dtype)
    causal = implicit_causal(mask, q_len, getattr(module, "is_causal", True), is_causal)
    if causal and key.shape[2] > q_len:
        # rule 1 of masks.py: keys past T are never read (transformers' sdpa crops them the same way)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if groups > 1 and _should_fold(q_len, mask, query.device):
        out = _folded_attention(query, key, value, mask, groups, dropout, scaling)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling,
            enable_gqa=groups > 1,
        )
    return out.transpose(1, 2).contiguous(), None


def _should_fold(q_len: int, mask: torch.Tensor | None, device: torch.device) -> bool:
    """The per-call rule of the module docstring (only asked when G > 1)."""
    if mask is None:  # T == 1: decode sees every key; T > 1: causal, left to SDPA's is_causal
        return q_len == 1
    return q_len <= FOLD_MAX_QUERY_TOKENS or device.type != "cpu"


def _folded_attention(query, key, value, mask, groups, dropout, scaling) -> torch.Tensor:
    """``[B, Hq, T, D]`` queries attended as ``[B, Hkv, G·T, D]``; returns ``[B, Hq, T, Dv]``.

    ``mask`` is explicit (``None`` only for a single query token that sees every key).
    """
    batch, q_heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, groups * q_len, query.shape[-1])
    out = F.scaled_dot_product_attention(
        folded, key, value, attn_mask=fold_mask(mask, groups, kv_heads), dropout_p=dropout, scale=scaling
    )  # [B, Hkv, G·T, Dv]
    return out.reshape(batch, q_heads, q_len, value.shape[-1])


def _group_count(query: torch.Tensor, key: torch.Tensor) -> int:
    q_heads, kv_heads = query.shape[1], key.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{ATTN_NAME}: {q_heads} query heads are not a multiple of {kv_heads} key/value heads.")
    return q_heads // kv_heads


def _reject_unsupported(kwargs: dict) -> None:
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{ATTN_NAME} does not support logit soft-capping (e.g. Gemma-2); use "
                         "attn_implementation='eager' for such models.")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{ATTN_NAME} does not support attention sinks (s_aux); use attn_implementation='eager'.")


def register_gqa() -> None:
    """Register ``kvspec_gqa`` with ``AttentionInterface`` and its mask with ``AttentionMaskInterface``.

    The mask entry matters: without it transformers builds no mask at all for an unknown implementation
    name and padding would be silently ignored. ``additive_sdpa_mask`` is ``sdpa_mask`` (``None`` when
    ``is_causal`` suffices) as a float mask built once per forward. Idempotent.
    """
    register_attention(ATTN_NAME, gqa_attention_forward, additive_sdpa_mask, _saved_entries)


def unregister_gqa() -> None:
    """Restore whatever was registered under ``kvspec_gqa`` before ``register_gqa()`` (usually nothing)."""
    unregister_attention(ATTN_NAME, _saved_entries)


def enable_gqa(model) -> AttentionPatch:
    """Switch a loaded transformers model to ``kvspec_gqa`` attention; ``.remove()`` switches back.

    Registers the implementation if needed. Works for models that dispatch through
    ``AttentionInterface`` (Llama, Qwen2, Mistral, SmolLM2 ... and DeepSeek's MLA, which has ``G = 1``).
    """
    register_gqa()
    return switch_attention(model, ATTN_NAME)
