"""``PagedCache``: a paged KV cache (vLLM, Kwon et al. SOSP'23, arXiv 2309.06180) that is a real
transformers ``Cache`` of ``CacheLayerMixin`` layers, so ``model.generate(ids, cache=PagedCache(...))``
works — greedy, sampling, beam search, assisted / speculative decoding. It implements the cache contract
C1-C6 written in the docstring of ``hf_kvspec.cache``.

Boundary: this class drives the layers (``paged_layer.py``: one page tensor pair and one length per layer);
*which* block holds which token is decided by ``BlockTables`` / ``BlockPool`` (plain Python). Attention over
the pages is ``attention/paged.py``; the one cache -> attention channel is ``hf_kvspec.stored_kv``.

Per-layer lengths (C2): one block table per row, shared by all layers and sized to the longest layer
(the table's *extent*); each layer keeps its own length and writes at it. One table rather than one per
layer (group): a normal forward writes every layer at the same positions, so it costs one allocation and
one index computation per forward, and self-speculation's ragged phase (layers ``0..E-1`` a few draft
tokens ahead) only leaves some slots of the last blocks unwritten in the shorter layers for a while.
A layer writing ``T`` tokens at its length ``s``:
    1. ``BlockTables.prepare_writes`` makes positions ``s..s+T-1`` of every row writable: new tail blocks
       past the extent, and copy-on-write of *every* shared or cached block the span touches, also below
       the extent (a layer cropped back into a shared prefix block, a fork taken while layers differed);
       a copy duplicates the block on every layer's pages. Slots and the block-table tensor (``_Plan``) are
       cached by ``(s, T, device)`` and the tables' version: a normal forward computes them once.
    2. the layer scatters its K/V into its pages at those slots;
    3. if the cache was built for a model running the attention that reads pages (``kvspec_paged``: the
       pairing is fixed at construction, ``paired_attention``), the layer hands a ``PagedKV`` (block tables,
       this layer's length) over the channel and returns its raw pages; otherwise it returns gathered
       contiguous K/V ``[B, Hkv, S, D]``, whatever attention the model switches to later;
    4. once the shortest layer has caught up, rows are *sealed* up to it: only blocks every layer has
       written are hashed for prefix caching (a half-written block must never be served).
Rollback (``crop``, ``crop_layers``, ``keep_positions``) sets layer lengths and frees the blocks past the
longest layer (a block goes only when no layer needs it); rows forget token ids and hashes from the first
position whose contents change (``BlockTables.unseal``). Pool hashes of cached blocks stay valid: such a
block is copied before any write, so its contents never change.

``keep_positions`` (C4) moves slots inside each row's own blocks: the destination span is prepared like a
write (a segment starting inside a shared / cached block copies that block first), all sources are read
before any destination is written, positions kept in place are not written (a row that keeps its
segment's head behaves exactly like ``crop``), and blocks past the new extent are freed.

Page dtype: when the pool is sized from ``memory_budget`` or ``dtype=`` is given, pages are promised in
that dtype and K/V of another dtype is refused at the first write, before anything is stored. Storing it
anyway broke the budget (fp32 pages in a pool sized for fp16); casting would make the cache lossy and the
paged attention's inputs disagree in dtype. Reduced-precision K/V is ``QuantizedKVCache``'s job.

Prefix reuse across ``generate`` calls (``enable_prefix_caching=True``): ``generate`` prefills only
``input_ids[:, cache.get_seq_length():]`` (it slices the prompt by the cache length when the attention
mask covers the whole prompt). ``load_prefix(input_ids, attention_mask)`` releases the previous rows
(their full prompt blocks stay indexed by chained hash), looks up each row's longest cached full-block
prefix, attaches those blocks and sets the cache length to their size — so the following ``generate``
computes only the uncached tail. At least one prompt token is always left to prefill, because
``generate`` needs its logits.

Deviations from vLLM: every row of a layer has the same length (transformers batches are rectangular);
sliding-window layers keep their full history (the mask applies the window), so rollback works at any
depth and all layers share one block table; generated tokens are hashed only when the caller hands their
ids back with ``record_tokens`` (the cache sees only K/V).

Shape legend: B batch · Hkv KV heads · T new tokens · S cached + new tokens · D head dim ·
N blocks · P block size · M blocks per row · k kept positions per row.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from transformers.cache_utils import Cache

from hf_kvspec import _compat, stored_kv
from hf_kvspec.memory import kv_bytes_per_token, parse_bytes
from hf_kvspec.stored_kv import PagedKV

from .block_pool import BlockPool
from .block_table import BlockTables
from .contract import Capabilities, check_config_arg, check_crop_arg, check_crop_length, check_keep_args, layer_ids
from .paged_layer import PagedLayer, check_layer_types

DEFAULT_BLOCK_SIZE = 16  # tokens per page
_DEFAULT_BUDGET_FRACTION = 0.25  # of free device memory, when neither num_blocks nor memory_budget is given


class PagedCache(Cache, Capabilities):
    """A paged KV cache usable as ``model.generate(ids, cache=PagedCache(model.config, ...))``; it obeys the
    cache contract C1-C6 (docstring of ``hf_kvspec.cache``), how is in this module's docstring.

    Args:
        config: the model config (its text config is used).
        block_size: tokens per block ``P``.
        num_blocks: physical blocks ``N`` in the pool; ``None`` sizes it from ``memory_budget``.
        enable_prefix_caching: index full prompt blocks by chained SHA-256 hash for reuse across calls
            (see ``load_prefix``).
        cache_salt: default per-tenant salt of the hash chain (``load_prefix`` can override it per request);
            different salts never share blocks.
        memory_budget: bytes (int or e.g. ``"2GiB"``) for the pages when ``num_blocks`` is None; default:
            a quarter of the free CUDA memory when CUDA is available, else of the free host memory.
        dtype: dtype of the pages (default: the config's, else float32, when the pool is sized from the
            budget; otherwise that of the first K/V stored). K/V of another dtype is refused, so
            ``nbytes() <= memory_budget`` holds.

    ``paired_attention`` is ``"kvspec_paged"`` when the config's model ran that attention at construction (the
    layers then hand their pages to it), else None (they return gathered K/V); it never changes afterwards.
    """

    keeps_positions = True  # contract.Capabilities flags: C4 for any segment held, C3 per layer
    crops_layers = True

    def __init__(
        self,
        config,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = False,
        cache_salt: str | None = None,
        memory_budget: int | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        check_config_arg(config, "PagedCache")
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = _compat.layer_types_and_kwargs(text_config)
        check_layer_types(layer_types, "PagedCache")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        if num_blocks is None:
            dtype = dtype or _config_dtype(text_config)
            num_blocks = blocks_for_budget(text_config, block_size, memory_budget, dtype)
        layers = [PagedLayer(num_blocks, block_size, kw.get("sliding_window"), dtype) for kw in layer_kwargs]
        super().__init__(layers=layers)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.tables = BlockTables(self.pool, enable_prefix_caching, cache_salt)
        self._config = text_config
        self.paired_attention = stored_kv.paired_reader(text_config, PagedKV)
        self._plans: dict[tuple, _Plan] = {}  # (start, T, device) -> slots of a write; valid for one tables version
        self._sealed = 0  # every row is sealed at least this far (T5 of block_table.py)

    # ---- the forward path (C1) ---------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, kwargs: dict | None = None, **_):
        """Append new K/V ``[B, Hkv, T, D]`` at layer ``layer_idx``'s own length; return what its attention reads."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        self._check_batch(key_states.shape[0])
        plan = self._plan(layer.cumulative_length, key_states.shape[-2], key_states.device)
        layer.write(plan.slots, key_states, value_states)
        self._seal_complete()
        if kwargs is not None and self.paired_attention is not None:
            stored_kv.hand_over(kwargs, plan.view, self._config, "PagedCache")
            return layer.keys, layer.values
        return layer.gather(plan.view)

    def _check_batch(self, batch: int) -> None:
        if self.tables.num_rows == 0 and self._extent() == 0:
            self.tables.add_rows(batch)
        elif self.tables.num_rows != batch:
            raise ValueError(
                f"PagedCache holds {self.tables.num_rows} rows but got a batch of {batch}; call cache.reset() (or "
                "cache.load_prefix(...)) before generating for a new batch."
            )

    def _plan(self, start: int, new_tokens: int, device) -> _Plan:
        """Slots for positions ``start..start+T-1`` of every row, made writable first (copy-on-write)."""
        tables, key = self.tables, (start, new_tokens, device)
        plan = self._plans.get(key)
        if plan is not None and plan.version == tables.version:
            return plan
        self._copy_blocks(tables.prepare_writes([(start, start + new_tokens)] * tables.num_rows))
        if any(p.version != tables.version for p in self._plans.values()):
            self._plans.clear()
        block_tables = torch.tensor(tables.tables(), dtype=torch.long, device=device).view(tables.num_rows, -1)
        plan = self._plans[key] = _Plan(block_tables, start, new_tokens, self.block_size, tables.version)
        return plan

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            for layer in self.layers:
                if layer.is_initialized:
                    layer.copy_blocks(copies)

    def _seal_complete(self) -> None:
        """Seal the rows up to the shortest layer once it has grown (then its blocks may be hashed)."""
        complete = min(layer.cumulative_length for layer in self.layers)
        if complete > self._sealed:
            for row in range(self.tables.num_rows):
                self.tables.seal(row, complete)
            self._sealed = complete

    # ---- lengths and rollback (C2, C3, C4) -----------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def _extent(self) -> int:
        """Tokens held by the longest layer: the extent of every row's block table."""
        return max(layer.cumulative_length for layer in self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens of every layer, each from its own length (negative,
        like ``DynamicCache.crop``); frees the tail blocks no layer needs any more."""
        check_crop_arg(tokens_to_remove)
        self._shrink({i: max(0, layer.cumulative_length + tokens_to_remove) for i, layer in enumerate(self.layers)})

    def crop_layers(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Keep the first ``length`` tokens of the given layers (all by default); the others are untouched."""
        chosen = layer_ids(len(self.layers), layers, "PagedCache.crop_layers")
        for i in chosen:
            check_crop_length(length, self.layers[i].cumulative_length, i)
        self._shrink({i: int(length) for i in chosen})

    def keep_positions(self, start: int, indices: torch.Tensor, layers: Iterable[int] | None = None) -> None:
        """In every row ``b`` move position ``start + indices[b, j]`` to ``start + j`` and drop the rest of the
        newest segment of the given layers (all by default); each then holds ``start + k`` tokens.

        ``indices`` ``[B, k]`` integer, each in ``0..n-1`` for the segment of ``n`` tokens after ``start``
        (contract C4 asks for ascending rows; any order is moved correctly here). Shared or cached blocks
        are copied before a slot in them is written (copy-on-write); kept-in-place positions are not written.
        """
        chosen = layer_ids(len(self.layers), layers, "PagedCache.keep_positions")
        if not chosen:
            return
        shortest = min(chosen, key=lambda i: self.layers[i].cumulative_length)  # its segment bounds the indices
        check_keep_args(start, indices, self.layers[shortest].cumulative_length, self.tables.num_rows,
                        f"PagedCache.keep_positions on layer {shortest}")
        start = int(start)
        copies, moves, first_changed = self.tables.prepare_moves(start, indices.tolist())
        self._copy_blocks(copies)
        if moves:
            src, dst = torch.tensor(moves).T  # [X] flat slots each
            for i in chosen:
                if self.layers[i].is_initialized:
                    self.layers[i].move(src, dst)
        self._shrink({i: start + indices.shape[1] for i in chosen}, first_changed)

    def _shrink(self, new_lengths: dict[int, int], first_changed: list[int | None] | None = None) -> None:
        """Set the given layers' lengths (never longer); rows forget ids and hashes from the first position
        whose contents change (``first_changed[row]``, or the shortest shrunk length); free blocks past the
        longest layer."""
        shrunk = min((n for i, n in new_lengths.items() if n < self.layers[i].cumulative_length), default=None)
        for i, length in new_lengths.items():
            self.layers[i].cumulative_length = length
        extent = self._extent()
        for row in range(self.tables.num_rows):
            changed = [p for p in (shrunk, first_changed[row] if first_changed else None) if p is not None]
            if changed:
                self.tables.unseal(row, min(changed))
            if self.tables.length(row) > extent:
                self.tables.truncate(row, extent)
        self._sealed = min((self.tables.sealed(row) for row in range(self.tables.num_rows)), default=0)

    # ---- batch edits (C5) ----------------------------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]`` by sharing blocks; later writes copy-on-write."""
        self._select_rows(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self.tables.num_rows) for _ in range(repeats)])

    def _select_rows(self, rows: list[int]) -> None:
        if self.tables.num_rows:
            self.tables.select(rows)

    def reset(self) -> None:
        """Release every row (blocks go back to the pool; indexed prefix blocks stay reusable)."""
        self.tables.release_all()
        self._set_lengths(0)
        self._plans.clear()

    def _set_lengths(self, length: int) -> None:
        for layer in self.layers:
            layer.cumulative_length = length
        self._sealed = length

    # ---- prefix reuse --------------------------------------------------------------------------
    def load_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    cache_salt: str | None = None) -> int:
        """Start a new request: release the current rows, attach cached prefix blocks of ``input_ids``.

        Returns the number of leading tokens per row that the next ``generate(input_ids, attention_mask=...,
        cache=self)`` will not prefill (a multiple of ``block_size``, the same for every row, at most
        ``input_ids.shape[1] - 1``). Pass the same ``attention_mask`` to both calls when rows are padded.
        ``cache_salt`` is this request's tenant salt (default: the cache's); blocks are shared only
        between requests with the same salt.
        """
        if not self.tables.enable_prefix_caching:
            raise ValueError("load_prefix() needs PagedCache(..., enable_prefix_caching=True).")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}.")
        self.reset()
        token_rows = input_ids.tolist()
        padding = (attention_mask == 0).tolist() if attention_mask is not None else [None] * len(token_rows)
        self.tables.add_rows(len(token_rows))
        matches = []
        for row, (tokens, pads) in enumerate(zip(token_rows, padding)):
            self.tables.set_tokens(row, tokens, pads, salt=cache_salt)
            matches.append(self.tables.match_prefix(row, max_tokens=len(tokens) - 1))
        shared = min(len(blocks) for blocks, _ in matches)  # rows share one length
        for row, (blocks, hashes) in enumerate(matches):
            self.tables.attach(row, blocks[:shared], hashes[:shared])
        self._set_lengths(shared * self.block_size)
        return shared * self.block_size

    def record_tokens(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Tell the cache the token ids its rows hold, e.g. ``generate``'s output ``[B, L]``.

        The cache sees only K/V, so without this only prompt blocks (from ``load_prefix``) are hashed. After
        it, full blocks of generated tokens are indexed too, and a follow-up turn whose prompt repeats the
        conversation so far reuses them. ``sequences`` must start with the ids the rows already hold.
        """
        if not self.tables.enable_prefix_caching:
            raise ValueError("record_tokens() needs PagedCache(..., enable_prefix_caching=True).")
        if sequences.ndim != 2 or sequences.shape[0] != self.tables.num_rows:
            raise ValueError(f"sequences must be [{self.tables.num_rows}, L] (one row per cache row), "
                             f"got shape {tuple(sequences.shape)}.")
        padding = (attention_mask == 0).tolist() if attention_mask is not None else [None] * len(sequences)
        for row, (tokens, pads) in enumerate(zip(sequences.tolist(), padding)):
            self.tables.extend_tokens(row, tokens, pads)

    # ---- introspection -------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.pool.num_free()

    def num_used_blocks(self) -> int:
        return self.pool.num_used()

    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def block_table(self, batch_idx: int, layer_idx: int = 0) -> list[int]:
        """Physical block ids of row ``batch_idx`` (all layers share one table; ``layer_idx`` is validated only)."""
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx {layer_idx} is outside 0..{len(self.layers) - 1}.")
        if not 0 <= batch_idx < self.tables.num_rows:
            raise IndexError(f"row {batch_idx}: the cache holds {self.tables.num_rows} rows; pass a row in "
                             f"0..{self.tables.num_rows - 1}." if self.tables.num_rows else
                             f"row {batch_idx}: the cache holds 0 rows (nothing was written yet).")
        return self.tables.table(batch_idx)

    def gather_positions(self, layer_idx: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only: K, V ``[B, Hkv, C, D]`` of layer ``layer_idx`` at ``positions`` ``[B, C]`` (each below the
        layer's length) of every row, through the block tables; a sparse view's sinks + window
        (``cache/views.py``) read this way touch only the blocks that hold them. Writes nothing."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized or (positions.numel() and int(positions.max()) >= layer.cumulative_length):
            raise ValueError(f"gather_positions: layer {layer_idx} holds {layer.cumulative_length} tokens; pass "
                             "positions below that.")
        tables = torch.tensor(self.tables.tables(), dtype=torch.long, device=layer.keys.device)
        positions = positions.to(layer.keys.device, torch.long)
        blocks = tables.view(self.tables.num_rows, -1).gather(1, positions // self.block_size)  # [B, C]
        offsets = positions % self.block_size
        # pages [N, P, Hkv, D] indexed by [B, C] block ids and offsets -> [B, C, Hkv, D] -> [B, Hkv, C, D]
        return layer.keys[blocks, offsets].transpose(1, 2), layer.values[blocks, offsets].transpose(1, 2)

    def utilization(self) -> float:
        """Token slots holding live tokens / slots of the blocks in use (each shared block counted once)."""
        filled: dict[int, int] = {}
        for row in range(self.tables.num_rows):
            length = self.tables.length(row)
            for index, block in enumerate(self.tables.table(row)):
                filled[block] = max(filled.get(block, 0), min(self.block_size, length - index * self.block_size))
        return sum(filled.values()) / (len(filled) * self.block_size) if filled else 1.0

    def prefix_hit_rate(self) -> float:
        """Fraction of full prompt blocks looked up by ``load_prefix`` that were served from the cache."""
        queried = self.tables.prefix_queried_blocks
        return self.tables.prefix_hit_blocks / queried if queried else 0.0

    def nbytes(self) -> int:
        """Bytes of the allocated pages (all blocks, used or not)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)


