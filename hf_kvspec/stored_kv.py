"""What a cache hands an attention function: the stored forms (``PagedKV``, ``QuantizedKV``) and the one channel.

Boundary: types and the channel only — no tensors are built here, and neither ``hf_kvspec.cache`` nor
``hf_kvspec.attention`` is imported: both import this module, so caches and attention functions never import
each other for it. transformers passes one ``kwargs`` dict from an attention module to
``cache.update(..., kwargs=kwargs)`` and then on to the attention function (a fresh dict per attention call, so
nothing leaks between layers). A cache layer whose stored form an attention function of ours reads directly
(pages behind block tables, quantized codes) puts one ``StoredKV`` object into that dict under ``KWARG``
(``hand_over``); the attention function takes it from there (``take``, which refuses a form it cannot read).
Nobody else writes the key.

Pairing is decided once, when the cache is built: ``paired_reader(config, form)`` reads the model's attention
implementation from the config given to the cache's constructor; if that implementation is the form's ``reader``
(``kvspec_paged`` reads ``PagedKV``, ``kvspec_quant`` reads ``QuantizedKV``) the cache hands its stored form
over for its whole life, otherwise it returns dense ``[B, Hkv, S, D]`` keys/values that any attention reads.
Switching the model's attention afterwards does not change what ``update`` returns: a cache paired with a reader
refuses (``hand_over`` raises, naming the fix) a forward run by any other attention, which could not read its form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from hf_kvspec import _compat

KWARG = "kvspec_stored_kv"  # the one key of the channel in the attention kwargs
# a QuantizedKV is handed over for forwards of at most this many new tokens: the reader's scores of 64 queries over
# 4k tokens x 9 heads are 9 MB, and a long prefill goes to SDPA's tiled kernels over dense keys/values instead
MAX_FUSED_QUERIES = 64


class StoredKV:
    """Base of what a cache layer hands to an attention function: a description of its stored keys/values.

    ``reader`` is the attention implementation of ours that reads the form: a cache hands the form over only
    when the model ran that implementation at the cache's construction (``paired_reader``).
    """

    __slots__ = ()
    reader: ClassVar[str] = "an attention implementation of hf_kvspec"


@dataclass(frozen=True)
class PagedKV(StoredKV):
    """A paged cache layer's K/V pages ``[N, P, Hkv, D]`` (the attention function's ``key`` / ``value``) read
    through block tables. Read by ``hf_kvspec.attention.paged``."""

    reader: ClassVar[str] = "kvspec_paged"
    block_tables: torch.Tensor  # [B, M] int64 physical block ids, row b's token t in block [b, t // P]
    kv_length: int  # S: tokens per row, cached + new (the same for every row)


class CodeStore(Protocol):
    """What the fused quantized attention reads from a layer's quantized store (``cache.quantized_stores``)."""

    length: int  # S: stored tokens

    def key_scores(self, query: torch.Tensor, workspace: Any) -> torch.Tensor:
        """query [B, Hkv, M, D] -> ``q · k`` of every stored token [B, Hkv, M, S], from the codes."""

    def weighted_values(self, probs: torch.Tensor, workspace: Any) -> torch.Tensor:
        """weights [B, Hkv, M, S] -> ``Σ_s probs_s · v_s`` [B, Hkv, M, D], from the codes."""


@dataclass(frozen=True)
class QuantizedKV(StoredKV):
    """A quantized layer's codes plus its full-precision sinks; the window's keys and values are the attention
    function's ``key`` / ``value`` arguments. Token order: ``[sinks | store | window]``. Read by
    ``hf_kvspec.attention.quantized``, which materialises scores ``[B, Hq, T, S]``: a layer hands the form over
    for forwards of at most ``MAX_FUSED_QUERIES`` new tokens only (a long prefill gets dense keys/values)."""

    reader: ClassVar[str] = "kvspec_quant"
    store: CodeStore
    sink_keys: torch.Tensor  # [B, Hkv, n_sink, D]
    sink_values: torch.Tensor  # [B, Hkv, n_sink, D]
    workspace: Any  # the store's unpacking buffer, handed back to its reads


def paired_reader(config, form: type[StoredKV]) -> str | None:
    """At a cache's construction: ``form.reader`` when the model with this (text) config runs it — the cache
    then hands ``form`` over for its whole life — else None (the cache returns dense keys/values)."""
    if config is not None and _compat.attn_implementation(config) == form.reader:
        return form.reader
    return None


def hand_over(kwargs: dict, stored: StoredKV, config, cache_name: str) -> None:
    """Put ``stored`` into the attention kwargs of the current layer's call. The cache was paired with
    ``stored.reader`` when built; a model since switched to another attention could not read the form, so
    the call is refused (``ValueError``) rather than handing, say, raw pages to SDPA."""
    running = _compat.attn_implementation(config)
    if running != stored.reader:
        raise ValueError(f"This {cache_name} was built while the model ran {stored.reader!r} and hands that function "
                         f"its {type(stored).__name__}, but the model now runs {running!r}, which cannot read it. "
                         f"Build the cache after switching attention (a cache built under {running!r} returns "
                         "dense keys/values).")
    kwargs[KWARG] = stored


def received(kwargs: dict) -> StoredKV | None:
    """What the cache handed over for this call, if anything (removed from ``kwargs``)."""
    return kwargs.pop(KWARG, None)


def take(kwargs: dict, form: type[StoredKV]) -> StoredKV | None:
    """``received(kwargs)`` for the attention function ``form.reader``, which reads ``form`` only: another stored
    form is refused with ``TypeError`` naming the attention implementation that reads it."""
    stored = received(kwargs)
    if stored is not None and not isinstance(stored, form):
        raise TypeError(f"{form.reader} reads {form.__name__}, but the cache handed over {type(stored).__name__}; "
                        f"use the attention implementation that reads it ({stored.reader}).")
    return stored
