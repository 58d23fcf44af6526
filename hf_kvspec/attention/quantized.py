"""Fused attention over a ``QuantizedKVCache``: scores and outputs straight from the stored codes, registered
with transformers as ``attn_implementation="kvspec_quant"`` (``AttentionInterface`` *and* ``AttentionMaskInterface``).

Boundary: this module owns the attention math over a quantized layer's stored form and its registration; it
imports no cache. The layer (``hf_kvspec.cache.quantized``) hands over a ``QuantizedKV`` (codes, sinks; see
``hf_kvspec.stored_kv``) when it was built for a model running ``kvspec_quant``, and dense keys/values otherwise.
With nothing handed over (any other cache, a prefill, an empty store) the function is ``kvspec_gqa``
(``hf_kvspec.attention.gqa``: SDPA that reads each grouped K/V head once, where transformers' sdpa copies it per
query head under a mask, e.g. in every speculative verify forward over a full-precision cache). Masks
(missing, bool, float, custom 4D, per head) follow ``hf_kvspec.attention.masks``, as transformers' sdpa does.

Two paths, compared in ``tests/attention/test_quantized_attention.py``:
    fused      ``fused_quantized_attention``: the store's ``key_scores`` / ``weighted_values`` unpack the raw
               codes once into a workspace shared by all layers and fold every scale and zero into the query
               rows or the attention weights (KIVI keys: ``q·k = Σ_d (q_d s_d) c_d + Σ_d q_d z_d``; values:
               ``Σ_t (p_t s_t) c_t + Σ_t p_t z_t``). The dequantized history is never materialised: per step it
               saves the two affine passes over ``S·D`` elements for K and for V, and, more on CPU, the two fresh
               ``S·D`` allocations per layer of the reference path (figures in ``docs/quantized.md``).
    reference  ``reference_quantized_attention``: the layer's dequantized keys/values (``dequantize_into``),
               ``repeat_kv``, eager softmax — dequantize-then-attend, the oracle.

The fused path runs for forwards of at most ``MAX_FUSED_QUERIES`` new tokens (decode, speculative verification,
chunked scoring): its scores ``[B, Hq, T, S]`` are materialised, which a long prefill should not do, so a longer
forward gets dense keys/values and SDPA's tiled kernels. Compute is fp32 whatever the model dtype (on CPU
fp16/bf16 matmuls are slower, and scores need the range); the output is cast back to the query dtype.

Shape legend: ``B`` batch · ``Hq`` query heads · ``Hkv`` kv heads · ``G = Hq / Hkv`` · ``T`` new tokens ·
``M = G·T`` query rows per kv head · ``S`` cached + new tokens · ``D`` head dim.
"""

from __future__ import annotations

import torch

from hf_kvspec import stored_kv
from hf_kvspec.attention.masks import explicit_mask, fold_mask, implicit_causal, masked_softmax
from hf_kvspec.stored_kv import QuantizedKV

ATTN_NAME = QuantizedKV.reader  # "kvspec_quant"


