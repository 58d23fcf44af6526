"""Where Lookahead decoding's candidates come from: the bounded n-gram pool, the context lookup, and the merge of
candidates into one verification tree per row.

Boundary: integer tensor bookkeeping over token ids, every row at once (no Python loop over rows, so a batch of
100k rows costs a few tensor ops). No model, no cache; verification is the loop's (``rounds.py`` TreeRound).

Terms:
    n-gram      ``N`` consecutive tokens harvested from the lookahead window (``lookahead_window.py``); its first
                token is its key, the other ``N - 1`` its tail.
    pool        per row, at most ``capacity`` distinct n-grams, each with a stamp (when it was last added): a
                duplicate refreshes the stamp, a new n-gram takes the slot with the oldest stamp. ``lookup(root)``
                returns the tails of the most recent n-grams keyed by the root (the last committed token).
    candidate   a path of draft tokens after the root, ``-1`` padded: a pool tail, or the context continuation
                (what followed the latest earlier occurrence of the row's last 1..3 tokens, as prompt lookup).
    merge       candidates sharing a prefix share its nodes: ``[a, b, c]`` and ``[a, b, d]`` give nodes
                ``a -> b -> {c, d}``. Nodes are numbered by candidate, then depth: a node's parent belongs to
                the same or an earlier candidate, so the order is topological, and a cap on the node count keeps
                whole candidates, the first ones (the caller lists the most promising first).

Shapes: ``A`` rows, ``P`` pool capacity, ``N`` n-gram length, ``M`` n-grams added at once, ``C`` candidates,
``D`` candidate length, ``L`` history length, ``K`` nodes.
"""

from __future__ import annotations

import torch


