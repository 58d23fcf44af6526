"""Candidate trees as data: token ids + parent indices + depth per row, and what a target forward needs from them.

Boundary: pure tensor bookkeeping. A tree comes in (from a static choice list, or grown by a drafter through a
callback), and out come the 4D attention mask, the position ids, each node's path and the indices to keep after
acceptance. No model, no cache, no sampling; verification rules live in ``verify.py``.

Terms:
    root        the last committed token. It is fed to the target together with the tree (column ``S`` of the
                mask, right after the ``S`` committed cache slots), and its logits score the depth-1 nodes.
    node n      a draft token; ``parents[b, n]`` is its parent node (``-1`` = child of the root), topologically
                ordered (``parents[b, n] < n``), ``depth[b, n]`` its 1-based distance from the root.
    path        the nodes from the root down to a node, inclusive; accepting a node accepts its whole path.
    choice      Medusa's notation for a node of a static tree (Cai et al. 2401.10774): a tuple of top-k ranks,
                one per depth; ``(0, 1)`` = the second-best child of the best depth-1 node.

Worked example, one row, S = 3 committed slots (slot 0 is left padding), root at position 2::

    root                                     parents = [-1, -1, 0, 0, 2]
    |-- n0 (depth 1)                         depth   = [ 1,  1, 2, 2, 3]
    |   |-- n2 (depth 2)
    |   |   `-- n4 (depth 3)
    |   `-- n3 (depth 2)
    `-- n1 (depth 1)

    attention_mask(prefix_mask=[[0, 1, 1]])[0, 0]   (True = attend; rows = queries, columns = keys)
                s0 s1 s2 | root | n0 n1 n2 n3 n4
        root:    0  1  1 |   1  |  0  0  0  0  0
        n0:      0  1  1 |   1  |  1  0  0  0  0
        n1:      0  1  1 |   1  |  0  1  0  0  0
        n2:      0  1  1 |   1  |  1  0  1  0  0
        n3:      0  1  1 |   1  |  1  0  0  1  0
        n4:      0  1  1 |   1  |  1  0  1  0  1
    position_ids(root_position=[2])  = [[2, 3, 3, 4, 4, 5]]          (root, then root + depth)
    paths()[0]                        = [[0, -1, -1], [1, -1, -1], [0, 2, -1], [0, 3, -1], [0, 2, 4]]
    accepted path n0 -> n2 -> n4: keep_indices([[0, 2, 4]]) = [[0, 1, 3, 5]]   (root, then node + 1)

Static topologies (``StaticTree``) are shared by every row; the EAGLE-2 dynamic tree (``grow_dynamic_tree``, Li et
al. 2406.16858) differs per row. Both produce a ``CandidateTree``.

Shapes: ``B`` rows, ``N`` nodes, ``S`` committed cache slots, ``D`` maximum depth, ``V`` vocabulary,
``k`` top-k (children per expanded node).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_kvspec.masking import additive_mask


def tree_depth(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` (or ``[N]``) parents -> 1-based depth of the same shape; refuses a non-topological order."""
    nodes = torch.arange(parents.shape[-1], device=parents.device)
    if bool((parents >= nodes).any()) or bool((parents < -1).any()):
        raise ValueError("parents must be topologically ordered: -1 <= parents[..., n] < n for every node n.")
    flat = parents.reshape(-1, parents.shape[-1])  # [B, N]
    depth = torch.zeros_like(flat)
    for n in range(flat.shape[1]):
        parent = flat[:, n]
        above = depth.gather(1, parent.clamp_min(0)[:, None]).squeeze(1)
        depth[:, n] = torch.where(parent < 0, 1, above + 1)
    return depth.reshape(parents.shape)


