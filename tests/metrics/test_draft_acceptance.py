"""draft_acceptance on hand-made inputs with known answers, and against a plain walk over correct-matrices."""

from __future__ import annotations

import random

import pytest

from hf_kvspec import load_metric
from hf_kvspec.metrics.draft_acceptance import acceptance


def _example(rows: list[str]) -> tuple[list[list[int]], list[int]]:
    """One string per depth, one character per response step: '1' right, '0' wrong -> (predictions, references).

    references are distinct ids; a right draft at (k, t) is references[t + k + 1], a wrong one -1."""
    n = len(rows[0])
    references = [1000 + t for t in range(n)]
    predictions = [[references[t + k + 1] if t + k + 1 < n and row[t] == "1" else -1 for t in range(n)]
                   for k, row in enumerate(rows)]
    return predictions, references


def _chain(*examples: list[str]) -> dict:
    pairs = [_example(rows) for rows in examples]
    return load_metric("draft_acceptance", keep_in_memory=True).compute(
        predictions=[p for p, _ in pairs], references=[r for _, r in pairs])


def test_chain_walk_by_hand():
    # steps 0..6; depth 0 guesses step t+1, depth 1 step t+2.
    # t=0: both right -> emit 3, continue at t=3; t=3: both right -> emit 3, t=6;
    # t=6 is the last step: no draft lands inside the response -> the target's token only. 7 tokens, 3 forwards.
    result = _chain(["1101111", "1001111"])
    assert (result["emitted_tokens"], result["target_forwards"]) == (7, 3) and result["tau"] == 7 / 3


def test_all_wrong_is_one_token_per_forward():
    result = _chain(["0" * 7] * 3)
    assert (result["emitted_tokens"], result["target_forwards"]) == (7, 7) and result["tau"] == 1.0
    assert result["per_head_top1"] == [0.0, 0.0, 0.0]


def test_never_drafts_past_the_end():
    # 5 steps, depth 4, all right: t=0 may use min(4, 4) drafts -> emit all 5 tokens in one forward
    result = _chain(["11111"] * 4)
    assert (result["emitted_tokens"], result["target_forwards"]) == (5, 1)


def test_counts_only_drafts_inside_the_response():
    result = _chain(["1001", "0000"])
    # depth 0 scores steps 0..2 ('100' -> 1 of 3); depth 1 steps 0..1 ('00' -> 0 of 2)
    assert result["positions"] == [3, 2] and result["per_head_top1"] == [1 / 3, 0.0]
    # walk: t=0 depth 0 right, depth 1 wrong -> emit 2, t=2: '0' -> emit 1, t=3: no usable draft -> emit 1
    assert (result["emitted_tokens"], result["target_forwards"]) == (4, 3) and result["tau"] == 4 / 3


def _plain_reference(examples: list[list[list[bool]]]) -> tuple[list[float], float]:
    """Per-depth top-1 and chain tau straight from correct[k][t] matrices (t + k + 1 < n is a scored draft)."""
    depth = len(examples[0])
    hits, counts, emitted, forwards = [0] * depth, [0] * depth, 0, 0
    for correct in examples:
        n = len(correct[0])
        for k in range(depth):
            scored = [correct[k][t] for t in range(n) if t + k + 1 < n]
            hits[k], counts[k] = hits[k] + sum(scored), counts[k] + len(scored)
        t = 0
        while t < n:
            accepted = 0
            while accepted < depth and t + accepted + 1 < n and correct[accepted][t]:
                accepted += 1
            emitted, forwards, t = emitted + accepted + 1, forwards + 1, t + accepted + 1
    return [h / c for h, c in zip(hits, counts)], emitted / forwards


@pytest.mark.parametrize("seed", range(5))
def test_random_matrices_match_a_plain_walk(seed):
    rng = random.Random(seed)
    examples = [[[rng.random() < 0.6 for _ in range(n)] for _ in range(4)] for n in (rng.randint(5, 40) for _ in range(6))]
    result = _chain(*[["".join("1" if c else "0" for c in row) for row in correct] for correct in examples])
    top1, tau = _plain_reference(examples)
    assert result["per_head_top1"] == top1 and result["tau"] == tau  # exact: both are ratios of the same integers