# ---- the two paths ---------------------------------------------------------------------------------
def fused_quantized_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    quantized_kv: QuantizedKV,
    window_keys: torch.Tensor,  # [B, Hkv, n_window, D]
    window_values: torch.Tensor,  # [B, Hkv, n_window, D]
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool (True = attend) or additive float; None: rule 1
    scaling: float,
    is_causal: bool = True,
) -> torch.Tensor:  # [B, T, Hq, D]
    """Attention over ``[sinks | store | window]`` that reads the store through its codes (masks: ``masks.py``)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = window_keys.shape[1]
    groups = q_heads // kv_heads
    kv, dtype = quantized_kv, torch.float32
    sinks, stored = kv.sink_keys.shape[2], kv.store.length
    # query head h = kv_head·G + g, so [B, Hq, T, D] -> [B, Hkv, M, D] is a plain reshape (row g·T + t)
    rows = query.reshape(batch, kv_heads, groups * q_len, dim).to(dtype) * scaling
    parts = [kv.store.key_scores(rows, kv.workspace),
             torch.matmul(rows, window_keys.to(dtype).transpose(-1, -2))]  # "bhmd,bhsd->bhms"
    if sinks:
        parts.insert(0, torch.matmul(rows, kv.sink_keys.to(dtype).transpose(-1, -2)))
    scores = torch.cat(parts, dim=-1)  # [B, Hkv, M, S] in token order
    mask = explicit_mask(attention_mask, q_len, scores.shape[-1], is_causal and q_len > 1, query.device)
    probs = masked_softmax(scores, fold_mask(mask, groups, kv_heads))  # [B, Hkv, M, S]
    out = kv.store.weighted_values(probs[..., sinks:sinks + stored], kv.workspace)  # [B, Hkv, M, D]
    out += torch.matmul(probs[..., sinks + stored:], window_values.to(dtype))  # "bhms,bhsd->bhmd"
    if sinks:
        out += torch.matmul(probs[..., :sinks], kv.sink_values.to(dtype))
    return out.reshape(batch, q_heads, q_len, -1).transpose(1, 2).to(query.dtype)


def reference_quantized_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    keys: torch.Tensor,  # [B, Hkv, S, D] dequantized (the layer's reference read)
    values: torch.Tensor,  # [B, Hkv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool or float; None: rule 1 of masks.py
    scaling: float,
) -> torch.Tensor:  # [B, T, Hq, D]
    """Dequantize-then-attend: ``repeat_kv`` and an eager fp32 softmax. Obviously correct; the oracle."""
    groups = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)
    values = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", query.float(), keys) * scaling
    q_len = query.shape[2]
    probs = masked_softmax(scores, explicit_mask(attention_mask, q_len, keys.shape[2], q_len > 1, query.device))
    return torch.einsum("bhts,bhsd->bhtd", probs, values).transpose(1, 2).to(query.dtype)


# ---- the transformers-facing function and its registration -----------------------------------------
def quantized_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # the window [B, Hkv, n, D] when a QuantizedKV is handed over, else all keys [B, Hkv, S, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B, 1|Hq, T, S] bool or float, or None (masks.py rule 1)
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``(out [B, T, Hq, D], None)``."""
    quantized_kv = stored_kv.take(kwargs, QuantizedKV)
    if quantized_kv is None:
        from hf_kvspec.attention.gqa import gqa_attention_forward

        return gqa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     is_causal=is_causal, **kwargs)
    if dropout and module.training:
        raise ValueError(f"{ATTN_NAME} attention is inference-only; use attn_implementation='sdpa' to train.")
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"{ATTN_NAME} attention does not support {unsupported}; use "
                                      "attn_implementation='sdpa' (QuantizedKVCache then attends its dequantized copy).")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = implicit_causal(attention_mask, query.shape[2], getattr(module, "is_causal", True), is_causal)
    return fused_quantized_attention(query, quantized_kv, key, value, attention_mask, scaling, causal), None


_previous: dict[str, tuple[object | None, object | None]] = {}  # entries under our name before register()


def register_quantized_attention() -> None:
    """Register ``kvspec_quant`` with ``AttentionInterface`` and SDPA's mask with ``AttentionMaskInterface``
    (without a mask entry transformers would hand the function ``attention_mask=None``). Idempotent."""
    from transformers.masking_utils import sdpa_mask

    from hf_kvspec.attention.patch import register_attention

    register_attention(ATTN_NAME, quantized_attention_forward, sdpa_mask, _previous)


def unregister_quantized_attention() -> None:
    """Undo ``register_quantized_attention``, restoring whatever held the name before. Safe to repeat."""
    from hf_kvspec.attention.patch import unregister_attention

    unregister_attention(ATTN_NAME, _previous)


def enable_quantized_attention(model):
    """Switch a loaded model to ``kvspec_quant`` attention; returns an ``AttentionPatch`` (``.remove()`` or
    ``with``) that switches back. A ``QuantizedKVCache`` built after this call hands its codes to it (one built
    before returns dense keys/values); with any other cache it behaves as SDPA."""
    from hf_kvspec.attention.patch import switch_attention

    register_quantized_attention()
    return switch_attention(model, ATTN_NAME)
