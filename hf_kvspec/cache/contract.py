"""The cache contract's operations as functions over *any* cache, so the speculative loop never branches on type.

Boundary: this module edits caches and answers what they can do; it decides nothing about which tokens to keep
(the loop does) and builds no attention inputs. The contract itself (C1-C6) is the docstring of
``hf_kvspec.cache``. What a cache can do is read from class flags, as transformers declares ``is_croppable``:
caches of ours (``QuantizedKVCache``, ``PagedCache``) subclass ``Capabilities`` and say which operations they
implement themselves (those are forwarded to); transformers' caches are edited here through their public
``layers[i].keys`` / ``.values`` tensors, layer by layer, and their private lengths are set by
``_compat.set_layer_length``, whose table (``_compat.editable_layer_types()``) is the one place that lists the
layer classes this module edits:

    DynamicLayer                 keys [B, H, S, D], length = keys.shape[2]; edits build new tensors
    DynamicSlidingWindowLayer    keys hold the newest tokens only (the last ``sliding_window - 1``, or all since
                                 the last crop while recording the past); length = ``cumulative_length`` (int)
    StaticLayer                  keys preallocated [B, H, max_cache_len, D], length = ``cumulative_length`` (a
                                 0-d tensor, kept in place: static addresses for torch.compile); stale slots past
                                 the length are left as they are, as ``StaticLayer.crop`` does
    StaticSlidingWindowLayer     as StaticLayer while it is croppable (``max_cache_len <= sliding_window``), plus
                                 its int mirror ``cumulative_length_int``

Anything else (transformers' ``QuantizedCache``, linear-attention or indexed layers) is refused by name.
Every edit checks every layer it touches before changing any (C6).

Shape legend: ``B`` batch, ``H`` kv heads, ``S`` cached tokens, ``D`` head dim, ``n`` tokens of the newest
segment, ``k`` positions kept per row.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import ClassVar

import torch
from transformers.cache_utils import BaseQuantizedLayer, DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from hf_kvspec import _compat


# ---------------------------------------------------------------------------------------------------- flags
class Capabilities:
    """Class flags of a cache of ours: the contract operations it implements itself (read by ``check_contract``
    and forwarded to by ``crop_layers`` / ``keep_positions`` below). Rolling back (``crop(-k)``) is transformers'
    own flag, ``is_croppable``."""

    keeps_positions: ClassVar[bool] = False  # C4: keep_positions(start, indices, layers=None)
    crops_layers: ClassVar[bool] = False  # C3 per layer: crop_layers(length, layers=None)
    # keep_positions accepts only segments that fit a bound: check_keep_capacity(segment) refuses longer ones
    has_keep_capacity: ClassVar[bool] = False


_FLAGS = {"keep_positions": "keeps_positions", "crop_layers": "crops_layers"}  # contract operation -> its flag


# ---------------------------------------------------------------------------------------------------- tensors
def gather_segment(states: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """states [B, H, n, D], indices [B, k] (into the n tokens) -> [B, H, k, D]: row b's tokens indices[b, :]."""
    batch, heads, _, dim = states.shape
    index = indices.to(states.device, torch.long)[:, None, :, None].expand(batch, heads, indices.shape[1], dim)
    return torch.gather(states, 2, index)


# ---------------------------------------------------------------------------------------------------- arguments
# One set of argument checks for every cache: PagedCache and QuantizedKVCache call these from their methods and
# the functions below call them for transformers' caches, so one mistake gets one wording (C6) whatever the cache.
def is_int(value) -> bool:
    """A Python, NumPy or 0-d tensor integer (not a bool, not a float)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_crop_arg(tokens_to_remove: int) -> None:
    """``crop(-k)`` removes ``k`` tokens; a positive argument is refused, as ``DynamicCache.crop`` does (C3)."""
    if tokens_to_remove > 0:
        raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove, e.g. crop(-3).")


def layer_ids(num_layers: int, layers: Iterable[int] | None, where: str) -> list[int]:
    """``layers`` (None: every layer) as a list of ints, refusing anything that is not a layer of the cache."""
    chosen = list(range(num_layers)) if layers is None else list(layers)
    bad = [i for i in chosen if not is_int(i) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{where}: layers {bad} do not exist; this cache has layers 0..{num_layers - 1}.")
    return [int(i) for i in chosen]


def check_crop_length(length: int, held: int, layer_idx: int) -> None:
    """``crop_layers(length)`` keeps ``length`` of the ``held`` tokens of layer ``layer_idx`` (C3)."""
    if not is_int(length) or not 0 <= length <= held:
        raise ValueError(f"crop_layers({length!r}): layer {layer_idx} holds {held} tokens; pass a length in 0..{held}.")


def check_keep_args(start: int, indices, length: int, batch: int | None, where: str) -> None:
    """Raise ``ValueError`` unless ``indices`` [B, k] selects from the segment ``[start, length)`` of a layer of
    ``batch`` rows (None: not known yet) (C4)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.dtype.is_floating_point \
            or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"{where}: indices must be an integer tensor [B, k] (e.g. torch.long) of positions in the "
                         f"newest segment, got {type(indices).__name__} {tuple(getattr(indices, 'shape', ()))}.")
    if not is_int(start) or not 0 <= start <= length:
        raise ValueError(f"{where}: start={start!r} is outside the layer's {length} tokens; pass the length the "
                         "cache had before the segment was appended.")
    if batch is not None and indices.shape[0] != batch:
        raise ValueError(f"{where}: indices has {indices.shape[0]} rows but the cache holds {batch}; pass one row "
                         "of indices per cache row.")
    segment = length - int(start)
    if indices.shape[1] > segment:
        raise ValueError(f"{where}: cannot keep {indices.shape[1]} positions of a {segment}-token segment; pad "
                         "shorter rows by repeating an index, not past the segment.")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= segment):
        raise ValueError(f"{where}: indices must lie in 0..{segment - 1} (the segment [{start}, {length})), got "
                         f"{int(indices.min())}..{int(indices.max())}.")


