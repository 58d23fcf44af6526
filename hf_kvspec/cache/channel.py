"""The one side channel between hf_kvspec's caches and hf_kvspec's attention functions.

Boundary: this module owns the channel and nothing else — no tensors are built here. transformers passes one
``kwargs`` dict from an attention module to ``cache.update(..., kwargs=kwargs)`` and then on to the attention
function (a fresh dict per attention call, so nothing leaks between layers). A cache layer whose stored form an
attention function can read directly (pages behind block tables, quantized codes) puts one ``StoredKV`` object
into that dict under ``KWARG`` (``hand_over``); the attention function takes it from there (``take``, which
refuses a form it cannot read). Nobody else writes the key.

Who reads what is declared, not guessed: ``register_reader(attn_name, stored_type)`` is called when each of our
attention functions registers (``attention.patch.register_attention(..., reads=...)``: ``kvspec_paged`` reads
``PagedKV``, ``kvspec_quant`` reads ``QuantizedKV``), and ``reads_stored(config, stored_type)`` — the only place that looks at a model's attention
implementation — tells a cache whether to hand its stored form over or to return dense ``[B, Hkv, S, D]``
keys/values that any attention function reads (see the cache contract in ``hf_kvspec.cache``).
"""

from __future__ import annotations

from typing import ClassVar

from hf_kvspec import _compat

KWARG = "kvspec_stored_kv"  # the one key of the channel in the attention kwargs


class StoredKV:
    """Base of what a cache layer hands to an attention function: a description of its stored keys/values.

    Subclasses (frozen dataclasses): ``hf_kvspec.attention.paged.PagedKV`` (block tables over pages) and
    ``hf_kvspec.cache.quantized_attention.QuantizedKV`` (codes of a quantized store plus full-precision sinks).
    ``reader`` names the attention implementation of ours that reads the form (used in error messages).
    """

    __slots__ = ()
    reader: ClassVar[str] = "an attention implementation of hf_kvspec"


_readers: dict[str, type[StoredKV]] = {}  # attention implementation name -> the stored form it reads


def register_reader(attn_name: str, stored_type: type[StoredKV]) -> None:
    """Declare that attention implementation ``attn_name`` reads ``stored_type`` from the channel. Idempotent."""
    _readers[attn_name] = stored_type


def unregister_reader(attn_name: str) -> None:
    """Undo ``register_reader``; safe to repeat."""
    _readers.pop(attn_name, None)


def reads_stored(config, stored_type: type[StoredKV]) -> bool:
    """Whether the model with this (text) config attends through a function that reads ``stored_type``."""
    return config is not None and _readers.get(_compat.attn_implementation(config)) is stored_type


def hand_over(kwargs: dict, stored: StoredKV) -> None:
    """Put ``stored`` into the attention kwargs of the current layer's call."""
    kwargs[KWARG] = stored


def received(kwargs: dict) -> StoredKV | None:
    """What the cache handed over for this call, if anything (removed from ``kwargs``)."""
    return kwargs.pop(KWARG, None)


def take(kwargs: dict, stored_type: type[StoredKV], reader: str) -> StoredKV | None:
    """``received(kwargs)`` for attention function ``reader``, which reads ``stored_type`` only: another stored
    form is refused with ``TypeError`` naming the attention implementation that reads it."""
    stored = received(kwargs)
    if stored is not None and not isinstance(stored, stored_type):
        raise TypeError(f"{reader} reads {stored_type.__name__}, but the cache handed over {type(stored).__name__}; "
                        f"use the attention implementation that reads it ({stored.reader}).")
    return stored
