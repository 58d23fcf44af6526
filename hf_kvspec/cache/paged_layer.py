"""``PagedLayer``: one layer's K/V pages of a ``PagedCache`` and that layer's length.

Boundary: tensors only. The block tables that say which block holds which token are shared by every layer
and live in ``PagedCache`` (``paged.py``), so batch and rollback operations are cache-level; a layer scatters
K/V into slots it is given, moves slots, copies whole blocks and gathers rows. Part of the cache contract
in the docstring of ``hf_kvspec.cache`` (C2: each layer keeps its own length).

Shape legend: B batch · Hkv KV heads · T new tokens · S cached + new tokens · D head dim · N blocks ·
P block size.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_kvspec.attention.paged import gather_blocks
from hf_kvspec.stored_kv import PagedKV

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")  # what a PagedLayer stores (a window is a length)


def check_layer_types(layer_types, cache_name: str) -> None:
    """Refuse a config whose layers a ``PagedLayer`` cannot hold (e.g. linear attention), naming them."""
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"{cache_name} supports {SUPPORTED_LAYER_TYPES} layers; this config has {unsupported}.")


class PagedLayer(CacheLayerMixin):
    """One layer's K/V pages ``[N, P, Hkv, D]`` and its length. The block tables are shared by all layers
    and live in ``PagedCache``, so batch/rollback operations are cache-level; this layer stores and gathers."""

    is_croppable = True
    is_compileable = False

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None = None,
                 page_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.page_dtype = page_dtype  # the dtype the pool was sized for; None: whatever the first K/V has
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.page_dtype is not None and key_states.dtype != self.page_dtype:
            raise ValueError(
                f"PagedCache pages are {self.page_dtype} (the pool was sized for that dtype) but the model stores "
                f"{key_states.dtype} keys/values, which would take a different amount of memory than the budget. "
                f"Build the cache with dtype={key_states.dtype} (e.g. dtype=model.dtype), or give num_blocks."
            )
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
            _flat_slots(pages).index_copy_(1, slots, flat)
        self.cumulative_length += key_states.shape[-2]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` ``[X]`` to slots ``dst`` ``[X]``; all sources are read before any is written."""
        for pages in (self.keys, self.values):
            flat = _flat_slots(pages)  # [Hkv, N·P, D]
            flat.index_copy_(1, dst.to(flat.device), flat.index_select(1, src.to(flat.device)))

    def gather(self, view: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[B, Hkv, S, D]`` (strided views of one whole-block gather each, no second copy)."""
        return (gather_blocks(self.keys, view.block_tables, view.kv_length),
                gather_blocks(self.values, view.block_tables, view.kv_length))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src, dst = (torch.tensor(ids, device=self.keys.device) for ids in zip(*copies))
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


def _pages(states: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Empty pages ``[N, P, Hkv, D]`` for K/V like ``states`` ``[B, Hkv, T, D]``, head-major in memory.

    The storage is ``[Hkv, N, P, D]`` so that a gathered row is contiguous along tokens per head, the
    layout SDPA reads fastest (see ``gather_blocks``); the tensor keeps the ``[N, P, Hkv, D]`` shape.
    """
    _, heads, _, dim = states.shape
    storage = torch.empty(heads, num_blocks, block_size, dim, dtype=states.dtype, device=states.device)
    return storage.permute(1, 2, 0, 3)


def _flat_slots(pages: torch.Tensor) -> torch.Tensor:
    """Pages ``[N, P, Hkv, D]`` as the view ``[Hkv, N·P, D]`` over their head-major storage (slot = block·P + offset)."""
    _, _, heads, dim = pages.shape
    return pages.permute(2, 0, 1, 3).view(heads, -1, dim)