# ---------------------------------------------------------------------------------------------------- public API
def seq_lengths(cache) -> list[int]:
    """Tokens held by each layer (C2); ``get_seq_length(i)`` is per layer in every cache (a tensor in static ones)."""
    return [int(cache.get_seq_length(i)) for i in range(len(cache.layers))]


def crop_layers(cache, length: int, layers: Iterable[int] | None = None) -> None:
    """Keep the first ``length`` tokens of the given layers (all by default); the others are untouched (C3)."""
    if isinstance(cache, Capabilities):
        _require(cache, ["crop_layers"])
        cache.crop_layers(length, layers)
        return
    chosen = _chosen(cache, layers, "crop_layers")
    for i in chosen:
        _check_crop(cache.layers[i], i, length)
    length = int(length)
    for i in chosen:
        removed = _length(cache.layers[i]) - length
        if removed:
            cache.layers[i].crop(-removed)


def keep_positions(cache, start: int, indices: torch.Tensor, layers: Iterable[int] | None = None) -> None:
    """Move, in every row ``b``, position ``start + indices[b, j]`` to ``start + j`` and drop the rest of the
    newest segment (C4). indices [B, k] int64; each chosen layer then holds ``start + k`` tokens."""
    if isinstance(cache, Capabilities):
        _require(cache, ["keep_positions"])
        cache.keep_positions(start, indices, layers)
        return
    chosen = _chosen(cache, layers, "keep_positions")
    for i in chosen:
        _check_keep(cache.layers[i], i, start, indices, f"{type(cache).__name__}.keep_positions on layer {i}")
    start = int(start)
    for i in chosen:
        layer = cache.layers[i]
        if _length(layer) > start:  # an untouched (empty) segment needs no edit
            _keep_layer(layer, start, indices)


def check_contract(cache, *, keep_positions: bool = False, per_layer: bool = False,
                   segment: int | None = None) -> None:
    """Refuse, by name and with the fix, a cache that cannot do what the caller will ask: roll back (always),
    keep positions of a segment of up to ``segment`` tokens (trees), crop a range of layers (self-speculation).
    A cache that keeps positions only in a bounded window (flag ``has_keep_capacity``) is asked
    ``check_keep_capacity(segment)``. The one capability check of the package
    (``speculative.rollback.check_cache`` forwards to it)."""
    if cache is None:
        return
    name = type(cache).__name__
    if not getattr(cache, "is_croppable", False) or not callable(getattr(cache, "crop", None)):
        raise ValueError(_not_croppable(cache))
    if not (keep_positions or per_layer):
        return  # rolling back needs crop(-k) only, whatever the layers
    if isinstance(cache, Capabilities):
        _require(cache, [op for op, asked in (("keep_positions", keep_positions), ("crop_layers", per_layer)) if asked])
        if keep_positions and cache.has_keep_capacity:
            cache.check_keep_capacity(segment or 1)
        return
    for i, layer in enumerate(cache.layers):
        _check_layer_kind(layer, i, name, keep_positions)


def _require(cache: Capabilities, ops: list[str]) -> None:
    """Refuse a cache of ours whose flags say it lacks one of the contract operations ``ops``."""
    missing = [op for op in ops if not getattr(cache, _FLAGS[op])]
    if missing:
        raise ValueError(f"{type(cache).__name__} has no {' / '.join(missing)}(), which this decoding needs; use "
                         "DynamicCache or a cache of hf_kvspec that implements the cache contract (hf_kvspec.cache).")


# ---------------------------------------------------------------------------------------------------- layers
def _length(layer) -> int:
    return int(layer.get_seq_length()) if getattr(layer, "is_initialized", False) else 0


