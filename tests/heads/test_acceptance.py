"""Chain-walk bookkeeping against hand-worked examples."""

from __future__ import annotations

import torch

from hf_kvspec.heads.acceptance import AcceptanceTally, chain_walk, leading_run


def _correct(rows: list[str]) -> torch.Tensor:
    """One string per head, one character per row: '1' right, '0' wrong -> [K, T] bool."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_leading_run():
    assert leading_run([True, True, False, True]) == 2
    assert leading_run([False, True]) == 0
    assert leading_run([]) == 0


def test_chain_walk_by_hand():
    # rows 0..6; head 0 (token t+2), head 1 (token t+3)
    correct = _correct(["1101111", "1001111"])
    # t=0: both heads right -> emit 3, continue at t=3; t=3: both right -> emit 3, t=6;
    # t=6 is the last row: no draft fits inside the response -> emit the target's token only. 7 tokens, 3 forwards.
    assert chain_walk(correct, start=0, end=6) == (7, 3)


def test_chain_walk_all_wrong_is_one_token_per_forward():
    correct = torch.zeros(3, 10, dtype=torch.bool)
    assert chain_walk(correct, 2, 8) == (7, 7)


def test_chain_walk_never_drafts_past_the_end():
    correct = torch.ones(4, 6, dtype=torch.bool)
    # rows 0..4: t=0 may use min(4, 4) heads -> emit 5 tokens (1..5) and stop
    assert chain_walk(correct, 0, 4) == (5, 1)


def test_tally_counts_only_drafts_inside_the_response():
    tally = AcceptanceTally()
    correct = _correct(["110011", "100001"])
    tally.add(correct, start=1, end=4)
    # head 0: rows 1..3 (row 4's head-0 draft is token 6, past the end) -> hits rows 1,3? '1','0','0' -> 1 of 3
    # head 1: rows 1..2 -> '0','0' -> 0 of 2
    assert tally.hits == [1, 0] and tally.counts == [3, 2]
    assert tally.per_head_top1 == [1 / 3, 0.0]
    # walk: t=1 head0 right, head1 wrong -> emit 2, t=3: head0 '0' -> emit 1, t=4: usable 0 -> emit 1
    assert (tally.emitted, tally.forwards) == (4, 3)
    assert tally.tau == 4 / 3
