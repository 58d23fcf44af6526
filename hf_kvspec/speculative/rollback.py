"""What the speculative loop needs from a cache: it must roll back rejected draft tokens.

Boundary: capability checks and preparation of a ``Cache`` (the caller's, or a draft model's own); the loop
calls ``cache.crop(-k)`` itself. The check is the cache contract's (``hf_kvspec.cache.contract.check_contract``,
contract C1-C6 in ``hf_kvspec.cache``); this module only names it for the loop. mlx-lm's
``can_trim_prompt_cache`` plays the same role.
"""

from __future__ import annotations

from hf_kvspec.cache.contract import check_contract


def check_cache(cache, *, keep_positions: bool = False, per_layer: bool = False, segment: int | None = None) -> None:
    """Refuse a cache that cannot roll back rejected draft tokens (``crop(-k)``); with ``keep_positions`` also one
    that cannot keep a tree's accepted path of up to ``segment`` nodes, with ``per_layer`` one that cannot crop a
    range of layers (self-speculation). ``None`` (the loop makes its own cache) passes."""
    check_contract(cache, keep_positions=keep_positions, per_layer=per_layer, segment=segment)


def prepare_for_rollback(cache) -> bool:
    """Ask sliding-window layers to keep the states a crop may need (transformers' own assisted decoding does
    the same); returns whether the cache has such layers."""
    sliding = any(getattr(cache, "is_sliding", None) or [])
    if sliding and callable(getattr(cache, "activate_past_recording", None)):
        cache.activate_past_recording()
    return sliding
