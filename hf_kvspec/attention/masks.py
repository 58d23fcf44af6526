"""The attention-mask rules of every hf_kvspec attention path, in one place.

Boundary: turns whatever mask transformers (or a caller with a custom 4D mask, e.g. a token tree) hands an
attention function into one explicit form, folds it onto KV heads, and owns the masked softmax. It knows
nothing about models or caches. ``kvspec_gqa`` (``gqa.py``), ``kvspec_paged`` (``paged.py``), ``kvspec_quant``
(``quantized.py``) and the MLA-absorb path (``mla.py``) all use these functions and
no private copy of them. Turning a bool mask into an additive one, and widening a mask over more keys, are
``hf_kvspec/masking.py``'s (shared with the cache views and the speculative paths).

What arrives as ``attention_mask``:
    * ``None``: transformers skipped the mask because causality alone (or nothing) is to be masked;
    * a bool mask ``[B, 1|Hq, T, S]``, True = attend (``sdpa_mask``; custom masks for sdpa);
    * a float mask ``[B, 1|Hq, T, S]``, added to the scores: 0 = attend, a very negative number (``finfo.min``,
      or ``-inf``) = masked (``eager_mask``, ``additive_sdpa_mask`` below, custom masks for eager);
    * an integer 0/1 mask (1 = attend), accepted and read as bool.
A custom 4D mask passes through transformers' mask builders unchanged, so a tree (each node sees the prefix and
its ancestors) with explicit position ids is just another mask here; rows and heads may all differ.

Rule 1, a missing mask (``implicit_causal`` / ``explicit_mask``). One query token sees every key. More than one
query token of a causal module: query ``t`` sees keys ``0..t``, keys ``T..S-1`` are never read. That is torch
SDPA's top-left ``is_causal`` and exactly what transformers' sdpa integration does (it crops the keys to ``T``).
transformers drops the mask only when that is right: ``T == S`` (top-left and bottom-right alignment agree), or
an empty ``StaticCache`` whose slots past ``T`` are unused (``masking_utils._ignore_causal_mask_sdpa``). With a
cache in front of the queries it always builds the mask, bottom-right aligned (query ``t`` at position
``S - T + t``), and that mask is then honoured as given. A bottom-right default would read those unused static
slots: ``tests/attention/test_custom_masks.py`` checks that a ``StaticCache`` prefill matches sdpa.

Rule 2, a query row that sees no key (``masked_softmax``). Output zero, whatever the path: a row is "fully
masked" when every entry is False (bool) or ``-inf`` (float). That is what torch SDPA (2.13, CPU; every kernel
transformers' sdpa integration reaches) returns for such a row, bool or ``-inf`` float. A float mask is otherwise
added as the numbers it holds: a row of ``finfo.min`` softmaxes to uniform weights (the mean of the values) in
SDPA and in eager alike, so it does here too. Eager differs only where it cannot be followed: an all ``-inf`` row
is NaN there (and a bool mask is added as 0/1), which would spread to later layers. Why this rule: a user who
passes a mask to ``attn_implementation="sdpa"`` gets exactly these outputs, and the zero row keeps a padding
query's output (and so its next-layer key, which a KIVI group may share with real tokens) finite and small.
``tests/attention/test_custom_masks.py`` checks the rule against transformers' sdpa and eager functions.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads, ``G = Hq / Hkv``,
``T`` query tokens, ``S`` key tokens.
"""

from __future__ import annotations

import torch

from hf_kvspec.masking import additive_mask


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
    """transformers' ``sdpa_mask`` (``None`` where ``is_causal`` suffices) with ``eager_mask``'s float values.

    The mask function ``kvspec_gqa`` registers with ``AttentionMaskInterface`` (same arguments as ``sdpa_mask``;
    transformers passes the model's ``dtype``). Why not the bool mask itself: transformers builds the mask once
    per forward and every layer reuses it, while SDPA on CPU turns a bool mask into an additive float one
    inside each call; converting here (``hf_kvspec.masking.additive_mask``) does it once per forward (measured
    in ``docs/attention.md``). The values are ``eager_mask``'s (``finfo.min``), so a fully masked padding query
    gets uniform weights, as in eager (rule 2 applied to a float mask).
    """
    from transformers.masking_utils import sdpa_mask

    keep = normalize_mask(sdpa_mask(*args, **kwargs))
    return None if keep is None else additive_mask(keep, dtype)


# ---- rule 1: a missing mask ---------------------------------------------------------------------------------------
def implicit_causal(mask: torch.Tensor | None, q_len: int, module_is_causal: bool, is_causal: bool | None) -> bool:
    """Whether a missing mask means "causal" (transformers' rule: more than one query token, causal module)."""
    causal = module_is_causal if is_causal is None else is_causal
    return mask is None and q_len > 1 and causal


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Top-left aligned causal bool mask ``[1, 1, T, S]`` (query t sees keys 0..t), SDPA's ``is_causal``."""
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None]


def explicit_mask(
    mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """The mask as a bool/float tensor (``None`` only when every key is visible), rule 1 made explicit."""
    mask = normalize_mask(mask)
    if mask is None and causal:
        return causal_mask(q_len, kv_len, device)
    return mask


# ---- folding onto KV heads ----------------------------------------------------------------------------------------
def fold_mask(mask: torch.Tensor | None, groups: int, num_kv_heads: int) -> torch.Tensor | None:
    """Mask for queries folded onto their KV head: ``[B|1, 1|Hq, T, S] -> [B|1, 1|Hkv, G·T, S]``.

    Folded query row ``g·T + t`` is query head ``kv·G + g`` at token ``t``. A head-shared mask is repeated
    ``G`` times along the rows (``G·T·S`` elements, small when T is small); a head-specific mask
    ``[B, Hq, T, S]`` needs no copy at all: head ``kv·G + g`` already sits at folded row block ``g`` of
    KV head ``kv``, so it is a plain reshape. Every mask shape transformers or a caller can pass folds.
    """
    if mask is None or groups == 1:
        return mask
    batch, heads, q_len, kv_len = mask.shape
    if heads == 1:
        return mask.unsqueeze(2).expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)
    if heads != groups * num_kv_heads:
        raise ValueError(f"attention mask has {heads} heads; it must have 1 (shared) or one per query head "
                         f"({groups * num_kv_heads}). Pass a [B, 1, T, S] or [B, Hq, T, S] mask.")
    return mask.reshape(batch, num_kv_heads, groups * q_len, kv_len)


# ---- rule 2: the masked softmax -----------------------------------------------------------------------------------
def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention weights from ``scores [..., T, S]`` and a mask broadcastable to them (rules 1-2).

    ``mask``: ``None`` (every key visible; make rule 1 explicit first with ``explicit_mask``), bool (True =
    attend) or float (added). A row with no visible key (all False / all ``-inf``) gets zero weights, as in
    torch SDPA. Computed in at least fp32 (fp64 stays fp64), as eager attention's softmax; upcasting before
    the mask is added also keeps ``finfo.min`` plus a negative score from overflowing to ``-inf`` in fp16.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if mask is None:
        return torch.softmax(scores, dim=-1)
    mask = normalize_mask(mask).to(scores.device)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(scores.dtype)
    sees_nothing = scores.amax(dim=-1, keepdim=True) == float("-inf")  # NaN rows stay NaN: not hidden
    return torch.softmax(scores, dim=-1).masked_fill(sees_nothing, 0.0)
