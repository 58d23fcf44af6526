"""What the speculative loop needs from a cache: it must roll back rejected draft tokens.

Boundary: capability checks and preparation of a ``Cache`` (the caller's, or a draft model's own); the loop
calls ``cache.crop(-k)`` itself. mlx-lm's ``can_trim_prompt_cache`` plays the same role.
"""

from __future__ import annotations


def check_cache(cache) -> None:
    """Refuse a cache that cannot roll back rejected draft tokens."""
    if cache is None:
        return
    if not getattr(cache, "is_croppable", False) or not callable(getattr(cache, "crop", None)):
        raise ValueError(
            f"{type(cache).__name__} cannot be cropped (is_croppable is False or crop() is missing): speculative "
            "decoding must remove rejected draft tokens from the cache with cache.crop(-k). Pass a croppable "
            "cache, e.g. cache=DynamicCache(config=model.config), hf_kvspec's PagedCache or QuantizedKVCache.")


def prepare_for_rollback(cache) -> bool:
    """Ask sliding-window layers to keep the states a crop may need (transformers' own assisted decoding does
    the same); returns whether the cache has such layers."""
    sliding = any(getattr(cache, "is_sliding", None) or [])
    if sliding and callable(getattr(cache, "activate_past_recording", None)):
        cache.activate_past_recording()
    return sliding
