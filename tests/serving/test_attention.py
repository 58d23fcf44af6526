"""``kvspec_ragged`` attention: the fast path (batched decode rows, per-row prefill calls) against the row-by-row
reference, and its masks against masks written element by element."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvspec.cache.ragged import RaggedKV
from hf_kvspec.serving import attention
from hf_kvspec.serving.attention import (
    ragged_attention,
    reference_ragged_attention,
    reference_row_mask,
    row_mask,
    split_by_length,
)

# fp32 SDPA vs einsum-softmax on D=16: reassociation error ~1e-7 per element; 1e-5 leaves margin
TOL = dict(rtol=1e-5, atol=1e-5)
BLOCK, HKV, DIM = 4, 2, 16


def ragged_case(rows: list[tuple[int, int]], groups: int, seed: int, masks=None):
    """Pages under a random block permutation for rows ``(stored, new)``. Blocks no row owns hold NaN (never read);
    unwritten slots of owned blocks and padding block 0 hold large finite garbage: a decode batch reads them
    (masked), and the cache keeps every slot finite (R2 of cache/ragged.py)."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(s + t) // BLOCK) for s, t in rows]
    num_blocks = sum(needs) + 3
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0: the zeroed padding target
    key_pages = torch.full((num_blocks, BLOCK, HKV, DIM), float("nan"))
    value_pages = torch.full_like(key_pages, float("nan"))
    key_pages[0] = value_pages[0] = 1e4
    tables, used = [], 0
    for (stored, new), need in zip(rows, needs):
        table = order[used: used + need]
        used += need
        key_pages[table] = value_pages[table] = -1e4
        positions = torch.arange(stored + new)
        slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
        key_pages.view(-1, HKV, DIM)[slots] = torch.randn(len(slots), HKV, DIM, generator=gen)
        value_pages.view(-1, HKV, DIM)[slots] = torch.randn(len(slots), HKV, DIM, generator=gen)
        tables.append(table)
    starts = [sum(t for _, t in rows[:i]) for i in range(len(rows))]
    view = RaggedKV(tuple(starts), tuple(t for _, t in rows), tuple(s + t for s, t in rows), tuple(tables),
                    tuple(masks or [None] * len(rows)))
    query = torch.randn(1, HKV * groups, sum(t for _, t in rows), DIM, generator=gen)
    return query, key_pages, value_pages, view


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fast_path_matches_reference_on_mixed_rows(groups, window, softcap):
    rows = [(9, 1), (0, 6), (3, 1), (13, 5), (22, 1), (4, 4)]  # decode rows, a first chunk, later chunks
    query, key_pages, value_pages, view = ragged_case(rows, groups, seed=groups)
    got = ragged_attention(query, key_pages, value_pages, view, 0.25, softcap, window)
    expected = reference_ragged_attention(query, key_pages, value_pages, view, 0.25, softcap, window)
    assert got.shape == (1, 18, HKV * groups, DIM)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **TOL)


def test_tree_mask_rows_match_reference():
    """A row carrying draft tokens with a tree mask (the speculation seam) next to decode rows."""
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    rows = [(7, 1), (10, 4), (2, 1)]
    query, key_pages, value_pages, view = ragged_case(rows, 2, seed=3, masks=[None, tree, None])
    got = ragged_attention(query, key_pages, value_pages, view, 0.25)
    torch.testing.assert_close(got, reference_ragged_attention(query, key_pages, value_pages, view, 0.25), **TOL)
    causal = ragged_case(rows, 2, seed=3)[3]
    assert not torch.allclose(got, ragged_attention(query, key_pages, value_pages, causal, 0.25))


