"""``PagedCache``: a paged KV cache (vLLM, Kwon et al. SOSP'23, arXiv 2309.06180) that is a real
transformers ``Cache`` of ``CacheLayerMixin`` layers, so ``model.generate(ids, cache=PagedCache(...))``
works — greedy, sampling, beam search, assisted / speculative decoding.

Boundary: tensors live here (one page tensor pair per layer); *which* block holds which token is decided
by ``BlockTables`` / ``BlockPool`` (plain Python). Attention over the pages is ``attention/paged.py``.

How a forward flows:
    1. the first layer to see a step's new K/V calls ``_begin_step``: the tables grow (allocating blocks,
       copy-on-write of shared / cached partial blocks, on every layer's pages at once) and the step's
       slot indices are computed once for all layers;
    2. each layer scatters its K/V into its pages at those slots;
    3. with ``attn_implementation="kvspec_paged"`` the layer returns its raw pages and puts a
       ``PagedKV`` (block tables + length) into the attention kwargs; with any other implementation it
       returns gathered contiguous K/V ``[B, Hkv, S, D]``, so every model works.

Prefix reuse across ``generate`` calls (``enable_prefix_caching=True``): ``generate`` prefills only
``input_ids[:, cache.get_seq_length():]`` (it slices the prompt by the cache length when the attention
mask covers the whole prompt). ``load_prefix(input_ids, attention_mask)`` releases the previous rows
(their full prompt blocks stay indexed by chained hash), looks up each row's longest cached full-block
prefix, attaches those blocks and sets the cache length to their size — so the following ``generate``
computes only the uncached tail. At least one prompt token is always left to prefill, because
``generate`` needs its logits.

Deviations from vLLM: every row of a batch has the same length (transformers batches are rectangular);
sliding-window layers keep their full history (the mask applies the window), so rollback works at any
depth and all layers share one block table; generated tokens are hashed only when the caller hands their
ids back with ``record_tokens`` (the cache sees only K/V).

Shape legend: B batch · Hkv KV heads · T new tokens · S cached + new tokens · D head dim ·
N blocks · P block size · M blocks per row.
"""

from __future__ import annotations

import os

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from hf_kvspec import _compat
from hf_kvspec.attention.paged import ATTN_NAME, PagedKV, gather_blocks
from hf_kvspec.memory import kv_bytes_per_token, parse_bytes

from .block_pool import BlockPool
from .block_table import BlockTables

_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16  # tokens per page
_DEFAULT_BUDGET_FRACTION = 0.25  # of free device memory, when neither num_blocks nor memory_budget is given