class _Plan:
    """Index tensors of one write span ``start..start+T-1``, shared by the layers that write it."""

    def __init__(self, block_tables: torch.Tensor, start: int, new_tokens: int, block_size: int, version: int):
        self.version = version  # of the BlockTables it was computed from
        self.view = PagedKV(block_tables, start + new_tokens)  # block_tables [B, M]; the writing layer's length
        positions = torch.arange(start, start + new_tokens, device=block_tables.device)
        self.slots = (block_tables[:, positions // block_size] * block_size + positions % block_size).reshape(-1)


def _config_dtype(config) -> torch.dtype:
    """The dtype a config declares for its weights (a name or a torch dtype), else float32."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def blocks_for_budget(config, block_size: int, memory_budget: int | str | None, dtype: torch.dtype) -> int:
    """How many blocks of ``block_size`` tokens fit in ``memory_budget`` bytes of K/V pages."""
    budget = parse_bytes(memory_budget) if isinstance(memory_budget, str) else memory_budget
    if budget is None:
        budget = int(_free_memory_bytes() * _DEFAULT_BUDGET_FRACTION)
    per_block = kv_bytes_per_token(config, dtype) * block_size
    num_blocks = int(budget) // per_block
    if num_blocks < 1:
        raise ValueError(f"memory_budget={memory_budget!r} holds no block of {per_block} bytes; raise it.")
    return num_blocks


def _free_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
