"""Automatic tree size: choose each round's tree shape (node count and depth) from running per-depth acceptance and
the verify cost measured per node count.

Boundary: pure bookkeeping over numbers the loop measures (``RoundOutcome``: nodes verified, accepted counts,
seconds) plus shape helpers for the tree assistants; no tensors of its own, no models.

Model (the tree form of ``autok.py``'s, Leviathan et al. 2211.17192 Sec. 3.3): a round with shape ``(N nodes, depth
D)`` emits ``1 + E[accepted]`` tokens per row, with ``E[accepted] = sum_{d=1..D} prod_{j<=d} a_j`` where ``a_j`` is
the chance that a row which kept depth ``j - 1`` keeps depth ``j`` (per shape: a wider tree accepts more at every
depth), and costs ``t_verify(N) + t_draft(shape)``. The controller picks the shape of the menu with the most tokens
per second; shape ``(0, 0)`` is a plain decoding step (one token, ``t_verify(0)``, no draft, measured once early on),
so it falls back to plain decoding when no tree pays, and re-probes the smallest tree every ``probe_every`` rounds.

Estimates (exponentially decayed, so they follow the text):
    a_j(shape)   accepted / offered at depth j for that shape, with a Beta(1, 1) prior, plus an optimism bonus
                 ``explore / sqrt(offered + 2)`` with ``offered`` counted without decay (UCB: a shape that was unlucky once is
                 tried again, and the bonus fades for good); at a depth a shape has not
                 been measured at, interpolated (linear in log nodes) between the measured shapes around it, or the
                 nearest one outside them; depths nobody reached repeat the deepest rate measured (optimistic: the
                 shape gets tried, then measured).
    t_verify(N)  the mean seconds of the rounds that verified N nodes; an unmeasured N is assumed to cost what the
                 next smaller measured N does (optimistic, so it is tried once; below every measured N,
                 ``prior_slope_ratio`` per node, as ``autok``). Verify cost is not linear on a CPU (it steps when
                 the matmuls change kernels), so every N keeps its own mean instead of a fitted line.
    t_draft      seconds per draft level (one draft forward per tree level), from every round that drafted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from hf_kvspec.speculative.autok import CallScoped
from hf_kvspec.speculative.tree import StaticTree


class Shape(NamedTuple):
    nodes: int
    depth: int


PLAIN = Shape(0, 0)
# node counts offered for a static tree's truncations and dynamic trees (the configured size is always added)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def fit_tree(tree: StaticTree, num_nodes: int, max_depth: int | None = None) -> StaticTree:
    """``tree`` without nodes deeper than ``max_depth``, then its first ``num_nodes`` nodes (both steps keep a tree:
    a node's ancestors are shallower and come first)."""
    if max_depth is not None and tree.max_depth > max_depth:
        tree = StaticTree.from_choices([c for c in tree.choices if len(c) <= max_depth])
    return tree.truncate(num_nodes)


def static_menu(tree: StaticTree) -> list[Shape]:
    """Plain decoding and truncations of ``tree`` to the ``SIZES`` below its size, and the whole tree."""
    sizes = sorted({n for n in SIZES if n < tree.num_nodes} | {tree.num_nodes})
    return [PLAIN, *(Shape(n, tree.truncate(n).max_depth) for n in sizes)]


def dynamic_menu(depth: int, total_tokens: int, top_k: int) -> list[Shape]:
    """Plain decoding and dynamic trees up to ``total_tokens`` nodes and ``depth`` levels: for each size the depth
    grows with the size (a deep narrow tree wastes levels; a wide shallow one wastes nodes), about one level per
    doubling, at least enough levels to place the nodes (``top_k`` at the first level, ``top_k**2`` at the next)."""
    shapes = [PLAIN]
    for nodes in sorted({n for n in SIZES if n < total_tokens} | {total_tokens}):
        levels = min(depth, nodes, max(nodes.bit_length(), _levels_needed(nodes, top_k)))
        shapes.append(Shape(nodes, levels))
    return shapes


def _levels_needed(nodes: int, top_k: int) -> int:
    levels, room = 1, top_k
    while room < nodes:
        levels, room = levels + 1, room + top_k * top_k
    return levels


class _Rate:
    """Decayed accepted/offered counts per depth."""

    def __init__(self):
        self.offered: list[float] = []
        self.accepted: list[float] = []
        self.seen: list[int] = []  # undecayed offered counts: the optimism bonus fades with all the evidence

    def add(self, depth: int, offered: int, accepted: int, decay: float) -> None:
        while len(self.offered) < depth:
            self.offered.append(0.0)
            self.accepted.append(0.0)
            self.seen.append(0)
        self.offered[depth - 1] = decay * self.offered[depth - 1] + offered
        self.accepted[depth - 1] = decay * self.accepted[depth - 1] + accepted
        self.seen[depth - 1] += offered

    def measured(self, depth: int) -> bool:
        return depth <= len(self.offered) and self.offered[depth - 1] > 0

    def rate(self, depth: int, explore: float) -> float:
        offered = self.offered[depth - 1] + 2
        mean = (self.accepted[depth - 1] + 1) / offered  # Beta(1, 1) prior
        # optimism that fades with evidence (UCB); counted without decay, or a drafter that is never right would
        # keep a bonus worth a draft's cost forever (decayed counts level off near 1 / (1 - decay) rounds)
        return min(1.0, mean + explore / math.sqrt(self.seen[depth - 1] + 2))


class AutoTreeSize(CallScoped):
    """``choose()`` -> node count of the next round (``shape`` holds its depth); ``update(outcome)`` after it.

    Same interface as ``autok.AutoDraftLength`` (``reset``/``choose``/``update``), so a drafter's ``draft_length``
    uses either. ``menu`` lists the shapes to choose from (``static_menu``/``dynamic_menu``); ``initial`` is tried
    first (default: the largest)."""

    def __init__(self, menu: Sequence[Shape], initial: Shape | None = None, probe_every: int = 16,
                 decay: float = 0.95, prior_slope_ratio: float = 0.15, explore: float = 0.3):
        self.menu = sorted(set(menu) | {PLAIN})
        self.initial = initial if initial is not None else self.menu[-1]
        self.probe_every, self.decay, self.prior_slope_ratio = probe_every, decay, prior_slope_ratio
        self.explore = explore
        self.reset()

    def reset(self) -> None:
        self.rates: dict[Shape, _Rate] = {}
        self.verify: dict[int, list[float]] = {}  # nodes -> [decayed weight, decayed seconds]
        self.draft = [0.0, 0.0]  # decayed [levels drafted, seconds]
        self.shape = self.initial
        self.since_probe = 0

    # ------------------------------------------------------------------------------------------ estimates
    def acceptance(self, shape: Shape, depth: int) -> float:
        """Estimated chance that a row keeping depth ``depth - 1`` keeps depth ``depth`` with ``shape``."""
        own = self.rates.get(shape)
        if own is not None and own.measured(depth):
            return own.rate(depth, self.explore)
        measured = sorted(s for s in self.rates if s != PLAIN and self.rates[s].measured(depth))
        below = [s for s in measured if s.nodes < shape.nodes]
        above = [s for s in measured if s.nodes > shape.nodes]
        if below and above:  # between two measured sizes: linear in log(nodes)
            lo, hi = below[-1], above[0]
            share = (math.log(shape.nodes) - math.log(lo.nodes)) / (math.log(hi.nodes) - math.log(lo.nodes))
            low, high = self.rates[lo].rate(depth, self.explore), self.rates[hi].rate(depth, self.explore)
            return (1 - share) * low + share * high
        if measured:  # outside the measured sizes: the nearest one
            return self.rates[(below or above)[-1 if below else 0]].rate(depth, self.explore)
        deepest = [(len(r.offered), r) for r in self.rates.values() if r.offered]
        if deepest:
            size, rate = max(deepest, key=lambda x: x[0])
            return rate.rate(size, self.explore)
        return 0.5

    def expected_tokens(self, shape: Shape) -> float:
        """``1 + E[accepted]`` per row of a round with ``shape``."""
        total, reach = 1.0, 1.0
        for depth in range(1, shape.depth + 1):
            reach *= self.acceptance(shape, depth)
            total += reach
        return total

    def verify_seconds(self, nodes: int) -> float:
        """Measured seconds of a verify forward over ``nodes`` drafts (0 before any round). An unmeasured count is
        assumed to cost what the next smaller measured one does (a lower bound: verify time does not fall as N
        grows), so it is tried once and then known; below every measured count, ``prior_slope_ratio`` per node."""
        points = {n: seconds / weight for n, (weight, seconds) in self.verify.items() if weight > 0}
        if not points:
            return 0.0
        if nodes in points:
            return points[nodes]
        below = [n for n in points if n < nodes]
        if below:
            return points[max(below)]
        smallest = min(points)
        return points[smallest] / (1 + self.prior_slope_ratio * smallest) * (1 + self.prior_slope_ratio * nodes)

    def draft_seconds(self, shape: Shape) -> float:
        per_level = self.draft[1] / self.draft[0] if self.draft[0] > 0 else 0.0
        return per_level * shape.depth

    def rate(self, shape: Shape) -> float:
        """Expected tokens per second of a round with ``shape``."""
        cost = self.verify_seconds(shape.nodes) + self.draft_seconds(shape)
        return self.expected_tokens(shape) / max(cost, 1e-9)

    # ------------------------------------------------------------------------------------------ interface
    def choose(self) -> int:
        if not self.verify:
            choice = self.initial
        elif PLAIN.nodes not in self.verify:  # one plain step early: the cost every tree is compared with
            choice = PLAIN
        else:
            choice = max(self.menu, key=self.rate)
            if choice == PLAIN:
                self.since_probe += 1
                if self.since_probe >= self.probe_every:  # re-measure acceptance now and then
                    self.since_probe, choice = 0, self.menu[1] if len(self.menu) > 1 else PLAIN
            else:
                self.since_probe = 0
        self.shape = choice
        return choice.nodes

    def update(self, outcome) -> None:
        """Fold in a ``RoundOutcome`` of the shape last chosen (rounds whose tree the loop cut near max_length count
        for the verify cost only)."""
        nodes = outcome.num_draft_tokens
        weight, seconds = self.verify.get(nodes, [0.0, 0.0])
        self.verify[nodes] = [self.decay * weight + 1, self.decay * seconds + outcome.verify_time_s]
        if nodes and self.shape.depth:
            self.draft = [self.decay * self.draft[0] + self.shape.depth,
                          self.decay * self.draft[1] + outcome.draft_time_s]
        if nodes == 0 or nodes != self.shape.nodes:
            return
        accepted = outcome.num_accepted[outcome.alive].tolist()
        rates = self.rates.setdefault(self.shape, _Rate())
        for depth in range(1, self.shape.depth + 1):
            offered = sum(n >= depth - 1 for n in accepted)
            if offered:
                rates.add(depth, offered, sum(n >= depth for n in accepted), self.decay)
