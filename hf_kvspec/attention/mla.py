"""DeepSeek-V2/V3 multi-head latent attention with the up-projections absorbed (arXiv 2405.04434, §2.1.2).

Boundary: ``enable_mla_absorb(model)`` replaces the ``forward`` of each MLA attention module of a loaded
transformers model from outside (the original bound method is kept and put back by ``.remove()``); the
modeling files, the decoder layers and the cache are untouched. What the module learned is read from
its own weights, RoPE helper and ``scaling`` (YaRN ``mscale`` included, as the model computes it).

Shape legend: ``B`` batch, ``H`` heads, ``T`` new tokens, ``S`` cached tokens (incl. the new ones),
``C`` latent rank d_c, ``R`` RoPE dim d_r, ``N`` no-RoPE query/key dim, ``V`` value head dim.

The cache is the one transformers already keeps for these models, one single-head "key" and "value"
per layer: ``c_kv [B, 1, S, C]`` (normalised latent) and ``k_rot [B, 1, S, R]`` (RoPE'd shared key),
so ``C + R`` elements per token and layer with any ``Cache`` (dynamic, paged, quantized). Stock
transformers re-expands every cached token through ``kv_b_proj`` at every step; here

    absorbed (decode):  q_lat = q_nope · W_UK                     "bhtn,hnc->bhtc"
                        score = q_lat · c_kvᵀ + q_rot · k_rotᵀ    "bhtc,bsc->bhts" + "bhtr,bsr->bhts"
                        o_lat = softmax(score·scale + mask) · c_kv "bhts,bsc->bhtc"
                        out   = o_lat · W_UVᵀ                     "bhtc,hvc->bthv", then o_proj
    decompressed:       k_nope = c_kv · W_UKᵀ, v = c_kv · W_UVᵀ for all S tokens, then SDPA (as stock)

RoPE cannot be absorbed (the rotation depends on the query-key distance), hence the separate R channel.
Each call picks the cheaper path from a multiply-add count (``MLADims.absorb_is_cheaper``): decode and
short verification chunks absorb; a long prefill on a short cache decompresses. Training mode and
``output_attentions`` fall back to the original forward.
"""

from __future__ import annotations

import functools

import torch

from hf_kvspec import stored_kv
from hf_kvspec.attention.gqa import gqa_attention_forward
from hf_kvspec.attention.masks import explicit_mask, implicit_causal, masked_softmax
from hf_kvspec.attention.mla_weights import (
    STRATEGIES,
    SUPPORTED_ATTENTION,
    MLALayerPlan,
    Strategy,
    UnsupportedMLAError,
    plan_layer,
    supported_style,
)
from hf_kvspec.attention.patch import AttentionPatch

__all__ = ["UnsupportedMLAError", "absorbed_forward", "enable_mla_absorb"]

_UNSET = object()  # "argument not passed", so a fallback call forwards exactly what the caller gave


def absorbed_forward(
    module: torch.nn.Module,
    plan: MLALayerPlan,
    original_forward,
    hidden_states: torch.Tensor,  # [B, T, hidden]
    *args,
    attention_mask: torch.Tensor | None = _UNSET,  # [B, 1|H, T, S] or None
    cache=_UNSET,
    position_embeddings=_UNSET,  # (cos, sin) [B, T, R] each, or complex freqs_cis [B, T, R/2] (V2)
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [B, T, hidden]
    """Drop-in ``forward`` for a DeepSeek MLA module (bound with ``functools.partial``)."""
    named = dict(attention_mask=attention_mask, cache=cache, position_embeddings=position_embeddings)
    if args or module.training or kwargs.get("output_attentions"):
        # positional calls, training and attention maps keep the exact original semantics
        passed = {key: value for key, value in named.items() if value is not _UNSET}
        return original_forward(hidden_states, *args, **passed, **kwargs)
    attention_mask, cache, position_embeddings = (None if v is _UNSET else v for v in named.values())
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    plan.refresh(module)
    q_nope, q_rot, c_kv, k_rot = _project(module, plan, hidden_states, position_embeddings)
    if cache is not None:
        # the latent is what gets cached: C + R elements per token, whatever the cache class
        c_kv, k_rot = cache.update(c_kv, k_rot, module.layer_idx, kwargs=kwargs)
        _refuse_stored_form(kwargs)
    q_len, kv_len = hidden_states.shape[1], c_kv.shape[2]
    if plan.use_absorbed(q_len, kv_len):
        out = _absorbed_attention(module, plan, q_nope, q_rot, c_kv, k_rot, attention_mask)
    else:
        out = _decompressed_attention(module, plan, q_nope, q_rot, c_kv, k_rot, attention_mask)
    return module.o_proj(out.flatten(2)), None


def _refuse_stored_form(kwargs: dict) -> None:
    """The absorbed path reads dense latents; a cache that handed over its stored form (pages, codes) did so
    because it was built for the model's attention implementation, which this forward replaces."""
    stored = stored_kv.received(kwargs)
    if stored is not None:
        raise ValueError(f"enable_mla_absorb reads the latent cache as dense tensors, but the cache handed over "
                         f"{type(stored).__name__} for the model's attention implementation; load the model with "
                         "attn_implementation='sdpa' (or 'eager') to absorb MLA over this cache.")


def _project(module, plan: MLALayerPlan, hidden_states, position_embeddings):
    """Queries ``[B, H, T, N]``, ``[B, H, T, R]`` and new latents ``[B, 1, T, C]``, ``[B, 1, T, R]``."""
    batch, q_len, _ = hidden_states.shape
    dims = plan.dims
    if module.q_lora_rank is None:
        query = module.q_proj(hidden_states)
    else:
        query = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    query = query.view(batch, q_len, dims.heads, dims.nope + dims.rope).transpose(1, 2)
    q_nope, q_rot = query.split([dims.nope, dims.rope], dim=-1)
    c_kv, k_rot = module.kv_a_proj_with_mqa(hidden_states).split([dims.latent, dims.rope], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv).view(batch, 1, q_len, dims.latent)
    k_rot = k_rot.view(batch, 1, q_len, dims.rope)
    q_rot, k_rot = plan.rope(q_rot, k_rot, position_embeddings)
    return q_nope, q_rot, c_kv, k_rot


def _absorbed_attention(module, plan: MLALayerPlan, q_nope, q_rot, c_kv, k_rot, mask) -> torch.Tensor:
    """Attention in latent space (MQA over ``[c_kv ; k_rot]``, value ``c_kv``); returns ``[B, T, H, V]``."""
    q_len = q_nope.shape[2]
    causal = implicit_causal(mask, q_len, getattr(module, "is_causal", True), None)
    if causal and c_kv.shape[2] > q_len:  # rule 1 of masks.py: keys past T are never read (as sdpa crops them)
        c_kv, k_rot = c_kv[:, :, :q_len], k_rot[:, :, :q_len]
    latent, rope_key = c_kv[:, 0], k_rot[:, 0]  # [B, S, C], [B, S, R]
    q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, plan.w_uk)
    scores = torch.einsum("bhtc,bsc->bhts", q_lat, latent) + torch.einsum("bhtr,bsr->bhts", q_rot, rope_key)
    scores = scores * module.scaling  # [B, H, T, S]
    mask = explicit_mask(mask, q_len, latent.shape[1], causal, scores.device)  # [B, 1|H, T, S] or None
    probs = masked_softmax(scores, mask).to(latent.dtype)  # fully masked rows: zero (rule 2 of masks.py)
    out_latent = torch.einsum("bhts,bsc->bhtc", probs, latent)
    return torch.einsum("bhtc,hvc->bthv", out_latent, plan.w_uv)


