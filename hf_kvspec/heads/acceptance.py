"""Held-out acceptance of a head: per-head top-1 agreement with the target and the chain tau it implies.

Boundary: pure bookkeeping over boolean "draft k at row t was right" matrices; the heads are run by
``evaluation.py``.

Terms. ``correct[k, t]`` is True when the draft for token t+k+2 made at row t (head k, or unrolled step k) equals the
target's greedy token there (``target_tokens[t+k+1]``). Greedy chain verification from a verified prefix ending at
row t accepts the leading run of correct drafts ``a`` and emits ``a + 1`` tokens (the accepted drafts plus the target's
own next token), then continues from row ``t + a + 1``. ``tau`` = emitted tokens / target forwards, walking a
response from its first token to its end exactly as greedy speculative decoding would on the target's greedy text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def leading_run(correct_column: list[bool]) -> int:
    """Number of leading True values."""
    run = 0
    for hit in correct_column:
        if not hit:
            break
        run += 1
    return run


def chain_walk(correct: torch.Tensor, start: int, end: int) -> tuple[int, int]:
    """(emitted tokens, target forwards) of greedy chain drafting over rows ``start..end`` (inclusive).

    correct: [K, T] bool. Row t emits tokens t+1..t+a+1; drafts that would land past row ``end + 1`` are not
    counted (the response is over).
    """
    emitted = forwards = 0
    t = start
    while t <= end:
        usable = min(correct.shape[0], end - t)  # drafts for tokens t+2..t+usable+1 stay inside the response
        accepted = leading_run(correct[:usable, t].tolist())
        emitted += accepted + 1
        forwards += 1
        t += accepted + 1
    return emitted, forwards


@dataclass
class AcceptanceTally:
    """Accumulates per-head top-1 and the chain walk over many held-out responses."""

    hits: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    emitted: int = 0
    forwards: int = 0

    def add(self, correct: torch.Tensor, start: int, end: int) -> None:
        """correct [K, T] for one sequence; rows ``start..end`` are the response's prediction rows."""
        depth = correct.shape[0]
        if not self.hits:
            self.hits, self.counts = [0] * depth, [0] * depth
        for k in range(depth):
            last = end - k - 1  # row whose head-k draft is the response's last token
            if last >= start:
                self.hits[k] += int(correct[k, start:last + 1].sum())
                self.counts[k] += last + 1 - start
        emitted, forwards = chain_walk(correct, start, end)
        self.emitted += emitted
        self.forwards += forwards

    @property
    def per_head_top1(self) -> list[float]:
        return [h / c if c else float("nan") for h, c in zip(self.hits, self.counts)]

    @property
    def tau(self) -> float:
        return self.emitted / self.forwards if self.forwards else float("nan")

    def as_dict(self) -> dict:
        return {"per_head_top1": self.per_head_top1, "tau": self.tau, "positions": self.counts,
                "emitted_tokens": self.emitted, "target_forwards": self.forwards}
