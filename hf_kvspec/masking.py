"""Bool attention masks -> the additive float form a model is fed, and key padding: the one place that does either.

Boundary: two tensor conversions, nothing more. Every mask builder in hf_kvspec (``attention/masks.py``, the
streaming cache view, the EAGLE drafter and its training unroll, token trees, partial forwards) builds a bool mask
(True = attend) and hands it here to become additive or to be widened. It imports nothing from hf_kvspec, so
``cache/``, ``attention/``, ``heads/`` and ``speculative/`` can all use it without importing one another. The
attention-mask rules themselves (what a missing mask means, what a fully masked row yields) are in
``attention/masks.py``.

Additive form (eager's): 0 = attend, ``torch.finfo(dtype).min`` = masked, not ``-inf``: a fully masked row then
adds the same number to every score and softmaxes to uniform weights instead of NaN (rule 2 of
``attention/masks.py``).

Shapes: any ``[..., S]`` mask; ``S`` key columns.
"""

from __future__ import annotations

import torch


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``keep`` (True = attend) -> additive float mask of the same shape in ``dtype``: 0 where True,
    ``finfo(dtype).min`` where False."""
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def pad_keys(mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """``[..., S]`` -> ``[..., max(S, kv_length)]``, the added key columns masked (False for a bool mask,
    ``finfo.min`` for an additive one). A static cache attends over its whole length, so a mask built over the
    columns written so far is widened to cover its free slots."""
    extra = kv_length - mask.shape[-1]
    if extra <= 0:
        return mask
    masked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    return torch.nn.functional.pad(mask, (0, extra), value=masked)