def _decompressed_attention(module, plan: MLALayerPlan, q_nope, q_rot, c_kv, k_rot, mask) -> torch.Tensor:
    """Expand every cached latent to per-head keys/values, then SDPA; returns ``[B, T, H, V]``."""
    latent = c_kv[:, 0]  # [B, S, C]
    k_nope = torch.einsum("bsc,hnc->bhsn", latent, plan.w_uk)
    values = torch.einsum("bsc,hvc->bhsv", latent, plan.w_uv)
    keys = torch.cat([k_nope, k_rot.expand(-1, plan.dims.heads, -1, -1)], dim=-1)  # [B, H, S, N+R]
    query = torch.cat([q_nope, q_rot], dim=-1)  # [B, H, T, N+R]
    out, _ = gqa_attention_forward(module, query, keys, values, mask, scaling=module.scaling)
    return out


def _mla_modules(model) -> list[torch.nn.Module]:
    """Every supported MLA module; an MLA module of another kind (has ``kv_b_proj``) is an error, not a skip."""
    found = [m for m in model.modules() if supported_style(m) is not None]
    others = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "kv_b_proj") and m not in found})
    if not found or others:
        raise UnsupportedMLAError(
            f"enable_mla_absorb supports the attention classes {sorted(SUPPORTED_ATTENTION)} (and subclasses "
            f"that keep their forward); {type(model).__name__} has {others or 'none of them'}.")
    return found


def _patched(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is absorbed_forward


def enable_mla_absorb(model, strategy: Strategy = "auto") -> AttentionPatch:
    """Absorb ``W_UK``/``W_UV`` in every DeepSeek-V2/V3-style attention module of ``model``.

    Args:
        model: a loaded transformers model whose attention classes are in ``SUPPORTED_ATTENTION``.
        strategy: ``"auto"`` picks absorbed or decompressed attention per call by multiply-add count;
            ``"absorb"`` / ``"decompress"`` force one path (for tests and measurements).

    Returns:
        An ``AttentionPatch``; ``.remove()`` (or leaving its ``with`` block) restores every original forward.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; use one of {STRATEGIES}.")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_mla_absorb expects a loaded transformers model (a PreTrainedModel), got "
                        f"{type(model).__name__}; pass the model itself, not its config or a path.")
    modules = _mla_modules(model)
    if any(_patched(m) for m in modules):
        raise ValueError("MLA absorption is already enabled on this model; call .remove() on its handle first.")
    saved = [(m, m.__dict__.get("forward")) for m in modules]
    plans = [plan_layer(m, strategy) for m in modules]  # weights are split here, once
    for module, plan in zip(modules, plans):
        module.forward = functools.partial(absorbed_forward, module, plan, module.forward)
    return AttentionPatch("mla_absorb", functools.partial(_restore, saved),
                          f"{len(modules)} layers, strategy={strategy!r}")


def _restore(saved: list[tuple[torch.nn.Module, object]]) -> None:
    for module, previous in saved:
        if previous is None:
            del module.forward  # back to the class's forward
        else:
            module.forward = previous
