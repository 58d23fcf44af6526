"""Attention over ragged rows packed into one forward, registered with transformers as
``attn_implementation="kvspec_ragged"`` (``AttentionInterface`` only — see below).

Boundary: the attention math for the serving engine. The packed layout (which columns belong to which
sequence, its block table and length, an optional mask among its new tokens) comes from
``hf_kvspec.cache.ragged.RaggedPagedCache`` as a ``RaggedKV`` through the cache -> attention channel; this
module never allocates or writes K/V. Masks follow ``hf_kvspec.attention.masks`` (bool, True = attend).

Why packed rows (batch 1, per-token ``position_ids``) rather than a padded batch with 4D masks: a round mixes
decode rows (one new token each) with prefill chunks (hundreds of tokens). Padded, every decode row would be
stretched to the longest chunk, multiplying the MLP and projection work by the chunk length; packed, the
linear layers see exactly the round's tokens and only attention is split by row. The measured difference is
in ``docs/engine.md``. transformers' own continuous batching and vLLM pack the same way.

No mask function is registered on purpose: for an attention implementation absent from
``AttentionMaskInterface`` transformers builds no mask and passes ``attention_mask=None`` (the path it keeps
for vLLM/TGI kernels), so nothing of size ``T x S`` is built for the packed run; each row's mask is built here.

Two paths, compared in ``tests/serving/test_attention.py`` (and whole forwards in ``tests/serving/test_runner.py``):
    fast       ``ragged_attention``: rows with one new token and no custom mask (decode rows) are gathered
               into padded batches ``[Bd, Hkv, S_max, D]`` with a key-length mask — one SDPA call per group of
               decode rows, the groups chosen by ``split_by_length`` so that a few long rows do not pad many
               short ones (rows of one length need no mask at all); rows of a few tokens (verify rows: a token
               and its drafts) share one call padded to the longest, each with its own bottom-right causal (or
               tree) mask; every other row (a prefill chunk) gets its own call. Groups and masks are built once
               per forward and reused by every layer; a single call over the whole run returns its result as is.
    reference  ``reference_ragged_attention``: row by row through ``reference_paged_attention`` (token-by-token
               gather, ``repeat_kv``, eager softmax) with masks written out element by element. A ``RaggedKV``
               built with ``reference=True`` (``ForwardRunner(..., reference=True)``) sends every layer there.

Deviation from vLLM's kernels: the pages a row reads are gathered once per layer (stock torch ops on CPU),
not streamed block by block. Keeping a contiguous copy per sequence instead would cost the same copy
(``DynamicCache`` concatenates its whole history every step), so the gather stays.

Shape legend: T packed new tokens · Hq / Hkv query / KV heads · D head dim · Dv value head dim · S keys of a
row (stored + new) · Bd decode rows · M blocks per row · N blocks · P block size · W sliding window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_kvspec import stored_kv
from hf_kvspec.attention.paged import gather_blocks, grouped_attention, reference_paged_attention
from hf_kvspec.cache.ragged import RAGGED_ATTN_NAME, RaggedKV

ATTN_NAME = RAGGED_ATTN_NAME


@dataclass(frozen=True)
class _Group:
    """Rows attended by one SDPA call, of one of three kinds: ``batched``, B decode rows of one token each;
    ``padded``, B rows of a few tokens each (verify rows), queries padded to the longest (``valid`` marks the real
    ones); else one row of Tg tokens."""

    columns: torch.Tensor | slice  # packed query columns: row-major; padded: [B, Tq] (padding repeats a real one)
    block_tables: torch.Tensor  # [B, M] (padded with block 0: R2 of cache/ragged.py keeps pages finite)
    kv_length: int  # S of the gather (the longest row's)
    mask: torch.Tensor | None  # [B, 1, Tg, S] bool, True = attend; None: every gathered key is visible
    batched: bool  # True: B decode rows of one token each
    valid: torch.Tensor | None = None  # padded: [B, Tq] bool, the real queries
    out_columns: torch.Tensor | None = None  # padded: packed columns of the real queries, row-major


# ---- masks ----------------------------------------------------------------------------------------------
def row_mask(start: int, new_tokens: int, window: int | None, new_token_mask: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:  # [T, S] bool
    """Row mask: new token ``i`` (position ``start + i``) sees stored tokens and new tokens per causality (or
    ``new_token_mask`` [T, T]), and, with a sliding window ``W``, only keys ``k > position - W``."""
    positions = torch.arange(start, start + new_tokens, device=device)[:, None]
    keys = torch.arange(start + new_tokens, device=device)[None, :]
    keep = keys <= positions
    if window is not None:
        keep &= keys > positions - window
    if new_token_mask is not None:
        keep[:, start:] = new_token_mask.to(device=device, dtype=torch.bool)
    return keep


def _check_window(view: RaggedKV, window: int | None) -> None:
    if window is not None and any(m is not None for m in view.new_token_masks):
        raise ValueError("kvspec_ragged: a custom new-token mask (draft tree) on a sliding-window layer is not "
                         "supported; use a model with full attention for tree drafts.")


# ---- the fast path ---------------------------------------------------------------------------------------
#: Cost model of one decode group, in key rows: a call (two gathers and one SDPA) costs about as much fixed work as
#: attending this many extra key rows, so decode rows of very different lengths are split into groups
#: (``split_by_length``) only when the padding saved outweighs the extra calls. Speed only; results do not depend on it.
CALL_COST_IN_KEY_ROWS = 256


def split_by_length(lengths: Sequence[int], call_cost: int | None = None) -> list[list[int]]:
    """Rows ``0..len(lengths)-1`` partitioned into groups minimising ``sum(call_cost + rows · longest)`` over the
    groups (each group is padded to its longest row). An optimal partition of rows sorted by length is contiguous,
    so a dynamic programme over the sorted order finds it in ``O(rows²)``. Each group lists its rows in index order.
    ``call_cost``: default ``CALL_COST_IN_KEY_ROWS``."""
    call_cost = CALL_COST_IN_KEY_ROWS if call_cost is None else call_cost
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):  # best[end]: rows order[:end] grouped
        longest = lengths[order[end - 1]]
        for begin in range(end):
            cost = best[begin] + call_cost + (end - begin) * longest
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    groups, end = [], len(order)
    while end:
        groups.append(sorted(order[cut[end]: end]))
        end = cut[end]
    return groups[::-1]


#: rows of more than one and at most this many new tokens (verify rows: a decode row's token and its drafts) share
#: one padded call; longer rows (prefill chunks) get their own. Speed only; results do not depend on it.
MAX_PADDED_QUERIES = 32


def _groups(view: RaggedKV, window: int | None, device: torch.device) -> list[_Group]:
    """The SDPA calls of one forward (built once, reused by every layer with the same window)."""
    key = ("groups", window)
    if key not in view.memo:
        _check_window(view, window)
        rows = range(len(view.query_lengths))
        decode = [r for r in rows if view.query_lengths[r] == 1 and view.new_token_masks[r] is None]
        split = split_by_length([view.kv_lengths[r] for r in decode])
        groups = [_decode_group(view, [decode[i] for i in part], window, device) for part in split]
        rest = [r for r in rows if r not in set(decode)]
        few = [r for r in rest if view.query_lengths[r] <= MAX_PADDED_QUERIES]
        if len(few) > 1:
            groups.append(_padded_group(view, few, window, device))
            rest = [r for r in rest if r not in set(few)]
        groups += [_row_group(view, r, window, device) for r in rest]
        view.memo[key] = groups
    return view.memo[key]


def _columns(starts: list[int], device: torch.device) -> torch.Tensor | slice:
    """Packed columns as a slice when consecutive (a view of the query, no copy), else an index tensor."""
    if starts == list(range(starts[0], starts[0] + len(starts))):
        return slice(starts[0], starts[0] + len(starts))
    return torch.tensor(starts, device=device)


def _decode_group(view: RaggedKV, rows: list[int], window: int | None, device: torch.device) -> _Group:
    lengths = [view.kv_lengths[r] for r in rows]
    width = max(len(view.block_tables[r]) for r in rows)
    tables = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        tables[i, : len(view.block_tables[r])] = view.block_tables[r]
    mask = None  # rows of one length, no window: every gathered key is visible, SDPA needs no mask
    if window is not None or min(lengths) != max(lengths):
        length = torch.tensor(lengths, device=device)[:, None]  # [Bd, 1]
        keys = torch.arange(max(lengths), device=device)[None, :]  # [1, S_max]
        keep = keys < length  # the query sits at position S_r - 1
        if window is not None:
            keep &= keys > length - 1 - window
        mask = keep[:, None, None, :]
    columns = _columns([view.query_starts[r] for r in rows], device)
    return _Group(columns, tables, max(lengths), mask, batched=True)


def _row_group(view: RaggedKV, r: int, window: int | None, device: torch.device) -> _Group:
    start, new_tokens = view.kv_lengths[r] - view.query_lengths[r], view.query_lengths[r]
    mask = row_mask(start, new_tokens, window, view.new_token_masks[r], device)
    columns = slice(view.query_starts[r], view.query_starts[r] + new_tokens)
    return _Group(columns, view.block_tables[r][None], view.kv_lengths[r], mask[None, None], batched=False)


def _padded_group(view: RaggedKV, rows: list[int], window: int | None, device: torch.device) -> _Group:
    """Rows of a few new tokens each in one call: queries padded to the longest row's ``Tq``, keys to the longest
    row's ``S``; each row keeps its own mask (``row_mask``: causal or its tree), a padding query sees key 0 only
    (so no query row is fully masked) and its result is dropped."""
    queries = max(view.query_lengths[r] for r in rows)
    keys = max(view.kv_lengths[r] for r in rows)
    width = max(len(view.block_tables[r]) for r in rows)
    tables = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), queries, keys, dtype=torch.bool, device=device)
    valid = torch.zeros(len(rows), queries, dtype=torch.bool)
    columns = torch.zeros(len(rows), queries, dtype=torch.long)
    for i, r in enumerate(rows):
        new_tokens, length, first = view.query_lengths[r], view.kv_lengths[r], view.query_starts[r]
        tables[i, : len(view.block_tables[r])] = view.block_tables[r]
        mask[i, :new_tokens, :length] = row_mask(length - new_tokens, new_tokens, window, view.new_token_masks[r],
                                                 device)
        mask[i, new_tokens:, 0] = True
        valid[i, :new_tokens] = True
        columns[i] = first + torch.arange(queries).clamp_max(new_tokens - 1)
    return _Group(columns.to(device), tables, keys, mask[:, None], batched=False, valid=valid.to(device),
                  out_columns=columns[valid].to(device))


def _is_whole(columns: torch.Tensor | slice, tokens: int) -> bool:
    return isinstance(columns, slice) and columns == slice(0, tokens)


def ragged_attention(
    query: torch.Tensor,  # [1, Hq, T, D]
    key_pages: torch.Tensor,  # [N, P, Hkv, D]
    value_pages: torch.Tensor,  # [N, P, Hkv, Dv]
    view: RaggedKV,
    scaling: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:  # [1, T, Hq, Dv]
    """Attention of every packed row over its own pages (fast path; see the module docstring)."""
    if view.reference:
        return reference_ragged_attention(query, key_pages, value_pages, view, scaling, softcap, window)
    groups = _groups(view, window, query.device)
    out = None
    for group in groups:
        if group.batched:
            rows_query = query[0, :, group.columns].transpose(0, 1)[:, :, None]  # [Bd, Hq, 1, D]
        elif group.valid is not None:
            rows_query = query[0, :, group.columns].transpose(0, 1)  # [B, Hq, Tq, D]
        else:
            rows_query = query[:, :, group.columns]  # [1, Hq, Tg, D]
        keys = gather_blocks(key_pages, group.block_tables, group.kv_length)  # [B, Hkv, S, D]
        values = gather_blocks(value_pages, group.block_tables, group.kv_length)
        result = grouped_attention(rows_query, keys, values, group.mask, scaling, softcap, is_causal=False)
        if group.valid is not None:  # [B, Tq, Hq, Dv] -> the real queries [n, Hq, Dv], row-major
            result, columns = result[group.valid], group.out_columns
        else:
            result, columns = (result[:, 0] if group.batched else result[0]), group.columns  # [Bd|Tg, Hq, Dv]
        if len(groups) == 1 and _is_whole(columns, query.shape[2]):
            return result[None]  # one call covered the whole packed run, in order: no copy
        if out is None:
            out = query.new_empty(query.shape[2], query.shape[1], value_pages.shape[-1])  # [T, Hq, Dv]
        out[columns] = result
    return out[None]


# ---- the reference ---------------------------------------------------------------------------------------
def reference_row_mask(start: int, new_tokens: int, window: int | None,
                       new_token_mask: torch.Tensor | None) -> torch.Tensor:  # [T, S] bool
    """``row_mask`` written element by element: the oracle's mask."""
    keep = torch.zeros(new_tokens, start + new_tokens, dtype=torch.bool)
    for i in range(new_tokens):
        position = start + i
        for k in range(start + new_tokens):
            if k < start:
                visible = True
            elif new_token_mask is not None:
                visible = bool(new_token_mask[i, k - start])
            else:
                visible = k <= position
            in_window = window is None or k > position - window
            keep[i, k] = visible and in_window
    return keep


