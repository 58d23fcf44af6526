"""Draft lengths by load: the draft length K of every drafting request in a shared forward, chosen together to
maximise the round's expected output tokens per second (goodput).

Boundary: numbers only. The caller (the serving engine) measures its forwards, drafts and verdicts and reports
them here (``record_forward``, ``record_draft``, ``record_verdict``, ``release``); ``plan`` returns a K per
request. No tensors, no models, no requests.

Model. A packed forward of T tokens costs ``f(T)`` seconds (``ForwardCost``, learned from the rounds themselves).
Drafting K tokens for one request costs ``d(K) = a + b K`` seconds (a decayed least-squares line over the
assistant's timed draft calls, proportional to K while one length was seen; 0 until one was timed); a drafter
that drafts for every request in one call (``shared_cost``: the engine's self-drafting, one packed forward per
depth) costs ``sum_j g(n_j)`` per round, ``n_j`` the requests drafting at depth j and ``g`` the draft forward's
own measured curve over rows. A request whose drafts are accepted one after another with probability ``alpha``
(i.i.d., Leviathan et al. arXiv 2211.17192) emits ``E(K) = sum_{k=0..K} alpha^k`` tokens, so its k-th draft adds
``alpha^k``. A round with base tokens ``T0`` (decode and prefill rows) and ``S`` sampling rows
has goodput (the next token of every sampling row, plus the accepted drafts)

    G = (S + sum_i (E_i(K_i) - 1)) / (f(T0 + sum_i K_i) + sum_{i: K_i > 0} (d_i(K_i) + v))

with ``v`` the measured acceptance work of one verify row (scores at every node and the verdict, which a plain
row does not do).

A drafter that knows its proposal before the plan (the suffix pool: a lookup costs microseconds) gives each
request's marginal gains itself (``Candidate.gains``: the estimated acceptance of each node, best first, already
calibrated by the request's measured ratio of accepted to estimated drafts); they take the place of
``alpha_i^k`` for that request, such a request is never probed (its gains are not a guess), and its ``d_i`` is 0:
the lookup ran before the plan, so its cost is sunk (only the verify row's work ``v`` counts).

Since each ``E_i`` is concave, the best way to spend m draft tokens is on the m largest marginal gains
``alpha_i^k``; ``plan`` walks m = 0, 1, ... over those gains in order and keeps the best m (with a shared draft
call, once per cap on the deepest length, since the cap fixes the drafting cost). m = 0, everybody at
K = 0, is the plain round (the engine then runs its plain path, no drafting call at all). This is TurboSpec's
goodput criterion (arXiv 2406.14066) with our own cost curve, and vLLM's per-batch-size table
(``num_speculative_tokens_per_batch_size``) falls out of it: more rows make ``f`` steeper, so K shrinks to 0.

Acceptance per request: decayed counts of accepted drafts and rejections (the truncated-geometric maximum
likelihood, as ``autok.py``), started from the pooled estimate of all requests so far (worth ``PRIOR_WEIGHT``
observations). A request at K = 0 is not measured, so its own evidence fades each idle round (it drifts back to
the pooled estimate, which the drafting requests keep current), and after ``PROBE_EVERY`` idle rounds it is
granted a short probe (``PROBE_TOKENS``) if the probe costs at most ``PROBE_LOSS`` of the round's best goodput
(near break-even); a drafter whose drafts cost more than that never pays for probes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvspec.speculative.autok import _Decayed

#: relative cost of a T-token packed forward (T = 1 -> 1.0) before the rounds measured T's bucket: the fast
#: forward's curve on a 2-core AVX2 CPU (docs/fast_forward.md); measured buckets replace it
PRIOR_CURVE = ((1, 1.0), (2, 1.18), (4, 1.29), (8, 1.51), (16, 2.46), (32, 4.3), (64, 8.0), (128, 15.5), (256, 30.0))
DECAY = 0.9  # weight an older observation keeps
PRIOR_WEIGHT = 2.0  # observations the pooled acceptance is worth in a request's own estimate
PROBE_EVERY = 8  # rounds at K = 0 before a request may be probed
PROBE_TOKENS = 2  # drafts of a probe
PROBE_LOSS = 0.01  # a probe may cost at most this share of the round's best goodput
#: the pooled acceptance before any verdict: optimistic (alpha 0.8, worth 5 verdicts), so that a new engine drafts,
#: measures, and stops if its drafter does not pay; a pessimistic prior would never measure a good drafter
POOLED_PRIOR = (4.0, 1.0)
DRAFT_STEP_PRIOR = 0.5  # shared drafting: a draft depth's cost as a share of a target forward, until timed


def _bucket(tokens: int) -> int:
    """Power-of-two bucket of a forward's token count: 1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
    return max(tokens - 1, 0).bit_length()


