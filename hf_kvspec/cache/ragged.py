"""``RaggedPagedCache``: the serving engine's paged KV cache. Sequences of different lengths live side by side,
join and leave between forwards, and one forward writes a packed run of new tokens from any subset of them.

Boundary: storage and block bookkeeping only. It reuses ``PagedCache``'s parts unchanged — ``PagedLayer`` pages,
``BlockPool`` ref counts and prefix index, ``BlockTables`` copy-on-write and salted chained hashes — and adds
what a rectangular transformers batch never needed: one table row per *sequence id*, each with its own length.
Which sequences run, and how many tokens each, is the scheduler's decision (``hf_kvspec.serving``); attention
over the pages is ``hf_kvspec.serving.attention`` (``kvspec_ragged``), which reads the ``RaggedKV`` this cache
hands over through the one cache -> attention channel (``hf_kvspec/stored_kv.py``); it is paired with
``kvspec_ragged`` by construction (only the engine, which runs that attention, writes it).

A forward, from the caller's side:
    1. ``reserve(seq, new_length)`` per scheduled sequence: blocks for its new tokens (copy-on-write of a shared
       or cached block included); all or nothing, ``OutOfBlocksError`` before any change.
    2. ``begin_forward(rows)``: the packed layout (``RaggedRow`` per sequence: first position, token count,
       optional mask among its new tokens) -> the slots each new token is written to and the ``RaggedKV``.
    3. the model's forward: every layer's ``update`` scatters its K/V ``[1, Hkv, T, D]`` into those slots,
       hands the ``RaggedKV`` over and returns its raw pages.
    4. ``end_forward(ok)``: on success each row's stored length advances and its newly full blocks are hashed
       (``seal``); on failure every row is truncated back to its length before the forward, freeing what
       ``reserve`` took — a half-written block is never indexed.
``truncate(seq, length)`` rolls one sequence back (rejected speculative tokens); ``release(seq)`` frees it;
``fork(seq, new_seq, length)`` starts a sequence on another's stored prefix, sharing its blocks copy-on-write.
Token ids reach the hash chain through ``add_sequence`` (prompt) and ``record_tokens`` (generated ids), so a
preempted sequence that is re-added finds its own computed blocks while they are still cached.

Invariants (on top of ``BlockTables``' T1-T5 and the pool's I1-I3):
    R1  outside a forward, each sequence's table extent equals its stored length (``reserve`` may run ahead of
        it only until ``end_forward``);
    R2  pages are zero-initialised, so a padded gather past a row's length reads finite numbers (masked, but
        ``0 · NaN`` would still poison an attention output).

Shape legend: T packed new tokens of one forward · Hkv KV heads · D head dim · R rows (sequences) in the
forward · M blocks per row · N blocks · P block size.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers.cache_utils import Cache

from hf_kvspec import _compat, stored_kv
from hf_kvspec.memory import is_mla, kv_bytes_per_token, parse_bytes

from .block_pool import BlockPool
from .block_table import BlockTables
from .paged import blocks_for_budget
from .paged_layer import PagedLayer, check_layer_types

RAGGED_ATTN_NAME = "kvspec_ragged"


@dataclass(frozen=True)
class RaggedRow:
    """One sequence's share of a packed forward: tokens ``start .. start + num_tokens - 1`` are new."""

    seq_id: int
    start: int  # position of its first new token == tokens already stored
    num_tokens: int
    # [num_tokens, num_tokens] bool, True = new token i sees new token j (a draft tree); None: causal.
    # Every new token always sees the row's first ``start`` stored tokens.
    new_token_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class RaggedKV(stored_kv.StoredKV):
    """What the ragged cache hands to ``kvspec_ragged`` attention: the packed layout of one forward."""

    reader: ClassVar[str] = RAGGED_ATTN_NAME
    query_starts: tuple[int, ...]  # row r's new tokens are packed columns query_starts[r] + 0..T_r-1
    query_lengths: tuple[int, ...]  # T_r
    kv_lengths: tuple[int, ...]  # S_r = start_r + T_r: stored + new tokens of row r
    block_tables: tuple[torch.Tensor, ...]  # per row [M_r] int64 physical block ids
    new_token_masks: tuple[torch.Tensor | None, ...]  # per row [T_r, T_r] bool or None (causal)
    memo: dict = field(default_factory=dict, compare=False)  # per-forward derived tensors (attention's)
    reference: bool = False  # attend through the plain row-by-row reference (tests, debugging), not the fast path