@dataclass(frozen=True)
class CandidateTree:
    """One candidate tree per row; a static topology is shared by expanding ``parents`` over the rows."""

    tokens: torch.Tensor  # [B, N] draft token ids
    parents: torch.Tensor  # [B, N] parent node, -1 = child of the root; parents[b, n] < n
    depth: torch.Tensor  # [B, N] 1-based

    @classmethod
    def build(cls, tokens: torch.Tensor, parents: torch.Tensor) -> CandidateTree:
        """``tokens`` [B, N] and ``parents`` [N] (shared) or [B, N] (per row); computes the depths."""
        parents = parents.to(tokens.device).expand(tokens.shape).contiguous()
        return cls(tokens, parents, tree_depth(parents))

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.numel() else 0

    def shared_parents(self) -> torch.Tensor:
        """``[N]`` when every row has the same topology (what a chain/static verifier path may use), else ``[B, N]``."""
        if self.parents.shape[0] > 0 and bool((self.parents == self.parents[:1]).all()):
            return self.parents[0]
        return self.parents

    def ancestors(self) -> torch.Tensor:
        """``[B, N, N]`` bool: ``[b, n, m]`` is True when node m is on node n's path (n itself included)."""
        batch, size = self.parents.shape
        seen = torch.zeros(batch, size, size, dtype=torch.bool, device=self.parents.device)
        own = torch.eye(size, dtype=torch.bool, device=self.parents.device)
        for n in range(size):
            parent = self.parents[:, n]
            inherited = seen[torch.arange(batch, device=parent.device), parent.clamp_min(0)]  # [B, N]
            seen[:, n] = (inherited & (parent >= 0)[:, None]) | own[n]
        return seen

    def attention_mask(self, prefix_mask: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """4D mask ``[B, 1, 1 + N, S + 1 + N]`` for one forward over the root and the N nodes.

        ``prefix_mask`` [B, S]: 1 = a real committed token, 0 = padding or a hole. Every query sees the real
        prefix and the root; a node also sees its ancestors and itself. ``dtype=torch.bool`` gives True = attend;
        a float dtype gives the additive form (0 = attend, the dtype's minimum = masked).
        """
        batch, size = self.tokens.shape
        prefix = prefix_mask.bool()[:, None, :].expand(batch, 1 + size, prefix_mask.shape[1])  # [B, 1+N, S]
        root = torch.ones(batch, 1 + size, 1, dtype=torch.bool, device=prefix.device)  # [B, 1+N, 1]
        nodes = torch.cat([torch.zeros(batch, 1, size, dtype=torch.bool, device=prefix.device),
                           self.ancestors()], dim=1)  # [B, 1+N, N]
        allowed = torch.cat([prefix, root, nodes], dim=2)[:, None]  # [B, 1, 1+N, S+1+N]
        return allowed if dtype == torch.bool else additive_mask(allowed, dtype)

    def position_ids(self, root_position: torch.Tensor) -> torch.Tensor:
        """``root_position`` [B] -> ``[B, 1 + N]``: the root's position, then root position + depth per node."""
        return torch.cat([root_position[:, None], root_position[:, None] + self.depth], dim=1)

    def paths(self) -> torch.Tensor:
        """``[B, N, D]``: node n's path as node indices from depth 1 down to n itself, ``-1`` padded."""
        width = self.max_depth
        batch, size = self.parents.shape
        out = torch.full((batch, size, width + 1), -1, dtype=torch.long, device=self.parents.device)
        node = torch.arange(size, device=self.parents.device).expand(batch, size)  # walk up from every node
        for _ in range(width):
            real = node >= 0
            level = torch.where(real, self.depth.gather(1, node.clamp_min(0)) - 1, width)  # spare column when done
            out.scatter_(2, level[..., None], node[..., None])
            node = torch.where(real, self.parents.gather(1, node.clamp_min(0)), -1)
        return out[..., :width]

    def select_rows(self, index: torch.Tensor) -> CandidateTree:
        """Rows ``index`` [A] of the tree."""
        return CandidateTree(self.tokens[index], self.parents[index], self.depth[index])


def keep_indices(accepted_nodes: torch.Tensor) -> torch.Tensor:
    """Accepted path ``[B, K]`` (node ids, ``-1`` past the row's accepted count, as ``VerifyResult.accepted_nodes``)
    -> ``[B, 1 + K]`` indices into the forward's ``1 + N`` new columns: the root (0), then node + 1.

    Ascending per row; a row that kept fewer repeats its last kept index, as the cache contract's
    ``keep_positions(start=S, indices)`` expects (the caller masks those holes).
    """
    root = accepted_nodes.new_zeros(accepted_nodes.shape[0], 1)
    return torch.cat([root, accepted_nodes + 1], dim=1).cummax(dim=1).values


# ---------------------------------------------------------------------------------------------- static trees
# Measured for the bundled SmolLM2-135M-Instruct Medusa heads by ``scripts/measure_tree_choices.py`` (counts and cost
# model committed in ``benchmarks/results/spec_tree_choices.json``): on the target's greedy answers to the 35
# held-out chat prompts, the fraction of positions where each rank tuple is right along its whole path (the chance
# greedy verification accepts that node), then ``best_choices`` per size. "small" (8 nodes, expected tau 1.71) is
# the size of best expected tau / (c_v(N + 1) + heads' draft cost) among 8..10 nodes under the measured CPU cost
# model (1 torch thread); "default" keeps the provisional lists' 26 nodes (expected tau 1.92, against 1.42 for the
# 4-node chain). On that CPU the cost model prefers 19 nodes among 11..32 (``DEFAULT_CHOICES[:19]``, expected tau
# 1.87) and 2 nodes overall (``[(0,), (1,)]``); hardware where extra verified nodes cost little (a GPU) would take
# ``best_choices`` of the committed counts at a larger size.
SMALL_CHOICES: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 0), (2,), (3,), (4,), (5,), (0, 1))
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    *SMALL_CHOICES, (7,), (0, 0, 0), (6,), (1, 0), (0, 2), (1, 1), (2, 0), (0, 3), (2, 1), (0, 0, 1), (0, 5),
    (0, 4), (0, 0, 0, 0), (1, 2), (3, 0), (0, 6), (1, 3), (0, 7),
)


