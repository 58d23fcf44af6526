"""Attention-mask conventions shared by hf_kvspec's attention paths (GQA fold, MLA absorb).

Boundary: turns whatever mask transformers (or a caller with a custom 4D tree mask) hands an attention
function into one explicit form; it knows nothing about models or caches.

transformers passes one of
    * ``None``: no padding and a plain causal pattern that SDPA's ``is_causal`` can express
      (``masking_utils._ignore_causal_mask_sdpa`` only skips the mask when ``T == S``, or when the cache
      was empty and the extra keys are unused static-cache slots, i.e. top-left alignment is right);
    * a bool mask ``[B, 1|Hq, T, S]``, True = attend (``sdpa_mask``);
    * a float mask ``[B, 1|Hq, T, S]``, 0 = attend, a large negative number = masked (``eager_mask``,
      ``additive_sdpa_mask`` below, and the classic custom-4D-mask convention).

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads, ``G = Hq / Hkv``,
``T`` query tokens, ``S`` key tokens.
"""

from __future__ import annotations

import torch


def normalize_mask(mask: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Bool or float mask as SDPA accepts it; integer 0/1 masks become bool (1 = attend).

    With ``dtype`` (the query's), a float mask of another dtype is cast to it, as SDPA requires.
    """
    if mask is None or mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask if dtype is None or mask.dtype == dtype else mask.to(dtype)
    return mask.bool()


def additive_sdpa_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (``None`` where ``is_causal`` suffices) as an additive float mask in ``dtype``.

    The mask function ``kvspec_gqa`` registers with ``AttentionMaskInterface`` (same arguments as
    ``sdpa_mask``; transformers passes the model's ``dtype``). Why not the bool mask itself: transformers
    builds the mask once per forward and every layer reuses it, while SDPA on CPU turns a bool mask into
    an additive float one inside each call. Converting here does it once per forward instead of once per
    layer (measured, one call at 512 queries x 8k keys: ~13 of ~205 ms, plus a mask-sized transient per
    call). Same values as ``eager_mask``, but the ``None`` shortcut of ``sdpa_mask`` is kept.
    """
    from transformers.masking_utils import sdpa_mask

    return additive(sdpa_mask(*args, **kwargs), dtype)


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Top-left aligned causal bool mask ``[1, 1, T, S]`` (query i sees keys 0..i), SDPA's ``is_causal``."""
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None]


def implicit_causal(mask: torch.Tensor | None, q_len: int, module_is_causal: bool, is_causal: bool | None) -> bool:
    """Whether a missing mask means "causal" (transformers' rule: more than one query token, causal module)."""
    causal = module_is_causal if is_causal is None else is_causal
    return mask is None and q_len > 1 and causal


def explicit_mask(
    mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """The mask as a tensor (``None`` only when every key is visible), turning implicit causality explicit."""
    mask = normalize_mask(mask)
    if mask is None and causal:
        return causal_mask(q_len, kv_len, device)
    return mask


def fold_mask(mask: torch.Tensor | None, groups: int, num_kv_heads: int) -> torch.Tensor | None:
    """Mask for queries folded onto their KV head: ``[B, 1|Hq, T, S] -> [B, 1|Hkv, G·T, S]``.

    Folded query row ``g·T + t`` is query head ``kv·G + g`` at token ``t``; a head-shared mask is
    repeated G times along the rows (``G·T·S`` elements, small when T is small).
    """
    if mask is None or groups == 1:
        return mask
    batch, heads, q_len, kv_len = mask.shape
    if heads == 1:
        return mask.unsqueeze(2).expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)
    return mask.reshape(batch, num_kv_heads, groups * q_len, kv_len)


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Float mask (0 = attend, ``finfo.min`` = masked), the eager convention.

    ``finfo.min`` rather than ``-inf``: a fully masked row (a left-padding query) then softmaxes to a
    uniform, finite row as in eager attention, instead of NaN that would spread through later layers.
    """
    mask = normalize_mask(mask)
    if mask is None or mask.is_floating_point():
        return mask if mask is None else mask.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)