@pytest.mark.parametrize("window", [None, 6])
def test_verify_rows_share_one_padded_call_and_match_reference(window):
    """Rows of a few tokens (verify rows: chains, and trees when no window) share one padded call beside the decode
    rows' call and a long prefill chunk's own call; padding queries and keys never reach the result."""
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    rows = [(7, 1), (10, 4), (2, 3), (30, 4), (5, 40), (0, 2), (19, 1)]
    masks = [None, None if window else tree, None, None if window else tree, None, None, None]
    query, key_pages, value_pages, view = ragged_case(rows, 3, seed=5, masks=masks)
    got = ragged_attention(query, key_pages, value_pages, view, 0.25, None, window)
    expected = reference_ragged_attention(query, key_pages, value_pages, view, 0.25, None, window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **TOL)
    groups = attention._groups(view, window, query.device)
    padded = [g for g in groups if g.valid is not None]
    assert len(padded) == 1 and padded[0].valid.sum(dim=1).tolist() == [4, 3, 4, 2]
    assert sum(g.valid is None and not g.batched for g in groups) == 1  # the 40-token chunk alone


def test_tree_mask_on_a_sliding_window_layer_is_refused():
    tree = torch.ones(2, 2, dtype=torch.bool).tril()
    query, key_pages, value_pages, view = ragged_case([(3, 2)], 1, seed=0, masks=[tree])
    with pytest.raises(ValueError, match="sliding-window"):
        ragged_attention(query, key_pages, value_pages, view, 0.25, window=4)


@pytest.mark.parametrize("start,new,window", [(0, 5, None), (7, 3, None), (7, 3, 4), (2, 1, 2), (0, 6, 3)])
def test_row_mask_matches_the_element_by_element_mask(start, new, window):
    assert torch.equal(row_mask(start, new, window, None, torch.device("cpu")),
                       reference_row_mask(start, new, window, None))


# ---- decode rows grouped by length ----------------------------------------------------------------------
def partitions(items: list[int]):
    """Every set partition of ``items`` (the brute-force oracle of ``split_by_length``)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1:]]


def grouping_cost(groups, lengths, call_cost):
    return sum(call_cost + len(g) * max(lengths[r] for r in g) for g in groups)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("call_cost", [0, 5, 40, 1000])
def test_split_by_length_finds_the_cheapest_partition(seed, call_cost):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
    groups = split_by_length(lengths, call_cost)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)
    best = min(grouping_cost(p, lengths, call_cost) for p in partitions(list(range(len(lengths)))))
    assert grouping_cost(groups, lengths, call_cost) == best
    if call_cost >= 1000:
        assert len(groups) == 1  # a call costs more than any padding of these short rows


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_rows_split_into_several_calls_match_reference(groups, window, monkeypatch):
    """With calls free, every distinct decode length gets its own SDPA call (rows of one length share it,
    unmasked when no window applies); prefill rows sit between them in the packed order."""
    monkeypatch.setattr(attention, "CALL_COST_IN_KEY_ROWS", 0)
    rows = [(9, 1), (30, 1), (0, 5), (9, 1), (2, 1), (30, 1), (6, 3), (9, 1)]
    query, key_pages, value_pages, view = ragged_case(rows, groups, seed=5)
    got = ragged_attention(query, key_pages, value_pages, view, 0.25, None, window)
    expected = reference_ragged_attention(query, key_pages, value_pages, view, 0.25, None, window)
    torch.testing.assert_close(got, expected, **TOL)
    calls = attention._groups(view, window, torch.device("cpu"))
    batched = [g for g in calls if g.batched]
    assert [g.kv_length for g in batched] == [3, 10, 31]
    assert all((g.mask is None) == (window is None) for g in batched)


def test_one_decode_call_over_the_whole_run_is_returned_without_a_copy():
    rows = [(12, 1), (12, 1), (12, 1)]
    query, key_pages, value_pages, view = ragged_case(rows, 3, seed=7)
    got = ragged_attention(query, key_pages, value_pages, view, 0.25)
    torch.testing.assert_close(got, reference_ragged_attention(query, key_pages, value_pages, view, 0.25), **TOL)
    (group,) = attention._groups(view, None, torch.device("cpu"))
    assert group.mask is None and group.columns == slice(0, 3)


def test_the_reference_flag_routes_to_the_reference():
    rows = [(9, 1), (0, 6), (3, 1)]
    query, key_pages, value_pages, view = ragged_case(rows, 3, seed=8)
    flagged = dataclasses.replace(view, reference=True)
    assert torch.equal(ragged_attention(query, key_pages, value_pages, flagged, 0.25),
                       reference_ragged_attention(query, key_pages, value_pages, view, 0.25))