class NgramPool:
    """Per-row bounded sets of n-grams (module docstring). Empty slots have stamp ``-1``."""

    def __init__(self, rows: int, capacity: int, ngram: int, device=None):
        if capacity < 1:
            raise ValueError(f"the n-gram pool needs room for at least one n-gram per row, got capacity={capacity}")
        self.grams = torch.zeros(rows, capacity, ngram, dtype=torch.long, device=device)  # [A, P, N]
        self.stamp = torch.full((rows, capacity), -1, dtype=torch.long, device=device)  # [A, P]
        self.clock = 0

    @property
    def sizes(self) -> torch.Tensor:
        """``[A]`` n-grams held per row."""
        return (self.stamp >= 0).sum(dim=1)

    def add(self, grams: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add ``grams`` [A, M, N] (``valid`` [A, M] bool: which to add; default all): a duplicate of a held or of
        an earlier given n-gram refreshes that one; new n-grams replace the oldest."""
        rows, count, _ = grams.shape
        valid = torch.ones(rows, count, dtype=torch.bool, device=grams.device) if valid is None else valid.clone()
        stamps = self.clock + torch.arange(count, device=grams.device).expand(rows, count)  # later columns newer
        self.clock += count
        repeat = (grams[:, :, None] == grams[:, None]).all(-1) & valid[:, None]  # [A, M, M]
        valid &= ~(repeat & torch.ones(count, count, dtype=torch.bool, device=grams.device).tril(-1)).any(-1)
        held = (grams[:, :, None] == self.grams[:, None]).all(-1) & (self.stamp >= 0)[:, None]  # [A, M, P]
        held &= valid[..., None]
        refreshed = torch.where(held, stamps[..., None], -1).amax(dim=1)  # [A, P]
        self.stamp = torch.maximum(self.stamp, refreshed)
        new = valid & ~held.any(-1)  # [A, M]
        rank = new.long().cumsum(dim=1) - 1  # the i-th new n-gram of a row takes its i-th oldest slot
        oldest = self.stamp.argsort(dim=1, stable=True)  # [A, P] (empty slots first)
        write = new & (rank < self.stamp.shape[1])
        row, column = write.nonzero(as_tuple=True)
        slot = oldest[row, rank[row, column]]
        self.grams[row, slot] = grams[row, column]
        self.stamp[row, slot] = stamps[row, column]

    def lookup(self, keys: torch.Tensor, count: int) -> torch.Tensor:
        """Tails ``[A, count, N - 1]`` of the ``count`` most recent n-grams whose first token is ``keys`` [A];
        ``-1`` where a row has fewer."""
        rows, capacity, ngram = self.grams.shape
        count = min(count, capacity)
        match = (self.stamp >= 0) & (self.grams[:, :, 0] == keys[:, None])
        recency, slot = torch.where(match, self.stamp, -1).topk(count, dim=1)  # [A, count]
        tails = self.grams.gather(1, slot[..., None].expand(rows, count, ngram))[:, :, 1:]
        return torch.where((recency >= 0)[..., None], tails, -1)

    def select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.grams.device)
        self.grams, self.stamp = self.grams[index], self.stamp[index]


def context_continuation(ids: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor, max_match: int,
                         count: int) -> torch.Tensor:
    """Prompt lookup for every row at once: up to ``count`` tokens that followed the latest earlier occurrence of
    the row's last ``n`` tokens (``n = max_match..1``, longest first), ``-1`` padded -> ``[A, count]``.

    ``ids`` [A, L] rows as plain generate sees them (``lengths`` [A] real lengths, ``first`` [A] left padding);
    the reference is ``ngram.lookup_continuation`` row by row (a test compares them)."""
    rows, width = ids.shape
    device = ids.device
    start = torch.full((rows,), -1, dtype=torch.long, device=device)
    for n in range(min(max_match, width - 1), 0, -1):
        tail = ids.gather(1, (lengths[:, None] - n + torch.arange(n, device=device)).clamp_min(0))  # [A, n]
        windows = ids.unfold(1, n, 1)  # [A, L - n + 1, n]: window i is ids[:, i:i + n]
        at = torch.arange(windows.shape[1], device=device)
        hit = (windows == tail[:, None]).all(-1) & (at >= first[:, None]) & (at + n < lengths[:, None])
        latest = torch.where(hit, at, -1).amax(dim=1)
        start = torch.where((start < 0) & (latest >= 0) & (lengths - first > n), latest + n, start)
    columns = start[:, None] + torch.arange(count, device=device)  # [A, count]
    found = (start[:, None] >= 0) & (columns < lengths[:, None])
    return torch.where(found, ids.gather(1, columns.clamp(0, width - 1)), -1)


def merge_candidates(candidates: torch.Tensor, filler: torch.Tensor,
                     max_nodes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``candidates`` [A, C, D] (``-1`` padded; a token after a ``-1`` is ignored) -> ``(tokens [A, K], parents
    [A, K])``: one tree per row, shared prefixes merged, nodes numbered by candidate then depth (topological),
    at most ``max_nodes``. Rows with fewer nodes are padded with children of the root carrying ``filler`` [A]
    (verified like any node: exact, only wasted)."""
    rows, width, depth = candidates.shape
    device = candidates.device
    real = (candidates >= 0).long().cumprod(dim=2).bool()  # [A, C, D] every token of the prefix is real
    same = (candidates[:, :, None] == candidates[:, None]).long().cumprod(dim=3).bool()  # [A, C, C', D]
    same &= real[:, :, None] & real[:, None]
    first = same.long().argmax(dim=2)  # [A, C, D] first candidate with the same prefix: the node's owner
    owns = real & (first == torch.arange(width, device=device)[None, :, None])
    order = owns.reshape(rows, width * depth)  # by candidate, then depth
    numbered = (order.long().cumsum(dim=1) - 1).view(rows, width, depth)  # [A, C, D]
    node = numbered.gather(1, first)  # [A, C, D] node id of every real (candidate, depth)
    parent = torch.cat([node.new_full((rows, width, 1), -1), node[:, :, :-1]], dim=2)
    count = int(order.sum(dim=1).max()) if rows else 0
    count = count if max_nodes is None else min(count, max_nodes)
    tokens = filler[:, None].expand(rows, count).clone()
    parents = torch.full((rows, count), -1, dtype=torch.long, device=device)
    keep = owns & (numbered < count)
    row = torch.arange(rows, device=device)[:, None, None].expand_as(keep)[keep]
    tokens[row, numbered[keep]] = candidates[keep]
    parents[row, numbered[keep]] = parent[keep]
    return tokens, parents