class ForwardCost:
    """``f(T)``: seconds of a packed forward of T tokens, per power-of-two bucket of T, learned from the rounds
    (decayed mean of (T, seconds) per bucket, linear between measured buckets; beyond them the prior curve's shape,
    or, ``proportional``, a cost proportional to T past the largest measured: the pessimistic shape of a forward
    that is compute-bound, as the int8 draft forward is past 2-3 rows)."""

    def __init__(self, decay: float = DECAY, proportional: bool = False):
        self.decay, self.proportional = decay, proportional
        self.buckets: dict[int, list[float]] = {}  # bucket -> decayed [weight, sum T, sum seconds]
        self._points: list[tuple[float, float]] = []
        self._tokens: list[float] = []  # the points' T, for bisection

    def record(self, tokens: int, seconds: float) -> None:
        entry = self.buckets.setdefault(_bucket(tokens), [0.0, 0.0, 0.0])
        entry[0] = self.decay * entry[0] + 1
        entry[1] = self.decay * entry[1] + tokens
        entry[2] = self.decay * entry[2] + seconds
        self._points = [(w_t / w, w_s / w) for _, (w, w_t, w_s) in sorted(self.buckets.items())]
        self._tokens = [t for t, _ in self._points]

    def points(self) -> list[tuple[float, float]]:
        """(mean T, mean seconds) of each measured bucket, in order of T."""
        return self._points

    def __call__(self, tokens: int) -> float:
        points = self._points
        if not points:
            return prior(tokens)  # in units of a one-token forward
        right = bisect.bisect_left(self._tokens, tokens)  # the first measured point at or past T
        if 0 < right < len(points) or (right == 0 and points[0][0] == tokens):
            (t0, s0), (t1, s1) = points[max(right - 1, 0)], points[right]
            return s0 + (s1 - s0) * (tokens - t0) / max(t1 - t0, 1e-9)
        t_near, s_near = points[0] if tokens < points[0][0] else points[-1]
        if self.proportional and tokens > t_near:
            return s_near * tokens / t_near
        return s_near * prior(tokens) / prior(t_near)


def prior(tokens: float) -> float:
    """The prior curve at ``tokens`` (linear between its points, proportional past its end)."""
    if tokens <= PRIOR_CURVE[0][0]:
        return PRIOR_CURVE[0][1]
    for (t0, c0), (t1, c1) in itertools.pairwise(PRIOR_CURVE):
        if tokens <= t1:
            return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
    last_t, last_c = PRIOR_CURVE[-1]
    return last_c * tokens / last_t


@dataclass(frozen=True)
class Candidate:
    """A decode row that may draft: its request, the most drafts it may verify (slots granted, tokens left) and,
    from a drafter that knows its proposal already, the marginal gain of each draft (non-increasing)."""

    request_id: int
    max_drafts: int
    gains: tuple[float, ...] | None = None

    def gain(self, alpha: float, k: int) -> float:
        """The k-th draft's expected accepted tokens (1-based)."""
        return alpha**k if self.gains is None else self.gains[k - 1]

    def capped(self, drafts: int) -> Candidate:
        return Candidate(self.request_id, min(self.max_drafts, drafts), self.gains)


class Costs:
    """What forwards and drafts cost on this machine, for one model, forward and drafter: learned by one engine's
    rounds and kept by the next engine of the same kind (the caller keys them), so that a process explores once."""

    def __init__(self, decay: float = DECAY):
        self.forward = ForwardCost(decay)  # f(T): the target's packed forward of T tokens
        self.draft_time = _Decayed(decay)  # x = drafts of one request's call, y = seconds
        self.step = ForwardCost(decay, proportional=True)  # shared drafting: one draft depth's forward of n rows
        self.untimed_drafts = 1  # draft calls still to skip (the first pays one-time costs)
        self.verify_row = _Decayed(decay)  # y = seconds of one verify row's acceptance (scores, verdict)