def _chosen(cache, layers: Iterable[int] | None, op: str) -> list[int]:
    chosen = layer_ids(len(cache.layers), layers, f"{type(cache).__name__}.{op}")
    for i, layer in ((i, cache.layers[i]) for i in chosen):
        _check_layer_kind(layer, i, type(cache).__name__, keep=False)
    return chosen


def _check_layer_kind(layer, i: int, cache_name: str, keep: bool) -> None:
    kind = type(layer)
    if kind not in _compat.editable_layer_types():
        raise ValueError(f"{cache_name} layer {i} is a {kind.__name__}, which hf_kvspec cannot crop per layer or "
                         "keep positions in; use DynamicCache (or StaticCache) for speculative decoding.")
    if kind is StaticSlidingWindowLayer and not layer.is_croppable:
        raise ValueError(f"{cache_name} layer {i} is a StaticSlidingWindowLayer longer than its window: evicted "
                         "states cannot be restored; use max_cache_len <= sliding_window or DynamicCache.")
    if keep and kind is DynamicSlidingWindowLayer and not layer.record_past:
        raise ValueError(f"{cache_name} layer {i} is a DynamicSlidingWindowLayer that keeps only its last "
                         f"{layer.sliding_window - 1} tokens, so keeping positions past its window would need "
                         "states it dropped; call cache.activate_past_recording() first "
                         "(hf_kvspec.speculative.rollback.prepare_for_rollback does).")


def _check_crop(layer, i: int, length: int) -> None:
    check_crop_length(length, _length(layer), i)
    _check_sliding_room(layer, i, length, length)


def _check_keep(layer, i: int, start: int, indices: torch.Tensor, where: str) -> None:
    batch = layer.keys.shape[0] if getattr(layer, "is_initialized", False) else None
    check_keep_args(start, indices, _length(layer), batch, where)
    _check_sliding_room(layer, i, start, start + indices.shape[1])


def _check_sliding_room(layer, i: int, start: int, new_length: int) -> None:
    """A dynamic sliding layer must still hold the segment from ``start`` and every token the window needs
    after the edit (positions ``new_length - sliding_window + 1`` on): evicted states cannot come back."""
    if type(layer) is not DynamicSlidingWindowLayer or _length(layer) == 0:
        return
    first_held = _length(layer) - layer.keys.shape[2]
    needed = max(0, new_length - layer.sliding_window + 1)
    if first_held > min(start, needed):
        raise ValueError(f"layer {i} (sliding window {layer.sliding_window}) no longer holds positions before "
                         f"{first_held}, which the edit needs; call cache.activate_past_recording() before the "
                         "forward that wrote the segment, and edit before the next crop.")


def _keep_layer(layer, start: int, indices: torch.Tensor) -> None:
    """Rewrite one transformers layer's keys/values to ``start + k`` tokens, then set its length (``_compat``)."""
    kept = start + indices.shape[1]
    if layer.is_compileable:  # static: keys [B, H, max_cache_len, D] written in place (static address)
        end = _length(layer)
        for states in (layer.keys, layer.values):  # the gather copies before the write
            states[:, :, start:kept].copy_(gather_segment(states[:, :, start:end], indices))
    else:  # dynamic: keys [B, H, S, D] -> [B, H, start + k, D]; new tensors (a caller may hold the old ones)
        local = start - (_length(layer) - layer.keys.shape[2])  # a sliding layer may have dropped old tokens
        for name in ("keys", "values"):
            states = getattr(layer, name)
            setattr(layer, name, torch.cat([states[:, :, :local], gather_segment(states[:, :, local:], indices)], 2))
    _compat.set_layer_length(layer, kept)


def _not_croppable(cache) -> str:
    name = type(cache).__name__
    if any(isinstance(layer, BaseQuantizedLayer) for layer in getattr(cache, "layers", ())):
        return (f"{name} holds transformers' quantized layers, which cannot crop (they re-quantize the whole "
                "history at every flush), so rejected draft tokens could not be removed; use hf_kvspec's "
                "QuantizedKVCache(model.config, ...), which crops and keeps positions in its full-precision window.")
    return (f"{name} cannot be cropped (is_croppable is False or crop() is missing): speculative decoding must "
            "remove rejected draft tokens from the cache with cache.crop(-k). Pass a croppable cache, e.g. "
            "cache=DynamicCache(config=model.config), hf_kvspec's PagedCache or QuantizedKVCache.")


def check_config_arg(config, cache: str) -> None:
    """Refuse ``None`` or a model where a cache constructor takes the model's config."""
    if config is None:
        raise TypeError(f"{cache} takes the model's config, e.g. {cache}(model.config); got None.")
    if isinstance(config, torch.nn.Module):
        raise TypeError(f"{cache} takes the model's config: pass model.config, not the model "
                        f"({type(config).__name__}).")
