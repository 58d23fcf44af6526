"""Automatic sizing of Lookahead decoding: each round's window width and guess count from the measured cost of a
target forward per fed token count and the measured tokens per round of each shape.

Boundary: pure bookkeeping over numbers the assistant measures (fed tokens, nodes, emitted tokens, seconds); no
tensors, no models. The same model as ``autok.py`` / ``autotree.py`` (Leviathan et al. 2211.17192 Sec. 3.3):
pick the shape with the most expected tokens per second, plain decoding included.

A shape ``(window w, guesses g, context)`` feeds ``T = 1 + nodes + w (N - 1)`` tokens (root, verification nodes,
lookahead branch) and emits ``1 + E[accepted]`` tokens per row; ``PLAIN`` feeds 1 and emits 1. Where extra tokens
are nearly free (a GPU, or a CPU with the decode kernels at a few rows) the largest shape wins; where each token
costs, the window shrinks or goes; when nothing pays, plain decoding, re-probed every ``probe_every`` rounds.

Estimates (exponentially decayed, so they follow the text):
    t(T)       mean seconds of the forwards that fed T tokens; an unmeasured T is linear between the measured
               counts around it, the largest measured one above them (optimistic: it gets tried, then
               measured), ``prior_slope_ratio`` per token below them.
    tokens     mean tokens per row and round of each shape, plus an optimism bonus ``explore / sqrt(rounds + 1)``
               (fades with evidence); an unmeasured shape borrows the best measured one's mean. The window's
               value is delayed (n-grams it yields are verified in later rounds), which these means see only
               as the shape is kept a while: hence ``warmup`` rounds of the largest shape first.
    nodes      mean nodes verified per round of each shape (pool hits vary); before any, the most it may hold.
    draft      mean seconds of ``propose`` per round of each shape.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hf_kvspec.speculative.autok import CallScoped


class Shape(NamedTuple):
    window: int  # window columns fed (0: no lookahead branch)
    guesses: int  # pool n-grams verified
    context: bool  # the context continuation is verified too


PLAIN = Shape(0, 0, False)


def lookahead_menu(window: int, guesses: int, context: bool) -> list[Shape]:
    """Plain decoding and the shapes of up to ``window`` columns and ``guesses`` n-grams (full, half, none)."""
    widths = sorted({0, max(window // 2, 1), window})
    counts = sorted({0, max(guesses // 2, 1), guesses})
    shapes = {Shape(w, g, context) for w in widths for g in counts}
    return sorted(shapes | {PLAIN})


class _Mean:
    """A decayed mean: ``weight`` and ``total``."""

    __slots__ = ("seen", "total", "weight")

    def __init__(self):
        self.weight, self.total, self.seen = 0.0, 0.0, 0

    def add(self, value: float, decay: float) -> None:
        self.weight, self.total, self.seen = decay * self.weight + 1, decay * self.total + value, self.seen + 1

    @property
    def mean(self) -> float:
        return self.total / self.weight


class AutoLookahead(CallScoped):
    """``choose()`` -> the next round's ``Shape``; ``update(...)`` after it (module docstring)."""

    def __init__(self, menu: list[Shape], ngram: int, max_nodes: dict[Shape, int], warmup: int = 8,
                 probe_every: int = 16, decay: float = 0.9, prior_slope_ratio: float = 0.15, explore: float = 0.3):
        self.menu, self.ngram, self.max_nodes = sorted(set(menu) | {PLAIN}), ngram, max_nodes
        self.largest = max(self.menu)  # the widest window, then the most guesses
        self.warmup, self.probe_every, self.decay = warmup, probe_every, decay
        self.prior_slope_ratio, self.explore = prior_slope_ratio, explore
        self.reset()

    def start_call(self, batch: int) -> None:
        """Costs and means carry over to a call with as many rows; the warm-up runs again (the window and the
        pool start empty in every call)."""
        super().start_call(batch)
        self.rounds, self.since_probe = 0, 0

    def reset(self) -> None:
        self.cost: dict[int, _Mean] = {}  # fed tokens -> seconds
        self.tokens: dict[Shape, _Mean] = {}
        self.nodes: dict[Shape, _Mean] = {}
        self.draft: dict[Shape, _Mean] = {}
        self.rounds = 0
        self.since_probe = 0
        self.shape = self.largest

    # ------------------------------------------------------------------------------------------ estimates
    def fed_tokens(self, shape: Shape) -> int:
        """Tokens one forward of ``shape`` feeds: root, expected nodes, the full window's levels."""
        nodes = self.nodes[shape].mean if shape in self.nodes else self.max_nodes.get(shape, 0)
        return 1 + round(nodes) + shape.window * (self.ngram - 1)

    def seconds(self, fed: int) -> float:
        """Estimated seconds of a forward feeding ``fed`` tokens (0 before any measurement)."""
        points = {t: m.mean for t, m in self.cost.items()}
        if not points:
            return 0.0
        if fed in points:
            return points[fed]
        below, above = [t for t in points if t < fed], [t for t in points if t > fed]
        if below and above:
            low, high = max(below), min(above)
            return points[low] + (points[high] - points[low]) * (fed - low) / (high - low)
        if below:
            return points[max(below)]
        smallest = min(points)
        return points[smallest] / (1 + self.prior_slope_ratio * smallest) * (1 + self.prior_slope_ratio * fed)

    def expected_tokens(self, shape: Shape) -> float:
        """Tokens per row of a round of ``shape`` (plain: 1), with the optimism bonus."""
        if shape == PLAIN:
            return 1.0
        own = self.tokens.get(shape)
        if own is not None:
            return own.mean + self.explore / math.sqrt(own.seen + 1)
        measured = [m.mean for s, m in self.tokens.items() if s != PLAIN]
        return (max(measured) if measured else 2.0) + self.explore

    def rate(self, shape: Shape) -> float:
        draft = self.draft[shape].mean if shape in self.draft else 0.0
        return self.expected_tokens(shape) / max(self.seconds(self.fed_tokens(shape)) + draft, 1e-9)

    # ------------------------------------------------------------------------------------------ interface
    def choose(self) -> Shape:
        if self.rounds < self.warmup:
            choice = self.largest
        elif PLAIN not in self.tokens:  # one plain step: the cost every shape is compared with
            choice = PLAIN
        else:
            choice = max(self.menu, key=self.rate)
            if choice == PLAIN:
                self.since_probe += 1
                if self.since_probe >= self.probe_every:  # re-measure now and then
                    self.since_probe = 0
                    choice = max((s for s in self.menu if s != PLAIN), key=self.rate, default=PLAIN)
            else:
                self.since_probe = 0
        self.shape = choice
        return choice

    def update(self, shape: Shape, fed: int, nodes: int, tokens_per_row: float, verify_s: float,
               draft_s: float) -> None:
        """Fold in a round of ``shape`` that fed ``fed`` tokens, verified ``nodes`` nodes and emitted
        ``tokens_per_row`` tokens per live row."""
        self.rounds += 1
        decay = self.decay
        self.cost.setdefault(fed, _Mean()).add(verify_s, decay)
        self.tokens.setdefault(shape, _Mean()).add(tokens_per_row, decay)
        self.nodes.setdefault(shape, _Mean()).add(nodes, decay)
        self.draft.setdefault(shape, _Mean()).add(draft_s, decay)