def reference_ragged_attention(query, key_pages, value_pages, view: RaggedKV, scaling: float,
                               softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """Row by row through the plain paged oracle; same arguments and result ``[1, T, Hq, Dv]`` as the fast path."""
    _check_window(view, window)
    outputs = []
    for r, new_tokens in enumerate(view.query_lengths):
        start, first = view.kv_lengths[r] - new_tokens, view.query_starts[r]
        mask = reference_row_mask(start, new_tokens, window, view.new_token_masks[r]).to(query.device)
        outputs.append(reference_paged_attention(
            query[:, :, first: first + new_tokens], key_pages, value_pages, view.block_tables[r][None],
            view.kv_lengths[r], mask[None, None], scaling, softcap))  # [1, T_r, Hq, Dv]
    return torch.cat(outputs, dim=1)


# ---- the transformers-facing function ------------------------------------------------------------------
def ragged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # pages [N, P, Hkv, D]
    value: torch.Tensor,  # pages [N, P, Hkv, Dv]
    attention_mask: torch.Tensor | None,  # None: this implementation has no mask function
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``(out [1, T, Hq, Dv], None)``."""
    if dropout and module.training:
        raise ValueError("kvspec_ragged attention is inference-only.")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvspec_ragged attention does not support attention sinks (s_aux).")
    view = stored_kv.take(kwargs, RaggedKV)
    if view is None or attention_mask is not None:
        raise ValueError("kvspec_ragged attention runs only inside hf_kvspec.Engine (it reads a RaggedPagedCache); "
                         "use attn_implementation='sdpa' or 'kvspec_paged' elsewhere.")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return ragged_attention(query, key, value, view, scaling, softcap, sliding_window), None


class RaggedAttend:
    """The fast forward's attention callback (``hf_kvspec.forward.program.Attend``) over the engine's
    ``RaggedPagedCache``: each layer scatters its new K/V (``write_layer``, which returns the packed layout
    directly: the model's attention is never switched for the fast forward) and attends with
    ``ragged_attention``."""

    def __init__(self, cache, scaling: float):
        self.cache, self.scaling = cache, scaling

    def __call__(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        key_pages, value_pages, view = self.cache.write_layer(key, value, index)  # [N, P, Hkv, D] each
        return ragged_attention(query, key_pages, value_pages, view, self.scaling)  # [1, T, Hq, D]


def register_ragged_attention() -> None:
    """Register ``kvspec_ragged`` (the reader of ``RaggedKV``) with ``AttentionInterface`` (no mask function, see
    the module docstring). Idempotent; the engine calls it when it is built."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ragged_attention_forward)
