"""Candidate trees: exact mask, positions, paths and keep indices for hand-written trees; static choice lists;
EAGLE-2 dynamic growth against a plain-Python reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_kvspec.speculative.tree import (
    DEFAULT_CHOICES,
    SMALL_CHOICES,
    CandidateTree,
    StaticTree,
    best_choices,
    grow_dynamic_tree,
    grow_static_tree,
    keep_indices,
    static_tree,
    tree_depth,
)

# the module docstring's worked example
PARENTS = torch.tensor([-1, -1, 0, 0, 2])


def _example(batch: int = 1) -> CandidateTree:
    return CandidateTree.build(torch.arange(10, 10 + 5).expand(batch, 5), PARENTS)


def test_worked_example_mask_positions_paths():
    tree = _example()
    assert tree.depth.tolist() == [[1, 1, 2, 2, 3]]
    expected = torch.tensor([
        [0, 1, 1, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 0, 1, 0, 0],
        [0, 1, 1, 1, 1, 0, 0, 1, 0],
        [0, 1, 1, 1, 1, 0, 1, 0, 1],
    ], dtype=torch.bool)
    mask = tree.attention_mask(torch.tensor([[0, 1, 1]]))
    assert mask.shape == (1, 1, 6, 9) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)
    additive = tree.attention_mask(torch.tensor([[0, 1, 1]]), dtype=torch.float32)
    assert torch.equal(additive[0, 0] == 0, expected)
    assert float(additive.min()) == torch.finfo(torch.float32).min
    assert tree.position_ids(torch.tensor([2])).tolist() == [[2, 3, 3, 4, 4, 5]]
    assert tree.paths().tolist() == [[[0, -1, -1], [1, -1, -1], [0, 2, -1], [0, 3, -1], [0, 2, 4]]]
    assert keep_indices(torch.tensor([[0, 2, 4]])).tolist() == [[0, 1, 3, 5]]


def test_per_row_trees_and_holes():
    # row 0: the example; row 1: a chain of 5; row 1's prefix has a hole in the middle
    parents = torch.stack([PARENTS, torch.tensor([-1, 0, 1, 2, 3])])
    tree = CandidateTree.build(torch.zeros(2, 5, dtype=torch.long), parents)
    assert tree.depth.tolist() == [[1, 1, 2, 2, 3], [1, 2, 3, 4, 5]]
    mask = tree.attention_mask(torch.tensor([[0, 1, 1], [1, 0, 1]]))
    chain = torch.ones(6, 6, dtype=torch.bool).tril()  # root + chain nodes: plain causal
    assert torch.equal(mask[1, 0, :, 3:], chain)
    assert mask[1, 0, :, :3].tolist() == [[True, False, True]] * 6
    assert tree.position_ids(torch.tensor([2, 7])).tolist() == [[2, 3, 3, 4, 4, 5], [7, 8, 9, 10, 11, 12]]
    assert tree.paths()[1, 4].tolist() == [0, 1, 2, 3, 4]
    assert tree.paths().shape == (2, 5, 5)
    assert tree.shared_parents().shape == (2, 5)
    assert _example(3).shared_parents().tolist() == PARENTS.tolist()
    # a row that kept one node repeats it; a row that kept none repeats the root
    assert keep_indices(torch.tensor([[3, -1, -1], [-1, -1, -1]])).tolist() == [[0, 4, 4, 4], [0, 0, 0, 0]]


def _ancestors_reference(parents: list[int]) -> list[set[int]]:
    out = []
    for n in range(len(parents)):
        path, node = set(), n
        while node >= 0:
            path.add(node)
            node = parents[node]
        out.append(path)
    return out


def test_random_trees_against_a_plain_walk():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        size = int(torch.randint(1, 12, (1,), generator=gen))
        parents = torch.tensor([int(torch.randint(-1, n, (1,), generator=gen)) if n else -1 for n in range(size)])
        tree = CandidateTree.build(torch.zeros(1, size, dtype=torch.long), parents)
        reference = _ancestors_reference(parents.tolist())
        mask = tree.attention_mask(torch.ones(1, 2))[0, 0, 1:, 3:]
        for n in range(size):
            assert set(mask[n].nonzero().reshape(-1).tolist()) == reference[n]
            path = [m for m in tree.paths()[0, n].tolist() if m >= 0]
            assert path == sorted(reference[n]) and len(path) == int(tree.depth[0, n])


def test_non_topological_parents_are_refused():
    with pytest.raises(ValueError, match="topologically"):
        tree_depth(torch.tensor([-1, 2, 0]))


def test_static_tree_from_choices():
    tree = StaticTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.rank.tolist() == [0, 1, 0, 1, 0, 0]
    assert tree.max_rank == 2 and tree.max_depth == 3
    # ranked [B, D, R]: per depth the ids best first
    ranked = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    cand = tree.candidates(ranked)
    assert cand.tokens.tolist() == [[10, 11, 20, 21, 20, 30]]
    assert tree.truncate(3).choices == ((0,), (1,), (0, 0))
    # an order where a child precedes its parent is sorted by length; a missing prefix is refused
    assert StaticTree.from_choices([(0, 0), (0,)]).parents.tolist() == [-1, 0]
    with pytest.raises(ValueError, match="no parent"):
        StaticTree.from_choices([(0,), (1, 0)])
    assert StaticTree.chain(3).parents.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("choices", [SMALL_CHOICES, DEFAULT_CHOICES])
def test_shipped_choice_lists_are_trees_best_first(choices):
    tree = static_tree("small" if choices is SMALL_CHOICES else "default", 4)
    assert tree.choices == tuple(choices)  # already in a valid order: every prefix of the list is a tree
    assert tree.max_depth <= 4  # the bundled Medusa heads have 4 heads
    assert 8 <= tree.num_nodes <= 32


def _markov_logprobs(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, vocab, generator=gen) * 2, dim=-1)  # [V, V] row = last token


def _markov_expand(table, calls):
    def expand(tokens, parent_slot):
        calls.append((tokens.clone(), parent_slot.clone()))
        return table[tokens]  # [B, m, V] children depend on the node's own token
    return expand


def _dynamic_reference(root_row, table, depth, top_k, total):
    """Plain-Python EAGLE-2 for one row: (score, level, index) sort with explicit lists."""
    level = [(float(s), int(t), -1) for s, t in zip(*root_row.topk(top_k))]  # (score, token, parent pool id)
    pool = list(level)
    frontier = list(range(top_k))
    for _ in range(depth - 1):
        candidates = []
        for pid in frontier:
            score, token, _ = pool[pid]
            values, ids = table[token].topk(top_k)
            candidates += [(score + float(v), int(i), pid) for v, i in zip(values, ids)]
        order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][0], i))
        frontier = [len(pool) + i for i in order[:top_k]]
        pool += candidates
    keep = sorted(sorted(range(len(pool)), key=lambda i: (-pool[i][0], i))[:total])
    new = {old: n for n, old in enumerate(keep)}
    return [pool[i][1] for i in keep], [new[pool[i][2]] if pool[i][2] >= 0 else -1 for i in keep]


@pytest.mark.parametrize("depth,top_k,total", [(1, 3, 2), (3, 2, 5), (4, 3, 12), (3, 3, 100)])
def test_dynamic_tree_matches_reference(depth, top_k, total):
    vocab = 11
    table = _markov_logprobs(vocab, 1)
    root = table[torch.tensor([0, 5, 9])]  # three rows, different trees
    calls = []
    tree = grow_dynamic_tree(root, _markov_expand(table, calls), depth, top_k, total)
    assert len(calls) == depth - 1
    for row in range(3):
        tokens, parents = _dynamic_reference(root[row], table, depth, top_k, total)
        assert tree.tokens[row].tolist() == tokens
        assert tree.parents[row].tolist() == parents
    pool = top_k + (depth - 1) * top_k ** 2
    assert tree.num_nodes == min(total, pool)
    assert bool((tree.parents < torch.arange(tree.num_nodes)).all())


def test_dynamic_tree_ties_keep_the_tree_connected():
    # every child log-prob 0 or -inf: many equal cumulative scores; parents must still be kept
    vocab = 6
    table = torch.full((vocab, vocab), float("-inf"))
    table[:, 0] = 0.0
    table[:, 1] = 0.0
    tree = grow_dynamic_tree(table[:1], _markov_expand(table, []), depth=4, top_k=2, total_tokens=7)
    for row_parents in tree.parents.tolist():
        for n, p in enumerate(row_parents):
            assert p < n
    assert tree.depth.max() >= 2


def test_static_growth_feeds_only_nodes_with_children():
    vocab = 9
    table = _markov_logprobs(vocab, 2)
    tree = StaticTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    root = table[torch.tensor([3, 4])]
    calls = []
    cand = grow_static_tree(root, _markov_expand(table, calls), tree)
    assert [c[0].shape[1] for c in calls] == [2, 1]  # level 1: nodes 0 and 1; level 2: node 2 only
    assert calls[0][1].tolist() == [[-1, -1]] * 2 and calls[1][1].tolist() == [[0]] * 2
    for row in range(2):
        rank = lambda logp, r: int(logp.argsort(descending=True)[r])  # noqa: E731
        n0, n1 = rank(root[row], 0), rank(root[row], 1)
        n2, n3, n4 = rank(table[n0], 0), rank(table[n0], 1), rank(table[n1], 0)
        assert cand.tokens[row].tolist() == [n0, n1, n2, n3, n4, rank(table[n2], 0)]
    chain = grow_static_tree(root, _markov_expand(table, []), StaticTree.chain(3))
    assert chain.parents[0].tolist() == [-1, 0, 1]


def test_every_prefix_of_a_value_ordered_list_is_a_tree():
    for n in range(1, len(DEFAULT_CHOICES) + 1):
        StaticTree.from_choices(DEFAULT_CHOICES[:n])  # raises if a prefix were missing
    assert list(itertools.islice(DEFAULT_CHOICES, 1)) == [(0,)]


def test_best_choices_is_the_greedy_pick_and_a_tree():
    values = {(0,): 0.4, (1,): 0.1, (0, 0): 0.2, (0, 1): 0.1, (1, 0): 0.05, (0, 0, 0): 0.1}
    assert best_choices(values, 4) == ((0,), (0, 0), (1,), (0, 1))  # ties at 0.1: shallower first, then by rank
    for n in range(1, len(values) + 1):
        StaticTree.from_choices(best_choices(values, n))
