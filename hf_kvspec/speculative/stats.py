"""Acceptance telemetry of a speculative ``generate`` call: plain counters, no tensors, no models.

Boundary: the decode loop records what each round drafted, accepted and cost; this module only adds up and
summarises. The same object is returned as ``output.acceptance`` and kept as ``assistant.stats``.

Definitions (per row, summed over rows). The first round feeds the prompt together with its drafts, so its
tokens count; only a drafter that needs the prompt's hidden states first gets a separate prefill forward, whose
one token is not counted (``prefill_forwards``):
    tokens_per_target_forward (tau)  tokens emitted by rounds / (rounds x rows alive in that round).
                                    Plain decoding has tau = 1; Leviathan et al. 2211.17192 call it the
                                    expected number of tokens per iteration, (1 - a^(K+1)) / (1 - a).
    acceptance_rate[j]               drafts accepted at position j / drafts offered at position j; position j is
                                    reached only when positions < j were accepted. For trees, position j is
                                    depth j + 1: rows that kept depth j + 1 / rows that kept depth j.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class AcceptanceStats:
    """Counters of one (or several merged) speculative ``generate`` calls."""

    rounds: int = 0  # verify forwards of the target (one per round, any batch size)
    prefill_forwards: int = 0  # separate prompt forwards (only for drafters that read the target's hidden states)
    row_rounds: int = 0  # sum over rounds of the rows still generating
    fallback_rounds: int = 0  # rounds that drafted nothing (plain decoding step)
    emitted_tokens: int = 0  # tokens emitted by rounds, all rows
    draft_forwards: int = 0  # forward passes of a draft model (0 for model-free drafters)
    rows_dropped: int = 0  # finished rows taken out of the model's batch before the call ended (loop.py, rows.py)
    drafted: list[int] = field(default_factory=list)  # [j] drafts offered at position j (row count)
    accepted: list[int] = field(default_factory=list)  # [j] drafts accepted at position j
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)  # K used by each round (auto K shows its choices)
    lossy_rules: list[str] = field(default_factory=list)  # names of lossy acceptance rules used (asked for)
    drafter: dict | None = None  # what the assistant ran on and holds (Assistant.report)
    forward: dict | None = None  # who ran the target's forwards (hf_kvspec.forward: "fast" with its packed bytes)
    kernels: dict | None = None  # decode kernels' report (bytes held, kernel per row bucket), None when off
    attention: str | None = None  # the target's attention for the call when it was switched (call_attention.py)

    @property
    def target_forwards(self) -> int:
        """Forwards of the target model: one per round, plus a separate prefill if there was one."""
        return self.rounds + self.prefill_forwards

    @property
    def tokens_per_target_forward(self) -> float:
        return self.emitted_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def acceptance_rate(self) -> list[float]:
        """Per draft position j: accepted / offered."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def mean_acceptance(self) -> float:
        """Accepted / offered over all positions."""
        offered = sum(self.drafted)
        return sum(self.accepted) / offered if offered else 0.0

    @property
    def lossy(self) -> bool:
        return bool(self.lossy_rules)

    @property
    def empty(self) -> bool:
        """True when no round ran: the call did not go through the speculative loop."""
        return self.rounds == 0

    def record_round(self, num_draft: int, alive: int, emitted: int, accepted_per_position: list[int],
                     draft_time_s: float, verify_time_s: float, draft_forwards: int, depth: int | None = None) -> None:
        """Add one round; ``accepted_per_position[j]`` counts rows that kept draft j (so also offered j + 1); a
        tree of ``num_draft`` nodes counts per depth, ``depth`` deep (a chain: ``depth = num_draft``)."""
        self.rounds += 1
        self.row_rounds += alive
        self.fallback_rounds += num_draft == 0
        self.emitted_tokens += emitted
        self.draft_forwards += draft_forwards
        self.draft_time_s += draft_time_s
        self.verify_time_s += verify_time_s
        self.draft_lengths.append(num_draft)
        offered = [alive, *accepted_per_position[:-1]][:num_draft if depth is None else depth]
        self._extend(len(offered))
        for j, (d, a) in enumerate(zip(offered, accepted_per_position)):
            self.drafted[j] += d
            self.accepted[j] += a

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """Add ``other``'s counters into this object (returns self)."""
        for name in ("rounds", "prefill_forwards", "row_rounds", "fallback_rounds", "emitted_tokens", "draft_forwards",
                     "rows_dropped", "draft_time_s", "verify_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._extend(len(other.drafted))
        for j, (d, a) in enumerate(zip(other.drafted, other.accepted)):
            self.drafted[j] += d
            self.accepted[j] += a
        self.draft_lengths += other.draft_lengths
        self.lossy_rules += [r for r in other.lossy_rules if r not in self.lossy_rules]
        return self

    def _extend(self, length: int) -> None:
        while len(self.drafted) < length:
            self.drafted.append(0)
            self.accepted.append(0)

    def summary(self) -> dict:
        """Flat dict for logs, benchmark rows and model cards."""
        out = {k: v for k, v in asdict(self).items() if k not in ("drafted", "accepted", "draft_lengths", "kernels")}
        out.update(tokens_per_target_forward=round(self.tokens_per_target_forward, 4),
                   mean_acceptance=round(self.mean_acceptance, 4),
                   acceptance_rate=[round(a, 4) for a in self.acceptance_rate], lossy=self.lossy)
        if self.kernels is not None:
            out.update(kernel_bytes_held=self.kernels["bytes_held"], kernel_calls=self.kernels["calls"])
        return out

    def __str__(self) -> str:
        rates = ", ".join(f"{a:.2f}" for a in self.acceptance_rate)
        return (f"AcceptanceStats(tau={self.tokens_per_target_forward:.2f}, rounds={self.rounds}, "
                f"draft_forwards={self.draft_forwards}, acceptance=[{rates}], draft {self.draft_time_s:.2f}s / "
                f"verify {self.verify_time_s:.2f}s, lossy={self.lossy})")