def best_choices(values: Mapping[tuple[int, ...], float], num_nodes: int) -> tuple[tuple[int, ...], ...]:
    """The ``num_nodes`` choices of highest value, best first (ties: shallower, then lexicographic).

    With ``values[c]`` the measured chance that greedy verification accepts node ``c`` (the fraction of positions
    whose target tokens rank ``c`` in the heads), the expected accepted length of a tree is the sum of its nodes'
    values, so this greedy pick maximises it; measured values never grow along a path, so the pick is a tree.
    """
    ranked = sorted(values, key=lambda c: (-values[c], len(c), c))
    return tuple(ranked[:num_nodes])


@dataclass(frozen=True)
class StaticTree:
    """A topology shared by all rows, from a choice list; node n takes top-k rank ``rank[n]`` of its parent's
    candidates (Medusa: head ``depth[n] - 1``'s ranking; EAGLE: the drafter's ranking after the parent's path)."""

    choices: tuple[tuple[int, ...], ...]
    parents: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    rank: torch.Tensor  # [N]

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> StaticTree:
        """Nodes keep the given order when every choice's prefix comes earlier, else are stably sorted by length."""
        choices = _choice_tuples(choices)
        if len(set(choices)) != len(choices) or any(not c or min(c) < 0 for c in choices):
            raise ValueError("choices must be distinct non-empty tuples of non-negative top-k ranks, e.g. (0,), (0, 1).")
        index = {c: n for n, c in enumerate(choices)}
        if any(c[:-1] and index.get(c[:-1], len(choices)) > n for n, c in enumerate(choices)):
            choices = tuple(sorted(choices, key=len))
            index = {c: n for n, c in enumerate(choices)}
        missing = [c for c in choices if c[:-1] and c[:-1] not in index]
        if missing:
            raise ValueError(f"choice {missing[0]} has no parent {missing[0][:-1]} in the list; add every prefix.")
        parents = torch.tensor([index[c[:-1]] if len(c) > 1 else -1 for c in choices], dtype=torch.long)
        depth = torch.tensor([len(c) for c in choices], dtype=torch.long)
        rank = torch.tensor([c[-1] for c in choices], dtype=torch.long)
        return cls(choices, parents, depth, rank)

    @classmethod
    def chain(cls, length: int) -> StaticTree:
        return cls.from_choices([(0,) * d for d in range(1, length + 1)])

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return max(map(len, self.choices), default=0)

    @property
    def max_rank(self) -> int:
        """Largest rank used plus one: how many top-k candidates a proposer must rank."""
        return max((c[-1] for c in self.choices), default=-1) + 1

    def truncate(self, num_nodes: int) -> StaticTree:
        """The first ``num_nodes`` nodes (a tree, since parents come first)."""
        return self if num_nodes >= self.num_nodes else StaticTree.from_choices(self.choices[:num_nodes])

    def candidates(self, ranked: torch.Tensor) -> CandidateTree:
        """``ranked`` [B, D, R] token ids, best first, per depth (Medusa: head d's top-R) -> the tree's tokens."""
        tokens = ranked[:, self.depth - 1, self.rank]  # [B, N]
        return CandidateTree.build(tokens, self.parents.to(ranked.device))