class RaggedPagedCache(Cache):
    """Paged K/V for sequences of independent lengths, packed into one forward (see the module docstring).

    Args:
        config: the model config (its text config is used).
        num_blocks: physical blocks ``N``, or a byte budget (``int`` bytes via ``memory_budget``).
        block_size: tokens per block ``P``.
        enable_prefix_caching: index full blocks by salted chained hash and attach them to new sequences.
        dtype: dtype of the pages (the model's); K/V of another dtype is refused at the first write.
    """

    def __init__(self, config, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 dtype: torch.dtype = torch.float32):
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = _compat.layer_types_and_kwargs(text_config)
        check_layer_types(layer_types, "RaggedPagedCache")
        if is_mla(text_config):
            raise ValueError("RaggedPagedCache does not hold MLA (DeepSeek-V2/V3) latents yet: the model's attention "
                             "expands its cached latent itself. Serve MLA models with generate() and PagedCache.")
        layers = [PagedLayer(num_blocks, block_size, kw.get("sliding_window"), dtype) for kw in layer_kwargs]
        super().__init__(layers=layers)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.tables = BlockTables(self.pool, enable_prefix_caching)
        self._config = text_config
        self._row_of: dict[int, int] = {}  # seq_id -> row of self.tables
        self._stored: dict[int, int] = {}  # seq_id -> tokens whose K/V are stored (R1)
        self._forward: tuple[list[RaggedRow], torch.Tensor, RaggedKV] | None = None
        self._scratch = False  # the open forward is a draft forward (``begin_forward(scratch=True)``)

    @classmethod
    def blocks_for(cls, config, kv_budget: int | str, block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> int:
        """Blocks in ``kv_budget``: an ``int`` is a block count, a string a byte size (``"256MB"``). A budget
        whose pages could never fit ``device``'s whole memory is refused by name (rather than a bare
        ``MemoryError`` at the first forward)."""
        if isinstance(kv_budget, bool) or not isinstance(kv_budget, (int, str)):
            raise ValueError(f"kv_budget must be a block count (int) or a byte size like '256MB', got {kv_budget!r}.")
        if isinstance(kv_budget, int):
            if kv_budget < 1:
                raise ValueError(f"kv_budget={kv_budget} blocks: give at least 1.")
            blocks = kv_budget
        else:
            blocks = blocks_for_budget(config.get_text_config(decoder=True), block_size, parse_bytes(kv_budget), dtype)
        needed = blocks * block_size * kv_bytes_per_token(config.get_text_config(decoder=True), dtype)
        total = _total_memory_bytes(torch.device(device))
        if needed > total:
            raise ValueError(f"kv_budget={kv_budget!r} needs {needed:,} bytes of K/V pages; this machine's "
                             f"{torch.device(device).type} memory is {total:,} bytes in all. Lower kv_budget.")
        return blocks

    # ---- sequences -----------------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        return list(self._row_of)

    def length(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` whose K/V are stored."""
        return self._stored[seq_id]

    def add_sequence(self, seq_id: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Start sequence ``seq_id`` whose tokens will be ``token_ids``; attach its longest cached prefix.

        Returns how many leading tokens are already stored (a multiple of ``block_size``, at most
        ``len(token_ids) - 1``: the last token is always computed, its logits are needed).
        """
        if seq_id in self._row_of:
            raise ValueError(f"Sequence {seq_id} is already in the cache; release() it first.")
        self.tables.add_rows(1)
        row = self._row_of[seq_id] = self.tables.num_rows - 1
        self._stored[seq_id] = 0
        if not self.tables.enable_prefix_caching:
            return 0
        self.tables.set_tokens(row, token_ids, salt=salt)
        blocks, hashes = self.tables.match_prefix(row, max_tokens=len(token_ids) - 1)
        self.tables.attach(row, blocks, hashes)
        self._stored[seq_id] = len(blocks) * self.block_size
        return self._stored[seq_id]

    def fork(self, seq_id: int, new_seq_id: int, length: int) -> None:
        """Start ``new_seq_id`` holding ``seq_id``'s first ``length`` stored tokens by sharing their blocks
        (ref += 1 each, no copy). Either sequence's first write into a shared block copies that block
        (copy-on-write, ``reserve``), so each sees only its own later tokens. Used for ``n > 1`` choices of
        one prompt: the prompt is computed once."""
        if new_seq_id in self._row_of:
            raise ValueError(f"Sequence {new_seq_id} is already in the cache; release() it first.")
        if not 0 < length <= self._stored[seq_id]:
            raise ValueError(f"fork() of {length} tokens is outside sequence {seq_id}'s 1..{self._stored[seq_id]}.")
        row = self.tables.fork(self._row_of[seq_id])  # shares the whole extent (reservations included) ...
        self.tables.truncate(row, length)  # ... then keeps the first ``length`` tokens only (R1)
        self._row_of[new_seq_id] = row
        self._stored[new_seq_id] = length

    def record_tokens(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """All token ids of ``seq_id`` so far (prompt + generated); hashes its full stored blocks."""
        if self.tables.enable_prefix_caching:
            self.tables.extend_tokens(self._row_of[seq_id], token_ids)

    def release(self, seq_id: int) -> None:
        """Drop ``seq_id``; its blocks go back to the pool (hashed ones stay reusable as a prefix)."""
        row = self._row_of.pop(seq_id)
        del self._stored[seq_id]
        self.tables.select([r for r in range(self.tables.num_rows) if r != row])
        self._row_of = {s: (r if r < row else r - 1) for s, r in self._row_of.items()}

    def release_all(self) -> None:
        for seq_id in list(self._row_of):
            self.release(seq_id)

    # ---- growth and rollback -------------------------------------------------------------------------
    def blocks_to_grow(self, seq_id: int, new_length: int) -> int:
        """Fresh blocks ``reserve(seq_id, new_length)`` would take (copy-on-write included)."""
        return self.tables.blocks_needed(self._row_of[seq_id], new_length)  # R1: extent == stored

    def reserve(self, seq_id: int, new_length: int) -> None:
        """Make positions ``length(seq_id) .. new_length - 1`` writable; all or nothing (``OutOfBlocksError``)."""
        row, stored = self._row_of[seq_id], self._stored[seq_id]
        spans = [(self.tables.length(r), self.tables.length(r)) for r in range(self.tables.num_rows)]
        spans[row] = (stored, new_length)
        copies = self.tables.prepare_writes(spans)
        if copies:
            for layer in self.layers:
                if layer.is_initialized:
                    layer.copy_blocks(copies)

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll ``seq_id`` back to its first ``length`` stored tokens (e.g. rejected draft tokens)."""
        if not 0 <= length <= self._stored[seq_id]:
            raise ValueError(f"truncate() to {length} tokens is outside sequence {seq_id}'s 0..{self._stored[seq_id]}.")
        self.tables.truncate(self._row_of[seq_id], length)
        self._stored[seq_id] = length

    def keep_new_tokens(self, seq_id: int, start: int, kept: Sequence[int]) -> None:
        """Keep, of ``seq_id``'s stored tokens from ``start`` on, those at offsets ``kept`` (ascending; a draft
        tree's root and accepted path), moved to ``start, start + 1, ...``; drop the rest. Destinations are
        made writable first (copy-on-write of a shared block), then every layer moves the slots."""
        stored = self._stored[seq_id]
        if list(kept) != sorted(set(kept)) or (kept and not 0 <= start + kept[-1] < stored):
            raise ValueError(f"keep_new_tokens(): offsets {list(kept)} from {start} must ascend inside sequence "
                             f"{seq_id}'s {stored} tokens.")
        moves = [(start + i, start + j) for j, i in enumerate(kept) if i != j]
        if moves:
            row = self._row_of[seq_id]
            spans = [(self.tables.length(r), self.tables.length(r)) for r in range(self.tables.num_rows)]
            spans[row] = (moves[0][1], moves[-1][1] + 1)
            copies = self.tables.prepare_writes(spans)
            table = self.tables.table(row)
            src, dst = ([table[p // self.block_size] * self.block_size + p % self.block_size for p in side]
                        for side in zip(*moves))
            for layer in self.layers:
                if layer.is_initialized:
                    if copies:
                        layer.copy_blocks(copies)
                    layer.move(torch.tensor(src), torch.tensor(dst))
        self.truncate(seq_id, start + len(kept))

    # ---- the forward ---------------------------------------------------------------------------------
    def begin_forward(self, rows: Sequence[RaggedRow], device: torch.device, reference: bool = False,
                      scratch: bool = False) -> RaggedKV:
        """Fix the packed layout of the next forward; every row must be ``reserve``d for its new tokens.
        ``reference``: attention reads the layout through its plain reference path. ``scratch``: a draft forward
        whose rows may start past the stored tokens, inside their reservation (its K/V are overwritten by the
        verify forward); its ``end_forward`` commits nothing and keeps the reservations."""
        if self._forward is not None:
            raise RuntimeError("begin_forward() while a forward is open; call end_forward() first.")
        slots, tables, starts, column = [], [], [], 0
        for r in rows:
            row = self._row_of[r.seq_id]
            stored = self._stored[r.seq_id]
            misplaced = r.start < stored if scratch else r.start != stored
            if misplaced or r.start + r.num_tokens > self.tables.length(row):
                raise ValueError(f"Sequence {r.seq_id}: row starts at {r.start} for {r.num_tokens} tokens, but it "
                                 f"stores {self._stored[r.seq_id]} tokens and has room for {self.tables.length(row)};"
                                 " reserve() it first.")
            table = self.tables.table(row)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(r.start, r.start + r.num_tokens)]
            tables.append(torch.tensor(table, dtype=torch.long, device=device))
            starts.append(column)
            column += r.num_tokens
        view = RaggedKV(tuple(starts), tuple(r.num_tokens for r in rows),
                        tuple(r.start + r.num_tokens for r in rows), tuple(tables),
                        tuple(r.new_token_mask for r in rows), reference=reference)
        self._forward = (list(rows), torch.tensor(slots, dtype=torch.long, device=device), view)
        self._scratch = scratch
        return view

    def update(self, key_states, value_states, layer_idx: int, *args, kwargs: dict | None = None, **_):
        """Scatter the packed new K/V ``[1, Hkv, T, D]`` of layer ``layer_idx``; hand the layout to attention."""
        self._open_forward()
        if kwargs is None:
            raise ValueError(f"RaggedPagedCache needs attn_implementation={RAGGED_ATTN_NAME!r} (the serving engine "
                             "switches the model to it for each forward).")
        keys, values, view = self.write_layer(key_states, value_states, layer_idx)
        stored_kv.hand_over(kwargs, view, self._config, "RaggedPagedCache")  # always paired with kvspec_ragged
        return keys, values

    def _open_forward(self) -> tuple[list[RaggedRow], torch.Tensor, RaggedKV]:
        """The open forward's (rows, slots, layout), or the error naming ``begin_forward``."""
        if self._forward is None:
            raise RuntimeError("RaggedPagedCache is written by the serving engine: call begin_forward() first.")
        return self._forward

    def write_layer(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """``update`` without the hand-over to ``kvspec_ragged``: scatter the packed new K/V ``[1, Hkv, T, D]``
        and return ``(keys, values, layout)`` to a caller that attends itself (the fast forward's
        ``RaggedAttend``, which needs no switch of the model's attention)."""
        _, slots, view = self._open_forward()
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
            layer.keys.zero_()  # R2
            layer.values.zero_()
        layer.write(slots, key_states, value_states)
        return layer.keys, layer.values, view

    def end_forward(self, ok: bool) -> None:
        """Close the forward: commit every row's new tokens (``ok``); in any case give back the blocks reserved
        past each sequence's stored length, so a failed round leaves the cache as it was before ``reserve``."""
        rows = self._forward[0] if self._forward is not None else []
        self._forward = None
        scratch, self._scratch = self._scratch, False
        if scratch and ok:  # a draft forward: nothing to commit, the verify forward still needs the reservations
            return
        for r in rows if ok else []:
            if r.seq_id in self._row_of:
                self._stored[r.seq_id] = r.start + r.num_tokens
                self.tables.seal(self._row_of[r.seq_id], self._stored[r.seq_id])
        self.rollback_reservations()

    def rollback_reservations(self) -> None:
        """Give back blocks reserved past each sequence's stored length (R1)."""
        for seq_id, row in self._row_of.items():
            if self.tables.length(row) > self._stored[seq_id]:
                self.tables.truncate(row, self._stored[seq_id])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise TypeError("RaggedPagedCache rows have independent lengths; use length(seq_id). The engine passes "
                        "explicit position_ids, so the model never needs one length.")

    # ---- introspection -------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.pool.num_free()

    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def prefix_hit_rate(self) -> float:
        """Fraction of full-block prefix lookups (``add_sequence``) served from the cache."""
        queried = self.tables.prefix_queried_blocks
        return self.tables.prefix_hit_blocks / queried if queried else 0.0

    def utilization(self) -> float:
        """Token slots holding stored tokens / slots of the blocks in use (a shared block counted once)."""
        filled: dict[int, int] = {}
        for seq_id, row in self._row_of.items():
            length = self._stored[seq_id]
            for index, block in enumerate(self.tables.table(row)):
                filled[block] = max(filled.get(block, 0), min(self.block_size, length - index * self.block_size))
        return sum(filled.values()) / (len(filled) * self.block_size) if filled else 1.0


def _total_memory_bytes(device: torch.device) -> int:
    """All the memory of ``device`` (not what is free now: a budget above this can never fit)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
