"""``QuantizedKVCache``: a croppable, beam-safe KIVI / int8 / fp8 KV cache for transformers, in pure torch.

Boundary: a transformers ``Cache`` whose layers keep attention-sink tokens and a residual window in full
precision and flush older tokens into a ``QuantizedStore``. It obeys the cache contract (C1-C6) written in the
docstring of ``hf_kvspec.cache``; the rules below are how it does so. What a layer returns from ``update`` is
fixed when the cache is built (``paired_attention``): built for a model running ``kvspec_quant``
(``enable_quantized_attention(model)`` first), it returns its window and hands its codes over the one side
channel (``hf_kvspec.stored_kv``, a ``QuantizedKV``, read by ``hf_kvspec.attention.quantized``) for forwards of
up to ``MAX_FUSED_QUERIES`` tokens; otherwise (built under any other attention, or a long prefill) it returns
every token's keys/values, the store dequantized — the reference path, which any attention can read.

One layer holds, in token order::

    [ sinks (first n, full precision) | quantized store (flushed units) | residual window (newest, full precision) ]

Flush rule (identical to ``hf_kvspec.memory.quantized_token_split``, so ``nbytes()`` equals ``kv_cache_bytes``):
the window holds at most ``residual_length`` tokens; when an update makes it overflow, exactly the oldest whole
flush units (``group_size`` tokens for KIVI, single tokens for int8/fp8) are quantized and appended to the store.
Codes already in the store are never re-quantized. The prompt goes through the same rule, so its tail stays in
the window (unlike transformers' ``QuantizedCache``, which quantizes the whole prompt and re-quantizes the whole
history at every flush).

Read rule: every forward attends to exactly what the cache stores after its update — tokens flushed by this
very update are read back dequantized. With per-token methods (int8/fp8: a token's codes and scale depend on
that token alone, not on the rest of its update) and window 0, every token therefore has one fixed
representation from its first read on, whatever the number of tokens per forward: speculative verification
over K+1 tokens reads bit-for-bit what K+1 single steps read. With a window (any method) that cannot be
promised: a token is read exact until it leaves the window and quantized afterwards, so a verify forward that
flushes reads, for its earlier queries, tokens quantized that single steps still read exact (one tensor serves
all queries of a forward; KIVI flushes whole groups, int8/fp8 single tokens). Deviation from KIVI: its prefill attends the whole prompt at full precision; here
the prompt's flushed groups are read quantized already in the prefill forward (the newest
``residual_length`` tokens stay exact).

Crop rule (``crop(-k)``, used to roll back rejected speculative tokens):
    * tokens removed from the window only: exact, nothing else changes;
    * reaching into the store: flush units entirely past the new length are dropped; a unit cut in the middle
      is dropped too and its surviving tokens move back into the window as their dequantized values, so every
      kept token keeps its position. Those (at most ``group_size - 1``) tokens get quantized a second time when
      the window flushes them again — the only case in which a token is quantized twice. int8/fp8 units are
      single tokens, so crops there never dequantize anything.
    * after a crop the store may hold more tokens than the formula for the new length (nothing is un-quantized),
      so ``nbytes()`` can exceed ``kv_cache_bytes`` for that length; the window still never holds more than
      ``max(residual_length, group_size - 1)`` tokens.

Per-layer lengths (C2): each layer counts its own tokens; ``crop(-k)`` removes ``k`` from each layer's own
length and ``crop_layers(length, layers)`` cuts the given layers to ``length`` tokens, both by the crop rule.

Keep-positions rule (C4, after a tree verification):
    * int8 / fp8, at any position after the sinks: a token's codes and scale depend on that token alone, so kept
      tokens that land in the store take their codes (gathered; a window token is quantized then, getting the
      codes a flush would give it) and the rest stay in the window. With ``residual_length=0`` (the default) every
      token is read from codes it got from its own K/V, exactly as in plain decoding, so trees stay token-identical.
    * KIVI: positions move only among full-precision tokens — inside the window, or across sinks and window while
      nothing is flushed. A key's codes depend on its whole group of ``group_size`` tokens, so codes are never
      shuffled or re-quantized: if any position of the segment ``[start, length)`` is already in the store,
      ``keep_positions`` raises ``ValueError`` before changing any layer (C6). A tree must fit in the window
      *after* the update that wrote it (that update flushes whole groups when the window overflows, leaving it
      between ``residual_length - group_size + 1`` and ``residual_length`` tokens), so an ``n``-token segment is
      guaranteed to stay at full precision when ``residual_length >= n + group_size - 1`` (a multiple of
      ``group_size``). ``check_keep_capacity(n)`` refuses a too-small window up front.

Deviations from KIVI (arXiv:2402.02750): none in the quantization itself (per-channel keys, per-token values,
asymmetric, fp16 scale/zero, whole-group flushes); sink tokens follow KVQuant/StreamingLLM (arXiv:2401.18079,
2309.17453) and are an opt-in extra; the prefill read rule is described above.

Shape legend: ``B`` batch, ``H`` kv heads, ``T`` new tokens, ``S`` cached tokens, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_kvspec import stored_kv
from hf_kvspec.cache.contract import (
    Capabilities,
    check_config_arg,
    check_crop_arg,
    check_crop_length,
    check_keep_args,
    gather_segment,
    layer_ids,
)
from hf_kvspec.cache.quantized_stores import Fp8Store, Int8Store, KiviStore, QuantizedStore, Workspace
from hf_kvspec.memory import check_quant_params, head_dim, is_mla, quantized_token_split
from hf_kvspec.stored_kv import MAX_FUSED_QUERIES, QuantizedKV

METHODS = ("kivi", "int8", "fp8")
_DEFAULTS = {  # method -> (bits, group_size, residual_length)
    "kivi": (4, 64, 128),
    "int8": (8, None, 0),  # per-token scales need no look-ahead, so no window by default
    "fp8": (8, None, 0),
}


@dataclass(frozen=True)
class QuantSettings:
    """Validated settings shared by every layer of a ``QuantizedKVCache``."""

    method: str
    bits: int
    group_size: int | None  # KIVI group; None for int8/fp8 (their scales are per token)
    residual_length: int
    sink_tokens: int

    @classmethod
    def resolve(cls, method: str, bits: int | None, group_size: int | None, residual_length: int | None,
                sink_tokens: int) -> QuantSettings:
        if method not in METHODS:
            raise ValueError(f"method={method!r} is unknown; use one of {METHODS}.")
        for name, value in (("bits", bits), ("group_size", group_size), ("residual_length", residual_length),
                            ("sink_tokens", sink_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}={value!r} must be an int (or None for the method's default).")
        default_bits, default_group, default_residual = _DEFAULTS[method]
        bits = default_bits if bits is None else bits
        residual_length = default_residual if residual_length is None else residual_length
        if method == "kivi":
            group_size = default_group if group_size is None else group_size
            if bits not in (2, 4):
                raise ValueError(f"KIVI supports bits=2 or 4, got bits={bits}; use method='int8' for 8 bits.")
            check_quant_params(bits, group_size, residual_length)
        else:
            if bits != 8:
                raise ValueError(f"method={method!r} stores 8-bit codes; got bits={bits}.")
            if group_size is not None:
                raise ValueError(f"group_size applies to method='kivi' only ({method} scales are per token); "
                                 "leave it unset.")
            if not isinstance(residual_length, int) or residual_length < 0:
                raise ValueError(f"residual_length={residual_length} must be a non-negative integer.")
        if not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens={sink_tokens} must be a non-negative integer.")
        return cls(method, bits, group_size, residual_length, sink_tokens)

    def check_head_dim(self, config) -> None:
        """KIVI value groups run along the head dim: refuse at construction a group that does not divide it
        (it would fail at the first flush), naming the group sizes that would work."""
        if self.method != "kivi" or is_mla(config):  # MLA: the value width depends on the attention path
            return
        dim = head_dim(config)
        if dim % self.group_size == 0:
            return
        unit = 8 // self.bits  # codes per byte: a group must pack into whole bytes
        works = [g for g in range(unit, dim + 1, unit) if dim % g == 0]
        fits = [g for g in works if self.residual_length % g == 0]
        hint = (f"e.g. group_size={max(fits)} keeps residual_length={self.residual_length}" if fits
                else "with residual_length a multiple of it")
        raise ValueError(f"KIVI value groups run along head_dim={dim}, so group_size={self.group_size} must divide "
                         f"it. Group sizes that work with bits={self.bits}: {', '.join(map(str, works))} ({hint}); "
                         "or method='int8' / 'fp8', which have no groups.")

    @property
    def per_token(self) -> bool:
        """int8 / fp8: a token's codes and scale depend on that token alone, so positions move among codes too."""
        return self.method != "kivi"

    def keep_capacity(self) -> int | None:
        """The longest segment ``keep_positions`` is sure to accept right after the update that wrote it: None (no
        bound) for per-token codes; for KIVI what is sure to be still in the full-precision window."""
        if self.per_token:
            return None
        return self.residual_length - self.flush_unit + 1 if self.residual_length else 0

    def window_fix(self, segment: int) -> str:
        """Why KIVI keeps positions only in its window, and the settings that would keep a ``segment``-token tree
        there."""
        needed = -(-(segment + self.group_size - 1) // self.group_size) * self.group_size
        return (f"KIVI quantizes keys per channel over groups of group_size={self.group_size} tokens, so a token's "
                "codes depend on the rest of its group and cannot move to another position without re-quantizing "
                "the group: a tree must fit in the residual window after the update that wrote it (the update "
                f"flushes whole groups once the window overflows). Use residual_length={needed} (>= segment tokens + "
                f"group_size - 1 = {segment + self.group_size - 1}, a multiple of group_size), or method='int8' / "
                "'fp8', whose per-token codes keep positions at any residual_length.")

    @property
    def flush_unit(self) -> int:
        return self.group_size if self.method == "kivi" else 1

    def new_store(self) -> QuantizedStore:
        if self.method == "kivi":
            return KiviStore(self.bits, self.group_size)
        return Int8Store() if self.method == "int8" else Fp8Store()

    def memory_kwargs(self) -> dict:
        """Keyword arguments of ``hf_kvspec.memory.kv_cache_bytes`` describing this storage."""
        if self.method == "kivi":
            return {"bits": self.bits, "group_size": self.group_size, "residual_length": self.residual_length}
        return {"bits": 8, "residual_length": self.residual_length, "scale_layout": "token"}


def _take(x: torch.Tensor, start: int, end: int | None = None) -> torch.Tensor:
    """x [B, H, S, D] -> tokens ``start:end`` [B, H, end - start, D] (a view)."""
    return x[:, :, start:end]


class QuantizedKVLayer(CacheLayerMixin):
    """One layer: sinks + quantized store + residual window (``self.keys``/``self.values`` are the window)."""

    is_croppable = True
    is_sliding = False

    def __init__(self, settings: QuantSettings, config=None, workspace: Workspace | None = None):
        super().__init__()
        self.settings = settings
        self.config = config  # the model's (text) config
        # "kvspec_quant" when the model ran it at construction: the codes are handed to it (fixed for good)
        self.paired_attention = stored_kv.paired_reader(config, QuantizedKV)
        self.workspace = workspace or Workspace()
        self.store = settings.new_store()
        self.sink_keys = self.sink_values = None  # [B, H, <=n_sink, D]

    # ------------------------------------------------------------------------------------------------ growth
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = _take(key_states, 0, 0), _take(value_states, 0, 0)
        self.sink_keys, self.sink_values = self.keys, self.values
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_):
        """Append key/value states [B, H, T, D]. Return every cached token's keys/values [B, H, S + T, D], or,
        when the fused attention reads this forward, the window [B, H, n, D] with the codes put into ``kwargs``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_tokens = key_states.shape[2]
        key_states, value_states = self._fill_sinks(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        self._flush()
        # either way the forward reads exactly what is stored (see "Read rule")
        if self._fused_read(kwargs, new_tokens):
            stored_kv.hand_over(kwargs, QuantizedKV(self.store, self.sink_keys, self.sink_values, self.workspace),
                                self.config, "QuantizedKVCache")
            return self.keys, self.values
        return self._assemble()

    def _fused_read(self, kwargs: dict | None, new_tokens: int) -> bool:
        """Whether this forward's attention reads the codes (``kvspec_quant``; see the module docstring)."""
        return (self.paired_attention is not None and kwargs is not None and self.store.length > 0
                and new_tokens <= MAX_FUSED_QUERIES)

    def _fill_sinks(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the first tokens into the sinks until ``sink_tokens`` are held; return the rest."""
        room = self.settings.sink_tokens - self.sink_keys.shape[2]
        if room <= 0:
            return keys, values
        self.sink_keys = torch.cat([self.sink_keys, _take(keys, 0, room)], dim=2)
        self.sink_values = torch.cat([self.sink_values, _take(values, 0, room)], dim=2)
        return _take(keys, room), _take(values, room)

    def _assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[sinks | dequantized store | window] as (keys, values) [B, H, S, D] — the reference path: the whole
        store is dequantized at every step, straight into one preallocated tensor (no concatenation)."""
        sinks, stored = self.sink_keys.shape[2], self.store.length
        total = sinks + stored + self.keys.shape[2]
        keys = self.keys.new_empty(*self.keys.shape[:2], total, self.keys.shape[3])
        values = self.values.new_empty(*self.values.shape[:2], total, self.values.shape[3])
        for out, sink, window in ((keys, self.sink_keys, self.keys), (values, self.sink_values, self.values)):
            _take(out, 0, sinks).copy_(sink)
            _take(out, sinks + stored).copy_(window)
        if stored:
            self.store.dequantize_into(_take(keys, sinks, sinks + stored), _take(values, sinks, sinks + stored))
        return keys, values

    def _flush(self) -> None:
        """Quantize the oldest whole units of the window until it holds at most ``residual_length`` tokens."""
        tokens = self.store.length + self.keys.shape[2]
        quantized, _ = quantized_token_split(tokens, self.settings.flush_unit, self.settings.residual_length)
        count = quantized - self.store.length
        if count <= 0:
            return
        self.store.append(_take(self.keys, 0, count), _take(self.values, 0, count))
        self.keys, self.values = _take(self.keys, count), _take(self.values, count)

    # ------------------------------------------------------------------------------------------------ queries
    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_keys.shape[2] + self.store.length + self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes actually held: sinks and window at model precision plus the store's codes and scales."""
        if not self.is_initialized:
            return 0
        full = (self.sink_keys, self.sink_values, self.keys, self.values)
        return sum(t.numel() * t.element_size() for t in full) + self.store.nbytes()

    # ------------------------------------------------------------------------------------------------ edits
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (see the module docstring for the rule)."""
        check_crop_arg(tokens_to_remove)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.truncate(max(0, self.get_seq_length() + tokens_to_remove))

    def truncate(self, new_length: int) -> None:
        """Keep the first ``new_length`` tokens (``0 <= new_length <= get_seq_length()``), by the crop rule."""
        if not self.is_initialized or new_length == self.get_seq_length():
            return
        sinks = self.sink_keys.shape[2]
        kept_window = new_length - sinks - self.store.length
        if kept_window >= 0:
            self.keys, self.values = _take(self.keys, 0, kept_window), _take(self.values, 0, kept_window)
            return
        self.keys, self.values = _take(self.keys, 0, 0), _take(self.values, 0, 0)
        survivors = self.store.truncate(max(0, new_length - sinks), self.dtype)
        if survivors is not None:
            self.keys, self.values = survivors
        self.sink_keys, self.sink_values = _take(self.sink_keys, 0, new_length), _take(self.sink_values, 0, new_length)

    # C4: keep positions of the newest segment, among full-precision tokens only (see the module docstring)
    def check_keep(self, start: int, indices: torch.Tensor, where: str) -> None:
        """Raise ``ValueError`` (changing nothing) unless ``keep_positions(start, indices)`` is legal here."""
        length = self.get_seq_length()
        check_keep_args(start, indices, length, self.keys.shape[0] if self.is_initialized else None, where)
        sinks = self.sink_keys.shape[2] if self.is_initialized else 0
        end, s = sinks + self.store.length, self.settings
        if not (start < length and self.store.length and start < end):
            return  # the segment is at full precision
        if s.per_token and start >= sinks:
            return  # codes move like states (QuantizedStore.keep_positions)
        if s.per_token:
            raise ValueError(f"{where}: the segment [{start}, {length}) begins inside the {sinks} sink tokens while "
                             f"later tokens are already {s.method} codes; keep positions after the sinks (a tree "
                             "after the prompt), or use fewer sink_tokens.")
        raise ValueError(f"{where}: positions {max(start, sinks)}..{end - 1} of the segment [{start}, {length}) were "
                         f"already flushed into {s.method} codes (residual_length={s.residual_length}). "
                         f"{s.window_fix(length - start)}")

    def keep_positions(self, start: int, indices: torch.Tensor) -> None:
        """indices [B, k] into the segment ``[start, length)``: row b keeps ``start + indices[b, j]`` at ``start + j``.
        Call ``check_keep`` first: this assumes the segment is at full precision."""
        if not self.is_initialized or start >= self.get_seq_length():
            return
        sinks, stored = self.sink_keys.shape[2], self.store.length
        if stored and start < sinks + stored:  # per-token codes (check_keep refused the rest)
            self.keys, self.values = self.store.keep_positions(start - sinks, indices, self.keys, self.values)
            return
        base = sinks + stored if stored else 0  # position of the run's first token
        keys, values = self.keys, self.values  # [B, H, n_window, D]
        if not stored:  # nothing flushed: sinks and window are one full-precision run
            keys, values = torch.cat([self.sink_keys, keys], 2), torch.cat([self.sink_values, values], 2)
        local = start - base
        keys = torch.cat([keys[:, :, :local], gather_segment(keys[:, :, local:], indices)], 2)
        values = torch.cat([values[:, :, :local], gather_segment(values[:, :, local:], indices)], 2)
        if not stored:  # the first min(sinks, total) tokens stay sinks, as _fill_sinks would have put them
            sinks = min(sinks, keys.shape[2])
            self.sink_keys, self.sink_values = _take(keys, 0, sinks), _take(values, 0, sinks)
            keys, values = _take(keys, sinks), _take(values, sinks)
        self.keys, self.values = keys, values

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.store.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: codes and scales are re-indexed as they are, so reordering adds no quantization error."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = self.sink_values = None
        self.store = self.settings.new_store()
        self.is_initialized = False

    def offload(self):
        raise NotImplementedError("QuantizedKVCache does not support offloading; it already shrinks the cache.")


class QuantizedKVCache(Cache, Capabilities):
    """KIVI int2/int4 (default), int8 or fp8 KV cache; pass it as ``model.generate(..., cache=QuantizedKVCache(...))``.
    It obeys the cache contract C1-C6 (docstring of ``hf_kvspec.cache``) by the rules of this module's docstring.

    Args:
        config: the model's config (its text config is used); every layer must be full attention.
        bits: 2 or 4 for ``"kivi"`` (default 4); 8 for ``"int8"`` / ``"fp8"``.
        group_size: KIVI group length: tokens per key group, channels per value group (default 64; must
            divide the head dim, checked here). Not used by int8/fp8.
        residual_length: newest tokens kept at full precision (KIVI default 128, a multiple of
            ``group_size``; int8/fp8 default 0).
        method: ``"kivi"``, ``"int8"`` (symmetric per token and head) or ``"fp8"`` (e4m3, per token and head).
        sink_tokens: first tokens kept at full precision forever (attention sinks).

    ``paired_attention`` is ``"kvspec_quant"`` when the config's model ran that attention at construction (the
    layers then hand their codes to it), else None (they return dequantized keys/values); it never changes.
    """

    keeps_positions = True  # contract.Capabilities flags: C4 (KIVI: inside the window only), C3 per layer
    crops_layers = True
    has_keep_capacity = True  # check_keep_capacity(segment): the window must hold the segment

    def __init__(self, config, bits: int | None = None, group_size: int | None = None,
                 residual_length: int | None = None, method: str = "kivi", sink_tokens: int = 0):
        check_config_arg(config, "QuantizedKVCache")
        self.settings = QuantSettings.resolve(method, bits, group_size, residual_length, sink_tokens)
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
        unsupported = sorted(set(layer_types) - {"full_attention"})
        if unsupported:
            raise ValueError(f"QuantizedKVCache supports full-attention layers only; this model has {unsupported}. "
                             "Use DynamicCache for sliding-window or hybrid models.")
        self.settings.check_head_dim(text_config)
        self.config = text_config
        workspace = Workspace()  # one unpacking buffer for all layers (they attend one after another)
        layers = [QuantizedKVLayer(self.settings, text_config, workspace) for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.paired_attention = layers[0].paired_attention if layers else None

    def nbytes(self) -> int:
        """Bytes actually stored over all layers. For a cache grown by updates this equals
        ``kv_cache_bytes(config, S - n, B, dtype, **settings.memory_kwargs()) + kv_cache_bytes(config, n, B, dtype)``
        with ``n = min(S, sink_tokens)`` (the sinks are kept at full precision)."""
        return sum(layer.nbytes() for layer in self.layers)

    # ------------------------------------------------------------------------------------------------ contract
    def crop_layers(self, length: int, layers: Iterable[int] | None = None) -> None:
        """C3: keep the first ``length`` tokens of the given layers (all by default), by the crop rule."""
        chosen = layer_ids(len(self.layers), layers, "QuantizedKVCache.crop_layers")
        for i in chosen:
            check_crop_length(length, self.layers[i].get_seq_length(), i)
        for i in chosen:
            self.layers[i].truncate(int(length))

    def keep_positions(self, start: int, indices: torch.Tensor, layers: Iterable[int] | None = None) -> None:
        """C4: in every row b, move position ``start + indices[b, j]`` to ``start + j`` and drop the rest of the
        segment ``[start, length)``; indices [B, k]. KIVI: refused (nothing changed) if any chosen layer has flushed
        part of the segment into codes (it must fit in the residual window); int8/fp8 keep positions among codes
        too (module docstring)."""
        chosen = layer_ids(len(self.layers), layers, "QuantizedKVCache.keep_positions")
        for i in chosen:
            self.layers[i].check_keep(start, indices, f"QuantizedKVCache.keep_positions on layer {i}")
        for i in chosen:
            self.layers[i].keep_positions(int(start), indices)

    def check_keep_capacity(self, segment: int) -> None:
        """Refuse up front a tree of ``segment`` nodes that ``keep_positions`` could not be sure to accept (KIVI
        only: int8/fp8 keep positions among their per-token codes as well)."""
        capacity = self.settings.keep_capacity()
        if capacity is not None and capacity < segment:
            raise ValueError(f"QuantizedKVCache(method='kivi') keeps positions only inside its full-precision window, "
                             f"which is sure to hold {capacity} tokens after an update (residual_length="
                             f"{self.settings.residual_length}). {self.settings.window_fix(segment)}")

    def __repr__(self) -> str:
        s = self.settings
        return (f"QuantizedKVCache(method={s.method!r}, bits={s.bits}, group_size={s.group_size}, "
                f"residual_length={s.residual_length}, sink_tokens={s.sink_tokens}, layers={len(self.layers)})")