class PagedLayer(CacheLayerMixin):
    """One layer's K/V pages ``[N, P, Hkv, D]``. The block tables are shared by all layers and live in
    ``PagedCache``, so batch/rollback operations are cache-level; this layer only stores and gathers."""

    is_croppable = True
    is_compileable = False

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None = None):
        super().__init__()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = _pages(key_states, self.num_blocks, self.block_size)
        self.values = _pages(value_states, self.num_blocks, self.block_size)
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("PagedLayer is driven by PagedCache.update: its block tables are shared by all layers.")

    def write(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Scatter new K/V ``[B, Hkv, T, D]`` into flat slots ``[B·T]`` (slot = block · P + offset)."""
        for pages, states in ((self.keys, key_states), (self.values, value_states)):
            batch, heads, tokens, dim = states.shape
            flat = states.transpose(0, 1).reshape(heads, batch * tokens, dim)  # [Hkv, B·T, D], slot order
            pages.permute(2, 0, 1, 3).view(heads, -1, dim).index_copy_(1, slots, flat)
        self.cumulative_length += key_states.shape[-2]

    def gather(self, view: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[B, Hkv, S, D]`` (strided views of one whole-block gather each, no second copy)."""
        return (gather_blocks(self.keys, view.block_tables, view.kv_length),
                gather_blocks(self.values, view.block_tables, view.kv_length))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.keys[dst] = self.keys[src]
        self.values[dst] = self.values[src]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0  # full history, also for sliding layers (mask windows it)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1  # bounded by the shared pool, not per layer

    def reset(self) -> None:
        self.cumulative_length = 0  # pages are kept: blocks are reallocated, not cleared

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise TypeError("Use PagedCache.reorder_cache: block tables are shared by all layers.")


class PagedCache(Cache):
    """A paged KV cache usable as ``model.generate(ids, cache=PagedCache(model.config, ...))``.

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
        dtype: dtype used to size the pool from the budget (default: the config's, else float32). Pages
            take the dtype of the first K/V they store.
    """

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
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise ValueError(f"PagedCache supports {_SUPPORTED_LAYER_TYPES} layers; this config has {unsupported}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        if num_blocks is None:
            dtype = dtype or getattr(text_config, "dtype", None) or torch.float32
            num_blocks = blocks_for_budget(text_config, block_size, memory_budget, dtype)
        layers = [PagedLayer(num_blocks, block_size, kw.get("sliding_window")) for kw in layer_kwargs]
        super().__init__(layers=layers)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.tables = BlockTables(self.pool, enable_prefix_caching, cache_salt)
        self._config = text_config
        self._step: _Step | None = None

    # ---- the forward path ----------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, kwargs: dict | None = None, **_):
        """Store new K/V ``[B, Hkv, T, D]`` of ``layer_idx``; return what the attention function reads."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if layer.cumulative_length == self._length():  # first layer of this forward
            self._begin_step(key_states.shape[0], key_states.shape[-2], key_states.device, kwargs is not None)
        step = self._step
        layer.write(step.slots, key_states, value_states)
        if step.paged:
            kwargs["paged_kv"] = step.view
            return layer.keys, layer.values
        return layer.gather(step.view)

    def _begin_step(self, batch: int, new_tokens: int, device, has_kwargs: bool) -> None:
        tables = self.tables
        if tables.num_rows == 0:
            tables.add_rows(batch)
        elif tables.num_rows != batch:
            raise ValueError(
                f"PagedCache holds {tables.num_rows} rows but got a batch of {batch}; call cache.reset() (or "
                "cache.load_prefix(...)) before generating for a new batch."
            )
        start = self._length()
        copies = tables.grow([start + new_tokens] * batch)  # raises OutOfBlocksError before any change
        if copies:
            src, dst = (torch.tensor(ids, device=device) for ids in zip(*copies))
            for layer in self.layers:
                if layer.is_initialized:
                    layer.copy_blocks(src, dst)
        block_tables = torch.tensor(tables.tables(), dtype=torch.long, device=device)  # [B, M]
        paged = has_kwargs and _compat.attn_implementation(self._config) == ATTN_NAME
        self._step = _Step(block_tables, start, new_tokens, self.block_size, paged)

    def _length(self) -> int:
        return self.tables.length(0) if self.tables.num_rows else 0

    # ---- Cache API -----------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (negative, like ``DynamicCache.crop``); frees tail blocks."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove.")
        new_length = max(0, self._length() + tokens_to_remove)
        for row in range(self.tables.num_rows):
            self.tables.truncate(row, new_length)
        self._set_lengths(new_length)

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
        self._step = None

    def _set_lengths(self, length: int) -> None:
        for layer in self.layers:
            layer.cumulative_length = length

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
        return self.tables.table(batch_idx)

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


def _pages(states: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Empty pages ``[N, P, Hkv, D]`` for K/V like ``states`` ``[B, Hkv, T, D]``, head-major in memory.

    The storage is ``[Hkv, N, P, D]`` so that a gathered row is contiguous along tokens per head, the
    layout SDPA reads fastest (see ``gather_blocks``); the tensor keeps the ``[N, P, Hkv, D]`` shape.
    """
    _, heads, _, dim = states.shape
    storage = torch.empty(heads, num_blocks, block_size, dim, dtype=states.dtype, device=states.device)
    return storage.permute(1, 2, 0, 3)


class _Step:
    """Index tensors of one forward, computed once and shared by all layers."""

    def __init__(self, block_tables: torch.Tensor, start: int, new_tokens: int, block_size: int, paged: bool):
        self.paged = paged
        self.view = PagedKV(block_tables, start + new_tokens)
        positions = torch.arange(start, start + new_tokens, device=block_tables.device)
        self.slots = (block_tables[:, positions // block_size] * block_size + positions % block_size).reshape(-1)


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