def _choice_tuples(choices) -> tuple[tuple[int, ...], ...]:
    """A choice list as tuples of int ranks; refuses what is not one (a flat list, an empty one, float ranks)."""
    example = "e.g. tree=[(0,), (1,), (0, 0)] (or tree='chain')"
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) == 0:
        raise ValueError(f"a tree choice list needs at least one node, {example}; got {choices!r}.")
    bad = [c for c in choices if isinstance(c, (str, bytes)) or not isinstance(c, Sequence)
           or not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in c)]
    if bad:
        raise ValueError(f"each tree node is a tuple of int top-k ranks, one per depth ({example}); got {bad[0]!r} "
                         f"in {list(choices)!r}.")
    return tuple(tuple(int(r) for r in c) for c in choices)


def static_tree(tree: str | Sequence[Sequence[int]], chain_length: int) -> StaticTree:
    """``"small"``, ``"default"``, ``"chain"`` (``chain_length`` nodes) or a choice list."""
    if isinstance(tree, str):
        named = {"small": SMALL_CHOICES, "default": DEFAULT_CHOICES}
        if tree == "chain":
            return StaticTree.chain(chain_length)
        if tree not in named:
            raise ValueError(f"tree must be 'small', 'default', 'chain' or a choice list, got {tree!r}.")
        return StaticTree.from_choices(named[tree])
    return StaticTree.from_choices(tree)


# ---------------------------------------------------------------------------------------------- growing trees
#: ``expand(tokens [B, m], parent_slot [B, m]) -> log-probs [B, m, V]`` of the children of m fed nodes; parent_slot
#: is each node's parent among the *previous* call's fed nodes (-1: a child of the root). The drafter runs its model
#: over the fed nodes (each seeing its own ancestors) and returns next-token log-probabilities.
Expand = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def grow_static_tree(root_logprobs: torch.Tensor, expand: Expand, tree: StaticTree) -> CandidateTree:
    """Tokens of a static topology drafted level by level (EAGLE with a choice list): node n takes rank
    ``tree.rank[n]`` of its parent's ranking; only nodes with children are fed to ``expand``."""
    parents, depth, rank = (t.to(root_logprobs.device) for t in (tree.parents, tree.depth, tree.rank))
    batch = root_logprobs.shape[0]
    tokens = root_logprobs.new_zeros(batch, tree.num_nodes, dtype=torch.long)
    ranked = root_logprobs.topk(max(tree.max_rank, 1), dim=-1).indices[:, None]  # [B, 1, R] children of the root
    fed = torch.tensor([-1], device=root_logprobs.device)  # node ids of the last fed rows (the root: -1)
    for level in range(1, tree.max_depth + 1):
        here = (depth == level).nonzero().reshape(-1)  # [m] nodes of this level
        slot = (parents[here, None] == fed[None, :]).long().argmax(dim=1)  # [m] parent's row in the last call
        tokens[:, here] = ranked[:, slot, rank[here]]
        parent_of_next = parents[depth == level + 1]
        feed = here[torch.isin(here, parent_of_next)]  # nodes that have children
        if feed.numel() == 0:
            break
        feed_slot = slot[torch.isin(here, parent_of_next)]
        logprobs = expand(tokens[:, feed], torch.where(fed[feed_slot] < 0, -1, feed_slot).expand(batch, -1))
        ranked = logprobs.topk(tree.max_rank, dim=-1).indices  # [B, m, R]
        fed = feed
    return CandidateTree.build(tokens, parents)


def grow_dynamic_tree(root_logprobs: torch.Tensor, expand: Expand, depth: int, top_k: int,
                      total_tokens: int) -> CandidateTree:
    """EAGLE-2 dynamic tree (Li et al. 2406.16858), per row.

    Expansion: the root's top-k children form level 1; at each further level the ``top_k`` nodes of the previous
    level with the highest cumulative draft log-probability are fed to ``expand``, each contributes its top-k
    children (``top_k**2`` candidates). Re-ranking: the ``total_tokens`` nodes of all levels with the highest
    cumulative log-probability are kept. A child scores at most its parent (log-probabilities are <= 0) and ties
    go to the earlier level, then the lower index, so the kept nodes form a connected tree; they are re-indexed
    level by level (topological). ``root_logprobs`` [B, V] -> ``CandidateTree`` with ``min(total_tokens, pool)``
    nodes, where pool = ``top_k + (depth - 1) * top_k**2``. Deviation from the paper: no special cases for the
    root beyond it being fed already (its logits come from the catch-up forward).
    """
    return grow_dynamic_pool(root_logprobs, expand, depth, top_k).tree(total_tokens)