def test_add_batch_accumulates_like_one_compute():
    pairs = [_example(["110101", "100100"]), _example(["0111", "1010"]), _example(["11011", "01101"])]
    metric = load_metric("draft_acceptance", keep_in_memory=True)
    metric.add(predictions=pairs[0][0], references=pairs[0][1])
    metric.add_batch(predictions=[p for p, _ in pairs[1:]], references=[r for _, r in pairs[1:]])
    assert metric.compute() == acceptance([[[[d] for d in row] for row in p] for p, _ in pairs], [r for _, r in pairs])


def test_tree_walk_by_hand():
    # 6 steps, depth 2, two ranked candidates per draft. Rank of the right token (-1: not among the candidates):
    #   t        0   1   2   3   4
    #   depth 0  1   0  -1   1   0
    #   depth 1  0   1   0  -1
    ranks = [[1, 0, -1, 1, 0], [0, 1, 0, -1]]
    references = list(range(100, 106))
    predictions = [[_candidates(ranks[k][t], references[t + k + 1]) if t < len(ranks[k]) else [-1, -1]
                    for t in range(6)] for k in range(2)]
    tree = [[0], [1], [0, 0], [1, 0]]  # two first guesses, the best child under each
    result = load_metric("draft_acceptance", "tree", keep_in_memory=True).compute(
        predictions=[predictions], references=[references], tree=tree)
    # chain (rank 0 only): t=0 a=0; t=1 a=1; t=3 a=0; t=4 a=1 -> 4 forwards
    assert result["target_forwards"] == 4 and result["tau"] == 6 / 4
    # tree: t=0 ranks (1, 0) is a node -> a=2; t=3 (1, -1) -> a=1; t=5 nothing usable -> 3 forwards
    assert result["tree_target_forwards"] == 3 and result["tree_tau"] == 2.0
    assert result["per_head_top1"] == [2 / 5, 2 / 4] and result["per_head_topk"] == [4 / 5, 3 / 4]


def _candidates(rank: int, right: int) -> list[int]:
    guesses = [900, 901]
    if rank >= 0:
        guesses[rank] = right
    return guesses


def test_tree_of_best_guesses_is_the_chain():
    predictions, references = _example(["1101101", "1011001", "0110111"])
    ranked = [[[d, -7] for d in row] for row in predictions]
    chain = [[0], [0, 0], [0, 0, 0]]
    result = load_metric("draft_acceptance", "tree", keep_in_memory=True).compute(
        predictions=[ranked], references=[references], tree=chain)
    assert result["tree_target_forwards"] == result["target_forwards"] == _chain(
        ["1101101", "1011001", "0110111"])["target_forwards"]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="one draft"):
        load_metric("draft_acceptance", keep_in_memory=True).compute(predictions=[[[1, 2]]], references=[[1, 2, 3]])
    with pytest.raises(ValueError, match="every prefix"):
        acceptance([[[[1]], [[2]]]], [[1]], tree=[[0, 0]])
    with pytest.raises(ValueError, match="'chain' or 'tree'"):
        load_metric("draft_acceptance", "beam")


def test_negative_reference_ids_are_refused():
    """-1 pads predictions; in references it matched every -1 draft (all -1 -> top-1 1.0, tau 1.5)."""
    with pytest.raises(ValueError, match=r"references\[0\]\[1\] = -1.*token ids >= 0"):
        load_metric("draft_acceptance", keep_in_memory=True).compute(predictions=[[[-1, -1, -1]]],
                                                                     references=[[5, -1, 7]])


def test_an_empty_response_is_refused():
    with pytest.raises(ValueError, match=r"references\[1\] is empty.*drop"):
        acceptance([[[[1]], [[2]]], [[], []]], [[1, 2], []])


@pytest.mark.parametrize("tree,words", [
    ([[0], [0, 0], [0, 0, 0]], r"3 deep.*2 depths"),
    ([[0], [2]], r"rank 2.*2 candidates"),
])
def test_tree_paths_beyond_the_predictions_are_refused(tree, words):
    """Depth-3 paths over depth-2 predictions, or rank 2 over 2-candidate lists, could never be walked: they were
    silently ignored, so a typo in the tree went unnoticed."""
    predictions = [[[[11, 12], [12, 13], [-1, -1]], [[12, 13], [-1, -1], [-1, -1]]]]  # [responses][K=2][n=3][2]
    with pytest.raises(ValueError, match=words):
        load_metric("draft_acceptance", "tree", keep_in_memory=True).compute(
            predictions=predictions, references=[[10, 11, 12]], tree=tree)
