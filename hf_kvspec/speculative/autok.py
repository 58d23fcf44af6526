"""Automatic draft length: choose K each round from running acceptance and measured draft/verify cost.

Boundary: pure bookkeeping over numbers the loop measures (times, accepted counts); no tensors, no models.

Model (Leviathan et al. 2211.17192, Sec. 3.3): with i.i.d. acceptance a, a round drafting K tokens emits
E[tau](K) = (1 - a^(K+1)) / (1 - a) tokens and costs K * t_draft + t_verify(K). The controller picks the K in
0..max that maximises E[tau](K) / cost(K); K = 0 is a plain decoding step (cost t_verify(0)), so it falls back to
plain decoding when speculation does not pay, and re-probes with a short draft every ``probe_every`` rounds so
that a change in acceptance is noticed.

Batches: every row of a round drafts the same K, and a call ends when its slowest row does, so with several rows
``a`` is the acceptance of the row that accepts least (each row's own decayed estimate, keyed by its call row,
``RoundOutcome.call_rows``). Averaging over rows would let three rows that accept everything hide a fourth that
accepts nothing, and that row alone then sets the call's length at a round's price per token; its rounds get
cheap only once the others finished and left the batch. With one row, or without row ids, ``a`` is the pooled
estimate.

Estimates (exponentially decayed so they follow the text):
    a          maximum-likelihood estimate for a truncated geometric: accepted / (accepted + rejections).
    t_draft    draft seconds per drafted token.
    t_verify   a line t0 + slope * K fitted to (K, seconds) of past rounds; until two different K were seen
               the slope is a prior of 0.15 * t0 per token (REFERENCE.md §8: verifying 4 tokens ~1.6x a decode
               step on CPU).

Priors an assistant may set before the first round of a call (``set_priors``): ``t_draft`` as a share of a
decode step (until a draft was timed) and the first round's K (the best K of the priors; 0 when no K pays there,
so a drafter that cannot win starts as plain decoding). The first round of every call is not timed: it pays
one-time costs (weight packing of the decode kernels, first allocations) that are not the round's. When rows
leave the batch the verify cost and the acceptance are estimated again (``_rows_changed``): the last row of a
batch may accept far less than those that finished (docs/long_context.md has such a batch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Decayed:
    """Exponentially decayed sums for running means and a least-squares line."""

    decay: float
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def line(self, prior_slope_ratio: float) -> tuple[float, float]:
        """(intercept, slope) of y over x; the slope falls back to a prior when x barely varied."""
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var_x = self.sxx / self.n - mean_x**2
        if var_x > 0.25:
            slope = (self.sxy / self.n - mean_x * mean_y) / var_x
            return max(mean_y - slope * mean_x, 1e-9), max(slope, 0.0)
        intercept = mean_y / (1 + prior_slope_ratio * mean_x)
        return intercept, prior_slope_ratio * intercept


def is_count(value, minimum: int) -> bool:
    """``value`` is an int >= ``minimum`` (a bool is not a count, though Python makes it an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


class CallScoped:
    """Estimates that span ``generate`` calls: ``start_call`` keeps them for another call with as many rows
    (verify cost grows with the rows; acceptance is decayed as it goes) and ``reset``s them otherwise."""

    batch: int | None = None  # rows of the calls the estimates were made in

    def start_call(self, batch: int) -> None:
        if batch != self.batch:
            self.batch = batch
            self.reset()

    def reset(self) -> None:
        raise NotImplementedError


class AutoDraftLength(CallScoped):
    def __init__(self, max_draft_tokens: int = 16, initial: int = 4, probe_every: int = 16, decay: float = 0.95,
                 prior_slope_ratio: float = 0.15):
        _check_settings(max_draft_tokens, initial, probe_every, decay, prior_slope_ratio)
        self.max_draft_tokens = max_draft_tokens
        self.initial = min(initial, max_draft_tokens)
        self.probe_every = probe_every
        self.decay = decay
        self.prior_slope_ratio = prior_slope_ratio
        self.reset()

    prior_draft_ratio: float | None = None  # t_draft / t0 until a draft was timed (None: drafts look free)

    def set_priors(self, draft_ratio: float, acceptance: float) -> None:
        """Before a call's first round: a draft token costs ``draft_ratio`` decode steps and a draft is accepted
        with probability ``acceptance`` (both from a cost model, e.g. bytes read); the first round drafts the K
        these priors make best. Measured times and acceptance replace them as rounds come in."""
        if not (isinstance(draft_ratio, (int, float)) and draft_ratio >= 0):
            raise ValueError(f"draft_ratio must be >= 0 (decode steps per draft token), got {draft_ratio!r}")
        if not (isinstance(acceptance, (int, float)) and 0 <= acceptance < 1):
            raise ValueError(f"acceptance must be in [0, 1), got {acceptance!r}")
        self.prior_draft_ratio = float(draft_ratio)
        if self.verify_time.n == 0:  # nothing measured yet: start from the priors' best K
            a, ratio = acceptance, self.prior_slope_ratio

            def rate(k: int) -> float:
                return (1 - a ** (k + 1)) / (1 - a) / (1 + ratio * k + draft_ratio * k)

            self.last_choice = self.initial = max(range(self.max_draft_tokens + 1), key=rate)

    def start_call(self, batch: int) -> None:
        super().start_call(batch)
        self.untimed = 1  # the call's first round (one-time costs)
        self.row_counts: dict[int, list[float]] = {}  # call row -> decayed [accepted, rejected] (prior 1:1)
        self.live_rows: list[int] | None = None  # call rows generating in the last round seen (None: no round yet)

    def _rows_changed(self) -> None:
        """Rows left the batch: the verify cost was measured with more rows (attention grows with them), so it is
        measured again, and the acceptance starts again from the prior, so that the rows still generating decide
        (they may accept far less than those that finished). A draft step's cost hardly changes with the rows
        (it reads the weights), so it is kept."""
        self.verify_time = _Decayed(self.decay)
        self.accepted = self.rejected = 1.0

    @staticmethod
    def _live_call_rows(outcome) -> list[int]:
        """The call rows of ``outcome``'s alive rows (active row i is call row ``call_rows[i]``, else i)."""
        rows = outcome.call_rows if outcome.call_rows is not None else range(len(outcome.alive))
        return [row for row, alive in zip(rows, outcome.alive.tolist()) if alive]

    def _update_rows(self, outcome, k: int) -> None:
        """Each live row's own decayed acceptance, keyed by its call row."""
        accepted = outcome.num_accepted[outcome.alive].tolist()
        for row, n in zip(self.live_rows, accepted):
            counts = self.row_counts.setdefault(row, [1.0, 1.0])
            counts[0] = self.decay * counts[0] + n
            counts[1] = self.decay * counts[1] + (n < k)

    def reset(self) -> None:
        self.untimed, self.row_counts, self.live_rows = 1, {}, None
        self.accepted = 1.0  # prior: a = 0.5 worth one observation each way
        self.rejected = 1.0
        self.draft_time = _Decayed(self.decay)  # x = tokens drafted, y = seconds
        self.verify_time = _Decayed(self.decay)  # x = K, y = seconds
        self.since_probe = 0
        self.last_choice = self.initial

    @property
    def alpha(self) -> float:
        """The acceptance the choice uses: the least-accepting live row's when several rows are tracked, else
        the pooled estimate (module docstring)."""
        if self.live_rows is not None and len(self.live_rows) > 1:
            return min(self.row_alpha(row) for row in self.live_rows)
        return self.pooled_alpha

    @property
    def pooled_alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def row_alpha(self, row: int) -> float:
        accepted, rejected = self.row_counts.get(row, (1.0, 1.0))
        return accepted / (accepted + rejected)

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 1 - 1e-6)
        return (1 - a ** (k + 1)) / (1 - a)

    def rate(self, k: int) -> float:
        """Expected tokens per second of a round with draft length k."""
        t0, slope = self.verify_time.line(self.prior_slope_ratio)
        if self.draft_time.sx > 0:
            per_token = self.draft_time.sy / self.draft_time.sx
        else:
            per_token = (self.prior_draft_ratio or 0.0) * t0
        return self.expected_tokens(k) / (t0 + slope * k + per_token * k)

    def choose(self) -> int:
        if self.verify_time.n == 0:
            choice = self.initial
        else:
            choice = max(range(self.max_draft_tokens + 1), key=self.rate)
            if choice == 0:
                self.since_probe += 1
                if self.since_probe >= self.probe_every:  # re-measure acceptance now and then
                    self.since_probe, choice = 0, max(1, min(self.last_choice, 2))
            else:
                self.since_probe = 0
        self.last_choice = choice or self.last_choice
        return choice

    def update(self, outcome) -> None:
        """Fold in a ``RoundOutcome`` (num_draft_tokens, num_accepted [B] of the ``alive`` rows, seconds)."""
        k = outcome.num_draft_tokens
        live = self._live_call_rows(outcome)
        if self.live_rows is not None and live != self.live_rows:
            self._rows_changed()
        self.live_rows = live  # every round, drafting or not: a row that left never paces the next choice
        timed = self.untimed == 0
        self.untimed = max(self.untimed - 1, 0)
        if timed:
            self.verify_time.add(k, outcome.verify_time_s)
        if k == 0:
            return
        accepted = outcome.num_accepted[outcome.alive].tolist()
        self.accepted = self.decay * self.accepted + sum(accepted)
        self.rejected = self.decay * self.rejected + sum(n < k for n in accepted)
        self._update_rows(outcome, k)
        if timed:
            self.draft_time.add(k, outcome.draft_time_s)


def _check_settings(max_draft_tokens, initial, probe_every, decay, prior_slope_ratio) -> None:
    for name, value, minimum in (("max_draft_tokens", max_draft_tokens, 1), ("initial", initial, 0),
                                 ("probe_every", probe_every, 1)):
        if not is_count(value, minimum):
            kind = "a positive int" if minimum else "a non-negative int"
            raise ValueError(f"AutoDraftLength: {name} must be {kind}, got {value!r}")
    if not (isinstance(decay, (int, float)) and 0 < decay <= 1):
        raise ValueError(f"AutoDraftLength needs 0 < decay <= 1 (the weight an older round keeps), got {decay!r}")
    if not (isinstance(prior_slope_ratio, (int, float)) and prior_slope_ratio >= 0):
        raise ValueError(f"AutoDraftLength: prior_slope_ratio (verify cost per drafted token, as a share of a decode "
                         f"step) must be >= 0, got {prior_slope_ratio!r}")