@dataclass(frozen=True)
class DynamicPool:
    """Every node an EAGLE-2 growth drafted, in level order (parents before children): ``scores`` (cumulative draft
    log-probabilities), ``tokens`` and ``parents`` (pool ids, ``-1`` = the root) ``[B, P]``; ``level`` ``[P]``
    1-based. The tree of a row is its best nodes (``tree``); a row's tree of fewer levels or nodes is the same
    re-ranking over the pool's shallower part (``row_tree``), so rows drafting different sizes grow together."""

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    level: torch.Tensor

    def tree(self, total_tokens: int) -> CandidateTree:
        """``[B, min(total_tokens, P)]``: every row's best nodes, re-indexed level by level."""
        return _rerank(self.scores, self.tokens, self.parents, total_tokens)

    def row_tree(self, row: int, total_tokens: int, depth: int) -> CandidateTree:
        """``[1, N]``: row ``row``'s best ``total_tokens`` nodes no deeper than ``depth``, exactly the tree
        ``grow_dynamic_tree`` grows for that row alone with ``depth`` levels (the frontier of a level does not
        depend on deeper levels)."""
        shallow = self.level <= depth  # [P]
        scores = self.scores[row:row + 1].masked_fill(~shallow, float("-inf"))
        total = min(total_tokens, int(shallow.sum()))
        return _rerank(scores, self.tokens[row:row + 1], self.parents[row:row + 1], total)


def grow_dynamic_pool(root_logprobs: torch.Tensor, expand: Expand, depth: int, top_k: int) -> DynamicPool:
    """The expansion of ``grow_dynamic_tree`` (``depth`` levels) without its re-ranking: the whole pool."""
    batch = root_logprobs.shape[0]
    device = root_logprobs.device
    scores, tokens = root_logprobs.topk(top_k, dim=-1)  # [B, k]
    pool_scores, pool_tokens = [scores], [tokens]
    pool_parents = [torch.full((batch, top_k), -1, dtype=torch.long, device=device)]
    levels = [torch.full((top_k,), 1, dtype=torch.long, device=device)]
    frontier = torch.arange(top_k, device=device).expand(batch, top_k)  # pool ids of the nodes to expand
    slot = torch.full((batch, top_k), -1, dtype=torch.long, device=device)
    offset = top_k
    for level in range(2, depth + 1):
        logprobs = expand(tokens, slot)  # [B, k, V]
        child_scores, child_tokens = logprobs.topk(top_k, dim=-1)  # [B, k, k]
        cumulative = (scores[..., None] + child_scores).flatten(1)  # [B, k*k]
        pool_scores.append(cumulative)
        pool_tokens.append(child_tokens.flatten(1))
        pool_parents.append(frontier.repeat_interleave(top_k, dim=1))
        levels.append(torch.full((cumulative.shape[1],), level, dtype=torch.long, device=device))
        best = _stable_top(cumulative, top_k)  # [B, k] next frontier, positions within this level
        scores, tokens = cumulative.gather(1, best), child_tokens.flatten(1).gather(1, best)
        frontier, slot = offset + best, best // top_k
        offset += cumulative.shape[1]
    return DynamicPool(torch.cat(pool_scores, 1), torch.cat(pool_tokens, 1), torch.cat(pool_parents, 1),
                       torch.cat(levels))


def _stable_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices [B, count] of the highest scores; ties go to the lower index (``torch.topk`` does not promise)."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :count]


def _rerank(scores, tokens, parents, total_tokens: int) -> CandidateTree:
    # pool [B, P] in level order (parents before children) -> the best total_tokens nodes, re-indexed
    keep = _stable_top(scores, min(total_tokens, scores.shape[1])).sort(dim=1).values  # [B, M] ascending pool ids
    new_index = torch.full_like(parents, -1).scatter_(1, keep, torch.arange(keep.shape[1], device=keep.device)
                                                     .expand_as(keep).contiguous())
    kept_parents = parents.gather(1, keep)
    remapped = torch.where(kept_parents < 0, -1, new_index.gather(1, kept_parents.clamp_min(0)))
    return CandidateTree.build(tokens.gather(1, keep), remapped)
