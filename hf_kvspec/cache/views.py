"""Cheap views of a target's own KV cache, for self-speculation at long context (the target drafts for itself).

Boundary: builds, once per speculative round, a small transformers ``Cache`` that a *draft* forward of the target
model reads instead of the target's cache, and the 4D mask that goes with it. It never writes the target's cache
and decides nothing about drafting (``speculative/drafters/sparse_kv.py``) or verification (the loop).

``StreamingView`` (StreamingLLM sinks + window, as MagicDec, Sadhukhan et al. 2408.11049, drafts): per layer

    keys [B, H, C + d, D] = [ sink columns (per row) | window columns (shared) | d draft tokens (scratch) ]

Column rule over the ``S`` committed columns of the target's cache (``sink_window_columns``):
    * the window is the last ``window`` *columns* ``[S - window, S)``, the same for every row. It counts columns,
      not real tokens: left padding and the holes a shorter accepted path left in earlier rounds (masked slots,
      see ``speculative/buffer.py``) take window columns and stay masked, so a row with holes sees a few fewer
      real tokens. This keeps the window one rectangular slice for the whole batch;
    * the sinks are each row's first ``sink_tokens`` *real* columns before the window (left padding skipped:
      attention sinks are the sequence's first tokens, Xiao et al. 2309.17453); a row with fewer real columns
      there gets masked sink slots;
    * when ``S <= window`` the window is the whole cache and there are no sinks: the view reads every committed
      column, so the draft computes what the target computes.
Keys keep the RoPE positions they were stored with (the cache holds rotated keys); the caller passes each draft
query's own position, so relative distances to the window are the true ones (MagicDec's choice, not
StreamingLLM's re-positioning).

Storage: the committed part is gathered from the target once per layer per round (``read_columns``: a slice of
``C = sinks + window`` columns, never the whole context; on ``PagedCache`` through its block tables with
``PagedCache.gather_positions``), and draft tokens are appended to the view's own scratch. Deviation from
"append to the target cache, crop before verifying": appending to a ``DynamicCache`` concatenates the layer's
whole history on every call, which at long context would read and write the full cache per draft token, the very
traffic the view exists to avoid. The target's cache is therefore untouched by drafting, so the cache after a
round equals a plain run's (nothing to crop); the view itself obeys the cache contract's append and roll-back
(C1, C3: ``crop(-k)`` drops scratch tokens) and is dropped at the end of the round.

Reference: ``sink_window_keep`` marks the same columns in the full ``[B, S]`` cache; attending to the full cache
with every other column masked is the plain computation the view must equal (``tests/cache/test_views.py``).

Shape legend: ``B`` rows, ``H`` kv heads, ``S`` committed columns, ``C`` view columns (sinks + window), ``d``
draft tokens in the scratch, ``T`` new tokens of a forward, ``D`` head dim.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticLayer

from hf_kvspec.cache.contract import gather_segment
from hf_kvspec.masking import additive_mask


# ---------------------------------------------------------------------------------------------------- columns
def sink_window_columns(committed_mask: torch.Tensor, sink_tokens: int, window: int) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """committed_mask [B, S] (1 = real token) -> (columns [B, C] int64, valid [B, C] bool): the view's committed
    columns in cache order (sinks, then the window) and which of them hold real tokens (module docstring)."""
    batch, length = committed_mask.shape
    real = committed_mask.bool()
    start = max(0, length - window)  # first window column
    window_cols = torch.arange(start, length, device=real.device).expand(batch, -1)
    sinks = min(sink_tokens, start)
    if sinks == 0:
        return window_cols.contiguous(), real[:, start:]
    if bool(real[:, :sinks].all()):  # no left padding: the first columns are the sinks (no per-round sort of S)
        sink_cols = torch.arange(sinks, device=real.device).expand(batch, -1)
    else:
        cols = torch.arange(start, device=real.device)
        order = torch.where(real[:, :start], cols, cols + start).argsort(dim=1, stable=True)  # real columns first
        sink_cols = order[:, :sinks]  # [B, sinks], ascending: real columns in order, then padding
    return torch.cat([sink_cols, window_cols], 1), torch.cat([real.gather(1, sink_cols), real[:, start:]], 1)


def sink_window_keep(committed_mask: torch.Tensor, sink_tokens: int, window: int) -> torch.Tensor:
    """[B, S] bool: the committed columns a view reads that hold real tokens (the reference's key mask)."""
    columns, valid = sink_window_columns(committed_mask, sink_tokens, window)
    keep = torch.zeros_like(committed_mask, dtype=torch.bool)
    return keep.scatter(1, columns, valid)


def read_columns(cache, layer_idx: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys, values [B, H, C, D] of layer ``layer_idx`` at committed ``columns`` [B, C]; reads, never writes.

    Caches that store pages or codes answer themselves (``gather_positions``); transformers' full-attention
    layers are read through their public ``keys`` / ``values`` tensors. Anything else is refused by name."""
    if callable(getattr(cache, "gather_positions", None)):
        return cache.gather_positions(layer_idx, columns)
    check_readable(cache, [layer_idx])
    layer = cache.layers[layer_idx]
    return gather_segment(layer.keys, columns), gather_segment(layer.values, columns)


def check_readable(cache, layers=None) -> None:
    """Refuse (``ValueError`` naming the caches that work) a cache whose ``layers`` (all by default) ``read_columns``
    cannot read; None (a ``DynamicCache`` to come) passes. Reads nothing, so it can run before the first forward."""
    if cache is None or callable(getattr(cache, "gather_positions", None)):
        return
    for layer_idx in range(len(cache.layers)) if layers is None else layers:
        layer = cache.layers[layer_idx]
        if type(layer) not in (DynamicLayer, StaticLayer):
            raise ValueError(f"a sparse KV view reads the target's keys/values by column; {type(cache).__name__} "
                             f"layer {layer_idx} is a {type(layer).__name__}, which does not hold every column in one "
                             "tensor. Use DynamicCache, StaticCache or hf_kvspec's PagedCache for the target.")


# ---------------------------------------------------------------------------------------------------- the view
class ViewLayer(CacheLayerMixin):
    """One layer of a view: the committed columns, gathered on the first update of the round, plus scratch."""

    is_croppable = True
    is_sliding = False
    is_compileable = False

    def __init__(self, cache, layer_idx: int, columns: torch.Tensor):
        super().__init__()
        self.source, self.layer_idx, self.columns = cache, layer_idx, columns
        self.committed = columns.shape[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = read_columns(self.source, self.layer_idx, self.columns)  # [B, H, C, D]
        self.keys, self.values = self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append draft K/V [B, H, T, D] to the scratch; return [B, H, C + d, D] (the view, drafts included)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[2] if self.is_initialized else self.committed

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` scratch tokens; the committed columns are never cropped."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove.")
        if self.is_initialized and tokens_to_remove:
            keep = max(self.committed, self.keys.shape[2] + tokens_to_remove)
            self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]


class StreamingView(Cache):
    """Sinks + window of ``target``'s committed columns, plus scratch for draft tokens (module docstring).

    ``committed_mask`` [B, S]: the 2D mask of the ``S`` columns every layer of ``target`` holds (the loop's
    buffer, ``buffer.mask[:, :-1]``). Feed draft forwards ``cache=view``, ``attention_mask=view.attention_mask(T,
    dtype)`` and explicit ``position_ids``."""

    def __init__(self, target, committed_mask: torch.Tensor, sink_tokens: int, window: int):
        lengths = {int(target.get_seq_length(i)) for i in range(len(target.layers))}
        if lengths != {committed_mask.shape[1]}:
            raise ValueError(f"the target cache's layers hold {sorted(lengths)} columns but the mask covers "
                             f"{committed_mask.shape[1]}: open a view between rounds, when every layer holds the "
                             "committed columns only.")
        self.columns, self.valid = sink_window_columns(committed_mask, sink_tokens, window)  # [B, C] each
        super().__init__(layers=[ViewLayer(target, i, self.columns) for i in range(len(target.layers))])

    @property
    def drafted(self) -> int:
        """Draft tokens in the scratch (those of the first layer; a draft forward feeds every layer)."""
        return self.layers[0].get_seq_length() - self.columns.shape[1]

    def visible(self, new_tokens: int) -> torch.Tensor:
        """Bool [B, 1, T, C + d + T] (True = attend) for a forward feeding ``T = new_tokens`` more draft tokens: the
        committed columns as ``valid`` says, the scratch causally (query t sees drafts 0..d + t)."""
        drafts = self.drafted + new_tokens
        queries = torch.arange(new_tokens, device=self.valid.device)[:, None] + self.drafted
        causal = torch.arange(drafts, device=self.valid.device)[None, :] <= queries  # [T, d + T]
        keep = torch.cat([self.valid[:, None, :].expand(-1, new_tokens, -1),
                          causal.expand(self.valid.shape[0], -1, -1)], dim=2)  # [B, T, C + d + T]
        return keep[:, None]

    def attention_mask(self, new_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """``visible(new_tokens)`` as the additive [B, 1, T, C + d + T] mask in ``dtype`` a draft forward is fed."""
        return additive_mask(self.visible(new_tokens), dtype)