class DraftBudget:
    """Per-request draft lengths from load (module docstring). ``costs``: shared ``Costs`` (default: its own)."""

    def __init__(self, decay: float = DECAY, shared_cost: bool = False, costs: Costs | None = None):
        self.decay, self.shared_cost = decay, shared_cost
        self.costs = costs if costs is not None else Costs(decay)
        self.forward_cost, self.draft_time, self.step_cost = self.costs.forward, self.costs.draft_time, self.costs.step
        self.pooled = list(POOLED_PRIOR)  # decayed [accepted, rejected] of all requests
        self.requests: dict[int, list[float]] = {}  # request id -> decayed [accepted, rejected]
        self.idle: dict[int, int] = {}  # request id -> rounds at K = 0 since its last draft

    # ---- measurements ----------------------------------------------------------------------------------
    def record_forward(self, tokens: int, seconds: float) -> None:
        self.forward_cost.record(tokens, seconds)

    def record_draft(self, drafts: int, seconds: float) -> None:
        """One request's draft call: ``drafts`` tokens proposed in ``seconds`` (``shared_cost``: the round's one
        draft call, ``drafts`` its deepest request's length). The first call is not counted: it pays one-time
        costs (first allocations, a drafter's lazy set-up) that no later call pays."""
        if self._timed():
            self.draft_time.add(drafts, seconds)

    def record_draft_step(self, rows: int, seconds: float) -> None:
        """``shared_cost``: one draft depth's packed forward over ``rows`` requests took ``seconds`` (the first
        is not counted, as in ``record_draft``)."""
        if self._timed():
            self.step_cost.record(rows, seconds)

    def _timed(self) -> bool:
        """Whether this draft measurement counts (False for the first ``Costs.untimed_drafts`` of them)."""
        if self.costs.untimed_drafts:
            self.costs.untimed_drafts -= 1
            return False
        return True

    def record_verify_row(self, seconds: float) -> None:
        """One drafting request's acceptance work (processed scores at every node, the verdict): what a row that
        drafts costs beyond its share of the forward, against a plain row's one sampled token."""
        self.costs.verify_row.add(0.0, seconds)

    def verify_row_seconds(self) -> float:
        timed = self.costs.verify_row
        return timed.sy / timed.n if timed.n else 0.0

    def record_verdict(self, request_id: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        counts = self.requests.setdefault(request_id, [0.0, 0.0])
        rejected = 1.0 if accepted < drafted else 0.0
        for table in (counts, self.pooled):
            table[0] = self.decay * table[0] + accepted
            table[1] = self.decay * table[1] + rejected

    def release(self, request_ids: Sequence[int]) -> None:
        """Forget finished, cancelled or preempted requests."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.idle.pop(request_id, None)

    # ---- estimates -------------------------------------------------------------------------------------
    def alpha(self, request_id: int) -> float:
        """The request's acceptance per draft, its own counts over the pooled estimate's prior."""
        pooled = self.pooled[0] / (self.pooled[0] + self.pooled[1])
        accepted, rejected = self.requests.get(request_id, (0.0, 0.0))
        return min((accepted + PRIOR_WEIGHT * pooled) / (accepted + rejected + PRIOR_WEIGHT), 1 - 1e-6)

    def draft_seconds(self, drafts: int) -> float:
        """``d(K)``: seconds of one request's draft call of ``drafts`` tokens (0 until one was timed)."""
        if drafts <= 0 or self.draft_time.n == 0:
            return 0.0
        timed = self.draft_time
        mean_k, mean_s = timed.sx / timed.n, timed.sy / timed.n
        if timed.sxx / timed.n - mean_k**2 <= 0.25:  # one length seen so far: proportional (a forward per draft)
            return mean_s * drafts / max(mean_k, 1e-9)
        intercept, slope = timed.line(0.0)
        return max(intercept + slope * drafts, 0.0)  # a noisy line may cross 0; a draft never costs less

    def draft_timed(self) -> bool:
        """Whether a draft call (or, shared, a draft depth) has been timed yet."""
        return bool(self.step_cost.points()) if self.shared_cost else self.draft_time.n > 0

    def draft_step_seconds(self, rows: int) -> float:
        """``shared_cost``: seconds of one draft depth over ``rows`` requests; until one was timed,
        ``DRAFT_STEP_PRIOR`` of a target forward of as many tokens."""
        if rows <= 0:
            return 0.0
        if self.step_cost.points():
            return self.step_cost(rows)
        return DRAFT_STEP_PRIOR * self.forward_cost(rows)

    def round_draft_seconds(self, lengths) -> float:
        """Drafting seconds of a round whose requests draft ``lengths`` (shared: one forward per depth, over
        the requests drafting that deep)."""
        lengths = list(lengths)
        rows = sum(k > 0 for k in lengths) * self.verify_row_seconds()
        if self.shared_cost:
            return rows + sum(self.draft_step_seconds(sum(k > depth for k in lengths))
                              for depth in range(max(lengths, default=0)))
        return rows + sum(self.draft_seconds(k) for k in lengths)

    # ---- the choice ------------------------------------------------------------------------------------
    def plan(self, base_tokens: int, sampling_rows: int, candidates: Sequence[Candidate]) -> dict[int, int]:
        """K per candidate's request (0 for those that should not draft) for a round whose other rows pack
        ``base_tokens`` tokens and sample ``sampling_rows`` tokens."""
        candidates = [c if c.gains is None else c.capped(len(c.gains)) for c in candidates]
        if not self.draft_timed():  # until a draft was timed, short drafts: a first round cannot cost much
            candidates = [c.capped(PROBE_TOKENS) if c.gains is None else c for c in candidates]
        gains = sorted(((c.gain(self.alpha(c.request_id), k), c.request_id, k)
                        for c in candidates for k in range(1, c.max_drafts + 1)), reverse=True)
        lengths = dict.fromkeys((c.request_id for c in candidates), 0)
        tables = self._tables(base_tokens, candidates)
        best, chosen = sampling_rows / max(tables[0][0], 1e-9), []  # the plain round
        if not self._nobody_pays(gains, tables[0], sampling_rows, best):
            for allowed in self._subsets(gains, candidates):
                m, goodput = self._best_prefix(allowed, tables, sampling_rows, lengths)
                if goodput > best:
                    best, chosen = goodput, allowed[:m]
        for _, request_id, _ in chosen:
            lengths[request_id] += 1
        self._probe(lengths, candidates, base_tokens, sampling_rows, best)
        return lengths

    def _nobody_pays(self, gains, forward_s: list[float], sampling_rows: int, plain: float) -> bool:
        """True when no allocation can beat the plain round's goodput ``plain``: even the m largest gains of all,
        at the cost of the forward of m more tokens and one verify row's work (a lower bound of any m drafts'
        cost: draft costs are >= 0), never pay. One walk instead of the search's, for the rounds (most, where
        drafts are rarely accepted) in which the search would choose the plain round anyway."""
        tokens, row_s = float(sampling_rows), self.verify_row_seconds()
        for m, (gain, _, _) in enumerate(gains, start=1):
            tokens += gain
            if tokens / max(forward_s[m] + row_s, 1e-9) > plain:
                return False
        return True

    def _tables(self, base_tokens: int, candidates: Sequence[Candidate]) -> tuple[list, list, list, set]:
        """This round's costs, looked up once: ``f(T0 + m)`` for m drafts, ``d(k)`` per request's k, (shared)
        ``g(n)`` for a depth over n rows, and the requests whose drafts are sunk (known gains: ``d = 0``)."""
        forward_s = [self.forward_cost(base_tokens + m) for m in range(sum(c.max_drafts for c in candidates) + 1)]
        draft_s = [self.draft_seconds(k) for k in range(max((c.max_drafts for c in candidates), default=0) + 1)]
        step_s = [self.draft_step_seconds(n) for n in range(len(candidates) + 1)] if self.shared_cost else []
        return forward_s, draft_s, step_s, {c.request_id for c in candidates if c.gains is not None}

    def _subsets(self, gains, candidates: Sequence[Candidate]):
        """The gain lists the prefix walk runs over. Fixed costs (a verify row's acceptance work, a draft call's
        intercept, a shared draft depth's forward) make a short walk miss allocations that spread fewer, longer
        drafts, so: with a shared draft call, every cap on the depth (the deepest request sets the cost); per-request
        calls, the r most accepting requests for every r (for equal costs the best r requests are the most
        accepting)."""
        if self.shared_cost:
            for cap in range(max((c.max_drafts for c in candidates), default=0) + 1):
                yield [g for g in gains if g[2] <= cap]
            return
        ranked = [c.request_id for c in sorted(candidates, key=lambda c: -c.gain(self.alpha(c.request_id), 1)
                                                if c.max_drafts else 0.0)]
        for count in range(1, len(ranked) + 1):
            kept = set(ranked[:count])
            yield [g for g in gains if g[1] in kept]

    def _best_prefix(self, gains, tables: tuple[list, list, list], sampling_rows: int, lengths: dict[int, int]):
        """(m, goodput) of the best prefix of ``gains`` (marginal gain, request id, k), largest first, with this
        round's cost ``tables`` (``_tables``)."""
        forward_s, draft_s, step_s, sunk = tables
        row_s = self.verify_row_seconds()
        tokens, seconds_drafting, counts = float(sampling_rows), 0.0, dict(lengths)
        at_depth = [0] * (len(draft_s) + 1)  # shared: requests drafting at each depth
        best_m, best = 0, tokens / max(forward_s[0], 1e-9)
        for m, (gain, request_id, _) in enumerate(gains, start=1):
            k = counts[request_id] = counts[request_id] + 1
            tokens += gain
            if k == 1:  # the request becomes a verify row
                seconds_drafting += row_s
            if self.shared_cost:  # the k-th draft joins depth k - 1's forward
                rows = at_depth[k - 1] = at_depth[k - 1] + 1
                seconds_drafting += step_s[rows] - step_s[rows - 1]
            elif request_id not in sunk:
                seconds_drafting += draft_s[k] - draft_s[k - 1]
            goodput = tokens / max(forward_s[m] + seconds_drafting, 1e-9)
            if goodput > best:
                best_m, best = m, goodput
        return best_m, best

    def _probe(self, lengths: dict[int, int], candidates: Sequence[Candidate], base_tokens: int,
               sampling_rows: int, best: float) -> None:
        """Grant a short probe to one request idle for ``PROBE_EVERY`` rounds, when it costs little."""
        known = {c.request_id: c.gains for c in candidates}
        planned = None  # (tokens, drafts, paid lengths, sunk verify rows) of the plan, computed once if needed
        for candidate in candidates:
            request_id = candidate.request_id
            if lengths[request_id] > 0:
                self.idle[request_id] = 0
                continue
            self.idle[request_id] = idle = self.idle.get(request_id, 0) + 1
            counts = self.requests.get(request_id)
            if counts is not None:  # an idle request's own evidence fades towards the pooled estimate
                counts[0], counts[1] = self.decay * counts[0], self.decay * counts[1]
            probe = min(PROBE_TOKENS, candidate.max_drafts)
            if idle < PROBE_EVERY or probe <= 0 or candidate.gains is not None:  # known gains need no probe
                continue
            if planned is None:
                planned = (sampling_rows + sum(self._expected(r, k, known.get(r)) for r, k in lengths.items()),
                           sum(lengths.values()), [k for r, k in lengths.items() if known.get(r) is None],
                           sum(k > 0 and known.get(r) is not None for r, k in lengths.items()))
            tokens, drafted, paid, sunk_rows = planned
            seconds = self.forward_cost(base_tokens + drafted + probe) + self.round_draft_seconds([*paid, probe]) + \
                sunk_rows * self.verify_row_seconds()
            if (tokens + self._expected(request_id, probe)) / max(seconds, 1e-9) >= (1 - PROBE_LOSS) * best:
                lengths[request_id], self.idle[request_id] = probe, 0
                return

    def _expected(self, request_id: int, drafts: int, gains: tuple[float, ...] | None = None) -> float:
        """Expected accepted drafts of ``drafts`` (the next token is counted in ``sampling_rows``), from the
        request's known ``gains`` when its drafter gave them."""
        if drafts <= 0:
            return 0.0
        if gains is not None:
            return sum(gains[:drafts])
        alpha = self.alpha(request_id)
        return alpha * (1 - alpha**drafts) / (1 - alpha)

    def report(self) -> dict:
        """The estimates, for telemetry: f(T) at powers of two, d(K), the pooled acceptance."""
        return {"forward_s": {t: round(self.forward_cost(t), 5) for t in (1, 2, 4, 8, 16, 32, 64)},
                "draft_s": {k: round(self.draft_seconds(k), 5) for k in (1, 4, 8)},
                "pooled_alpha": round(self.pooled[0] / sum(self.pooled), 4),
                "measured_buckets": [round(t, 1) for t, _ in self.forward_cost.points()],
                "draft_step_s": {n: round(self.draft_step_seconds(n), 5) for n in (1, 2, 4, 8, 16)}
                if self.shared_cost else None}
