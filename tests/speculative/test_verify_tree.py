"""Per-row trees (``parents`` [B, N]) in the verifier: greedy against a brute-force search over every node's path,
sampling against the exact two-token target distribution.

Tolerance: 2 x 100k samples over 16 two-token outcomes; the expected TV of an exact sampler is about
sum_i sqrt(p_i / (2 pi n)) <= 4 / sqrt(2 pi 100k) ~ 0.005 per topology, so TV < 0.01 has a 2x margin.
"""

from __future__ import annotations

import torch

from hf_kvspec.speculative.verify import greedy_verify, rejection_verify

V = 4
N_SAMPLES = 100_000


def _random_parents(size: int, gen: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, n, (1,), generator=gen)) if n else -1 for n in range(size)]


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _greedy_reference(draft: list[int], target: list[int], parents: list[int]):
    """Deepest node whose every path node equals the target argmax at its parent (first in node order on ties)."""
    best = -1
    for n in range(len(draft)):
        path = _path(parents, n)
        if all(draft[m] == target[parents[m] + 1] for m in path) and len(path) > len(_path(parents, best)):
            best = n
    path = _path(parents, best)
    return len(path), path, target[best + 1]


def test_greedy_per_row_trees_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        batch, size = 5, int(torch.randint(1, 10, (1,), generator=gen))
        parents = torch.tensor([_random_parents(size, gen) for _ in range(batch)])
        draft = torch.randint(0, 3, (batch, size), generator=gen)  # 3 ids: matches are common
        target = torch.randint(0, 3, (batch, size + 1), generator=gen)
        result = greedy_verify(draft, target, parents)
        for row in range(batch):
            count, path, token = _greedy_reference(draft[row].tolist(), target[row].tolist(), parents[row].tolist())
            assert int(result.num_accepted[row]) == count, trial
            assert [m for m in result.accepted_nodes[row].tolist() if m >= 0] == path
            assert int(result.next_tokens[row]) == token
            alone = greedy_verify(draft[row:row + 1], target[row:row + 1], parents[row])  # the [N] form
            assert torch.equal(alone.num_accepted, result.num_accepted[row:row + 1])
            assert torch.equal(alone.next_tokens, result.next_tokens[row:row + 1])


def test_shared_parents_as_rows_give_the_same_result():
    gen = torch.Generator().manual_seed(1)
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    draft = torch.randint(0, 3, (8, 6), generator=gen)
    target = torch.randint(0, 3, (8, 7), generator=gen)
    shared, per_row = greedy_verify(draft, target, parents), greedy_verify(draft, target, parents.expand(8, 6))
    assert torch.equal(shared.num_accepted, per_row.num_accepted)
    assert torch.equal(shared.accepted_nodes, per_row.accepted_nodes)
    assert torch.equal(shared.next_tokens, per_row.next_tokens)
    chain = torch.arange(-1, 5).expand(8, 6)  # a per-row chain takes the chain fast path: same answer
    assert torch.equal(greedy_verify(draft, target, chain).num_accepted, greedy_verify(draft, target).num_accepted)


def _table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=gen) * 1.5, dim=-1)  # [V, V] p(next | previous)


def test_sampling_per_row_trees_with_siblings_keep_the_target_distribution():
    """Two topologies in one batch: (a) three siblings under the root, the first with two children; (b) one
    depth-1 node with two children, the first of which has two children. Point-mass drafts; tokens differ per row."""
    torch.manual_seed(0)
    table, start = _table(3), 2
    trees = [([-1, -1, -1, 0, 0], [0, 1, 3, 2, 1]), ([-1, 0, 0, 1, 1], [1, 0, 2, 3, 0])]
    parents = torch.tensor([trees[i % 2][0] for i in range(2 * N_SAMPLES)])  # [B, N] alternating topologies
    draft = torch.tensor([trees[i % 2][1] for i in range(2 * N_SAMPLES)])
    draft[1::4] = (draft[1::4] + 1) % V  # other tokens in some rows of each topology
    target_probs = torch.cat([table[start].expand(draft.shape[0], 1, V), table[draft]], dim=1)  # [B, N + 1, V]
    result = rejection_verify(draft, target_probs, None, parents)
    first = torch.where(result.num_accepted > 0, draft.gather(1, result.accepted_nodes[:, :1].clamp_min(0))[:, 0],
                        result.next_tokens)
    accepted_two = result.num_accepted >= 2
    second_drafted = draft.gather(1, result.accepted_nodes[:, 1:2].clamp_min(0))[:, 0]
    continuation = torch.multinomial(table[first], 1)[:, 0]  # the next round, drafting nothing, samples plainly
    second = torch.where(accepted_two, second_drafted,
                         torch.where(result.num_accepted == 1, result.next_tokens, continuation))
    exact = (table[start][:, None] * table).reshape(-1)  # [V * V] p(x1) p(x2 | x1)
    for topology in range(2):
        rows = torch.arange(topology, draft.shape[0], 2)
        pairs = first[rows] * V + second[rows]
        freq = torch.bincount(pairs, minlength=V * V).double() / rows.numel()
        assert 0.5 * float((freq - exact.double()).abs().sum()) < 0.01, topology
        assert {0, 1, 2} <= set(result.num_accepted[rows].unique().tolist())
