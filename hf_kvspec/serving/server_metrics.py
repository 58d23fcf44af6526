"""``GET /metrics`` of ``hf-kvspec serve``: the server's own counters (requests by outcome, time to first token,
output tokens per second) next to the engine's telemetry, in the Prometheus text exposition format (0.0.4).

Boundary: counting and formatting; the worker (``server_worker.py``) calls ``record_*`` from the event loop and
the engine's figures come in as ``Engine.telemetry()``'s dict.
"""

from __future__ import annotations

import math
import time
from collections import deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
THROUGHPUT_WINDOW_S = 10.0  # tokens/s is measured over the last this many seconds
OUTCOMES = ("finished", "cancelled", "failed", "rejected")


class ServerMetrics:
    """Counters of one server process (event-loop thread only)."""

    def __init__(self):
        self.requests = dict.fromkeys(OUTCOMES, 0)  # choices (engine requests) by how they ended
        self.ttft_counts = [0] * len(TTFT_BUCKETS)  # per bucket, not cumulative
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.output_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) within the throughput window
        self.tau_sum, self.acceptance_sum, self.speculative_requests = 0.0, 0.0, 0

    def record_ttft(self, seconds: float) -> None:
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1
                break
        self.ttft_sum += seconds
        self.ttft_count += 1

    def record_tokens(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.output_tokens += count
        self._recent.append((now, count))

    def record_end(self, outcome: str, metrics=None) -> None:
        """A choice ended (``OUTCOMES``); a finished one's ``RequestMetrics`` feed the speculation figures."""
        self.requests[outcome] += 1
        if metrics is not None and metrics.tau is not None:
            self.tau_sum += metrics.tau
            self.acceptance_sum += metrics.acceptance_rate or 0.0
            self.speculative_requests += 1

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(count for _, count in self._recent) / THROUGHPUT_WINDOW_S

    def render(self, engine: dict, draining: bool) -> str:
        """The exposition text: the server's counters and ``engine`` (``Engine.telemetry()``)."""
        spec = self.speculative_requests
        lines: list[str] = []
        gauge = _family(lines, "gauge")
        gauge("kvspec_requests_running", "Requests in the engine's running set.", engine["running"])
        gauge("kvspec_requests_waiting", "Requests waiting for admission.", engine["waiting"])
        gauge("kvspec_kv_blocks_used", "KV blocks held by requests.", engine["used_blocks"])
        gauge("kvspec_kv_blocks_total", "KV blocks in the pool.", engine["total_blocks"])
        gauge("kvspec_kv_block_utilization", "Used / total KV blocks.", engine["block_utilization"])
        gauge("kvspec_kv_slot_utilization", "Stored tokens / slots of the blocks in use.", engine["slot_utilization"])
        gauge("kvspec_tokens_per_second", f"Output tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
              self.tokens_per_second())
        gauge("kvspec_tokens_per_forward", "Tokens fed per engine forward, over the engine's life.",
              engine["tokens_per_forward"])
        gauge("kvspec_tau", "Mean tokens per target forward of finished speculative requests (NaN: none).",
              self.tau_sum / spec if spec else math.nan)
        gauge("kvspec_acceptance_rate", "Mean draft acceptance of finished speculative requests (NaN: none).",
              self.acceptance_sum / spec if spec else math.nan)
        gauge("kvspec_draining", "1 after SIGTERM: running requests finish, new ones are refused.", int(draining))
        counter = _family(lines, "counter")
        counter("kvspec_output_tokens_total", "Output tokens sent.", self.output_tokens)
        counter("kvspec_engine_rounds_total", "Engine rounds (forwards).", engine["rounds"])
        counter("kvspec_preemptions_total", "Requests preempted for blocks.", engine["preemptions"])
        lines += ["# HELP kvspec_requests_total Choices (engine requests) by outcome.",
                  "# TYPE kvspec_requests_total counter"]
        lines += [f'kvspec_requests_total{{outcome="{o}"}} {self.requests[o]}' for o in OUTCOMES]
        lines += self._ttft_lines()
        if "suffix_pool" in engine:
            lines += _pool_lines(engine["suffix_pool"])
        return "\n".join(lines) + "\n"

    def _ttft_lines(self) -> list[str]:
        name = "kvspec_time_to_first_token_seconds"
        lines = [f"# HELP {name} Arrival at the server to the first output token.", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(TTFT_BUCKETS, self.ttft_counts):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.ttft_count}', f"{name}_sum {_number(self.ttft_sum)}",
                  f"{name}_count {self.ttft_count}"]
        return lines


def _pool_lines(pool: dict) -> list[str]:
    """The suffix pool's figures (``SuffixPool.stats``)."""
    lines: list[str] = []
    gauge, counter = _family(lines, "gauge"), _family(lines, "counter")
    gauge("kvspec_suffix_pool_bytes", "Accounted bytes held by the suffix drafting pool.", pool["bytes"])
    gauge("kvspec_suffix_pool_max_bytes", "The suffix pool's byte budget.", pool["max_bytes"])
    gauge("kvspec_suffix_pool_sequences", "Sequences (running and past requests) in the suffix pool.",
          pool["sequences"])
    gauge("kvspec_suffix_pool_hit_rate", "Lookups that drafted at least one token / lookups.", pool["hit_rate"])
    counter("kvspec_suffix_pool_lookups_total", "Suffix pool lookups.", pool["lookups"])
    counter("kvspec_suffix_pool_evictions_total", "Sequences evicted from the suffix pool for its budget.",
            pool["evictions"])
    return lines


def _family(lines: list[str], kind: str):
    def add(name: str, help_text: str, value) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"])
    return add


def _number(value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return f"{value:g}" if isinstance(value, float) else str(value)
