"""Engine telemetry: what each round ran and the engine-wide counters (per-request figures are
``request.RequestMetrics``).

Boundary: plain records and arithmetic; the engine fills them in after every round. Nothing here reads the
model or the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_ROUND_RECORDS = 100_000  # rounds kept in ``EngineStats.rounds`` (a long-running engine forgets the oldest)


@dataclass(frozen=True)
class RoundStats:
    """One round (one forward)."""

    num_tokens: int  # packed tokens of the forward (<= max_tokens_per_round)
    num_rows: int  # requests in the forward
    num_decode_rows: int  # of which one-token decode steps
    num_sampled: int  # rows that produced a token
    running: int  # running requests after the round
    waiting: int  # waiting requests after the round
    used_blocks: int  # KV blocks in use after the round
    total_blocks: int
    slot_utilization: float  # stored tokens / slots of the blocks in use
    preempted: int  # requests preempted while scheduling it
    seconds: float  # wall time of the forward and sampling
    num_output_tokens: int = 0  # tokens appended to outputs (more than num_sampled when drafts are accepted)
    num_draft_tokens: int = 0  # draft tokens verified in the forward (counted in num_tokens)
    num_accepted: int = 0  # of which accepted


@dataclass
class EngineStats:
    """Counters over the engine's life and the most recent rounds."""

    rounds: deque = field(default_factory=lambda: deque(maxlen=MAX_ROUND_RECORDS))
    num_rounds: int = 0
    num_forward_tokens: int = 0
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    prefix_queried_blocks: int = 0  # full prompt blocks looked up at admissions
    prefix_hit_blocks: int = 0  # of which served from the cache

    def record(self, round_stats: RoundStats) -> None:
        self.rounds.append(round_stats)
        self.num_rounds += 1
        self.num_forward_tokens += round_stats.num_tokens
        self.num_output_tokens += round_stats.num_output_tokens
        self.num_draft_tokens += round_stats.num_draft_tokens
        self.num_accepted_tokens += round_stats.num_accepted
        self.num_preemptions += round_stats.preempted

    def record_admission(self, queried_blocks: int, hit_blocks: int) -> None:
        self.prefix_queried_blocks += queried_blocks
        self.prefix_hit_blocks += hit_blocks

    @property
    def tokens_per_forward(self) -> float:
        return self.num_forward_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def output_tokens_per_forward(self) -> float:
        """Output tokens per round: up to the running requests' count without speculation, more with it."""
        return self.num_output_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens over the engine's life (None: nothing drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.prefix_queried_blocks if self.prefix_queried_blocks else 0.0

    @property
    def mean_block_utilization(self) -> float:
        """Mean over the recorded rounds of used blocks / all blocks."""
        if not self.rounds:
            return 0.0
        return sum(r.used_blocks / r.total_blocks for r in self.rounds) / len(self.rounds)

    def summary(self) -> dict:
        last = self.rounds[-1] if self.rounds else None
        return {
            "rounds": self.num_rounds,
            "tokens_per_forward": self.tokens_per_forward,
            "output_tokens": self.num_output_tokens,
            "output_tokens_per_forward": self.output_tokens_per_forward,
            "draft_tokens": self.num_draft_tokens,
            "acceptance_rate": self.acceptance_rate,
            "preemptions": self.num_preemptions,
            "prefix_hit_rate": self.prefix_hit_rate,
            "mean_block_utilization": self.mean_block_utilization,
            "running": last.running if last else 0,
            "waiting": last.waiting if last else 0,
        }
