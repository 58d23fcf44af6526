"""Draft lengths by load (``draft_budget.py``): the cost curve's interpolation and prior, the per-request acceptance,
and the plan against a brute-force search over every combination of draft lengths (the independent reference)."""

from __future__ import annotations

import itertools

import pytest

from hf_kvspec.speculative import draft_budget
from hf_kvspec.speculative.draft_budget import Candidate, DraftBudget, ForwardCost


def _budget(curve, alphas, draft_s=None, shared=False, verify_row=0.003) -> DraftBudget:
    """A budget whose forward cost is ``curve(T)`` seconds (measured at every T up to 64), whose requests accept with
    ``alphas[i]`` (many rounds observed) and whose draft calls cost ``draft_s(K)`` (``shared``: once a round)."""
    budget = DraftBudget(decay=1.0, shared_cost=shared)
    for tokens in range(1, 65):
        budget.record_forward(tokens, curve(tokens))
    for request_id, alpha in enumerate(alphas):  # a thousand verdicts' worth: the prior hardly counts
        budget.requests[request_id] = [alpha * 1000.0, (1 - alpha) * 1000.0]
    for k in (1, 1, 2, 4, 8):  # the first is not counted
        budget.record_draft(k, draft_s(k) if draft_s else 0.0)
    budget.record_verify_row(verify_row)  # each drafting request's acceptance work
    if shared:  # one depth's forward over n rows: the first is not counted either
        budget.costs.untimed_drafts = 1
        for rows in (1, 1, 2, 3, 4, 6, 8):
            budget.record_draft_step(rows, draft_s(rows))
    return budget


def _goodput(budget, lengths, base, sampling) -> float:
    tokens = sampling + sum(budget._expected(r, k) for r, k in lengths.items())
    drafts = list(lengths.values())
    rows = sum(k > 0 for k in drafts) * budget.verify_row_seconds()
    if budget.shared_cost:  # written out: one forward per depth over the requests drafting that deep
        drafting = sum(budget.step_cost(sum(k > depth for k in drafts)) for depth in range(max(drafts))
                       ) if max(drafts) else 0.0
    else:
        drafting = sum(budget.draft_seconds(k) for k in drafts)
    return tokens / (budget.forward_cost(base + sum(drafts)) + drafting + rows)


def _brute_force(budget, candidates, base, sampling) -> float:
    best = 0.0
    for combo in itertools.product(*(range(c.max_drafts + 1) for c in candidates)):
        lengths = {c.request_id: k for c, k in zip(candidates, combo)}
        best = max(best, _goodput(budget, lengths, base, sampling))
    return best


@pytest.mark.parametrize(("curve", "alphas", "draft", "shared"), [
    (lambda t: 0.03 + 0.0004 * t, [0.8, 0.3, 0.6], None, False),  # flat forward: drafting pays for good requests
    (lambda t: 0.03 * t, [0.9, 0.9, 0.9], None, False),  # every token costs a step: nobody should draft
    (lambda t: 0.03 + 0.002 * t * t, [0.95, 0.5, 0.7], lambda k: 0.004, False),  # convex forward, a fixed draft cost
    (lambda t: 0.03 + 0.001 * t, [0.7, 0.7], lambda k: 0.002 * k, False),  # a draft cost per token
    (lambda t: 0.03 + 0.002 * t, [0.9, 0.6, 0.3], lambda n: 0.012 + 0.002 * n, True),  # shared, per depth
    (lambda t: 0.03 + 0.002 * t, [0.95, 0.9, 0.5], lambda n: 0.004 + 0.003 * n, True),
])
def test_the_plan_is_as_good_as_every_combination_of_lengths(curve, alphas, draft, shared):
    budget = _budget(curve, alphas, draft, shared)
    candidates = [Candidate(i, 5) for i in range(len(alphas))]
    for base, sampling in ((3, 3), (10, 3)):
        lengths = budget.plan(base, sampling, candidates)
        best = _brute_force(budget, candidates, base, sampling)
        if shared:  # fixed costs per depth and per row: the capped walks are near the optimum, not always on it
            assert best >= _goodput(budget, lengths, base, sampling) >= 0.97 * best
        else:
            assert _goodput(budget, lengths, base, sampling) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_the_quick_no_draft_check_never_skips_a_plan_that_pays(seed, shared):
    """``_nobody_pays`` ends the plan early only where the brute-force best is the plain round: random curves,
    acceptances (mostly low, where the check fires) and draft costs, with the search itself as the reference."""
    import random

    rng = random.Random(seed)
    slope, alphas = rng.uniform(0.0003, 0.01), [rng.uniform(0.0, 0.5) for _ in range(3)]
    fixed, per = rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.004)
    budget = _budget(lambda t: 0.03 + slope * t, alphas, lambda k: fixed + per * k, shared,
                     verify_row=rng.uniform(0.0, 0.004))
    candidates = [Candidate(i, 4) for i in range(3)]
    for base, sampling in ((3, 3), (8, 3)):
        gains = sorted(((c.gain(budget.alpha(c.request_id), k), c.request_id, k)
                        for c in candidates for k in range(1, 5)), reverse=True)
        forward_s = budget._tables(base, candidates)[0]
        plain = sampling / forward_s[0]
        if budget._nobody_pays(gains, forward_s, sampling, plain):
            assert _brute_force(budget, candidates, base, sampling) == pytest.approx(plain, rel=1e-12)
            assert sum(budget.plan(base, sampling, candidates).values()) <= 2  # at most a probe


@pytest.mark.parametrize(("curve", "draft"), [(lambda t: 0.03 + 0.0015 * t, None),
                                              (lambda t: 0.03 + 0.0004 * t * t, None),
                                              (lambda t: 0.03 + 0.0015 * t, lambda k: 0.004 + 0.003 * k)])
def test_known_gains_take_the_place_of_the_acceptance_estimate(curve, draft):
    """A drafter that knows its proposals (the suffix pool) gives each draft's gain: the plan equals a brute-force
    search whose expected tokens are those gains and whose draft seconds leave out their requests' (the lookup ran
    before the plan: sunk), a request is never given more drafts than it has gains, and a request with known gains
    is never probed."""
    budget = _budget(curve, [0.5, 0.5, 0.5], draft)
    known = {0: (1.0, 0.95, 0.9, 0.3), 1: (0.4, 0.1), 2: ()}
    candidates = [Candidate(0, 6, known[0]), Candidate(1, 6, known[1]), Candidate(2, 6, known[2]), Candidate(3, 3)]
    budget.requests[3] = [300.0, 700.0]  # alpha 0.3, no gains: the estimate as before

    def goodput(lengths):
        tokens = 3 + sum(budget._expected(r, k, known.get(r)) for r, k in lengths.items())
        rows = sum(k > 0 for k in lengths.values()) * budget.verify_row_seconds()
        drafting = sum(budget.draft_seconds(k) for r, k in lengths.items() if r not in known)
        return tokens / (budget.forward_cost(3 + sum(lengths.values())) + rows + drafting)

    lengths = budget.plan(3, 3, candidates)
    assert lengths[2] == 0 and lengths[1] <= 2 and lengths[0] <= 4
    best = max(goodput(dict(zip(range(4), combo)))
               for combo in itertools.product(range(5), range(3), range(1), range(4)))
    assert goodput(lengths) == pytest.approx(best, rel=1e-9)
    for _ in range(3 * draft_budget.PROBE_EVERY):  # never probed, however long it idles
        assert budget.plan(3, 3, [Candidate(2, 6, ())])[2] == 0


def test_known_gains_are_not_held_to_short_drafts_before_a_draft_was_timed():
    """Until a draft call was timed, guessed drafts are capped at ``PROBE_TOKENS``; known gains (a lookup already
    made) are not: a flat forward grants every gain."""
    budget = DraftBudget(decay=1.0)
    for tokens in range(1, 65):
        budget.record_forward(tokens, 0.03)
    lengths = budget.plan(1, 1, [Candidate(0, 6, (0.9,) * 6), Candidate(1, 6)])
    assert not budget.draft_timed() and lengths == {0: 6, 1: draft_budget.PROBE_TOKENS}


def test_a_steep_forward_means_no_drafts_and_a_flat_one_means_all_of_them():
    candidates = [Candidate(0, 6), Candidate(1, 6)]
    assert budget_plan(lambda t: 0.03 * t, [0.9, 0.9], candidates) == {0: 0, 1: 0}
    assert budget_plan(lambda t: 0.03, [0.9, 0.9], candidates) == {0: 6, 1: 6}


def budget_plan(curve, alphas, candidates):
    return _budget(curve, alphas).plan(len(alphas), len(alphas), candidates)


def test_the_forward_cost_interpolates_between_buckets_and_follows_the_prior_beyond():
    cost = ForwardCost(decay=1.0)
    assert cost(4) == pytest.approx(draft_budget.prior(4))  # nothing measured: the prior's units
    cost.record(1, 0.030)
    cost.record(8, 0.050)
    assert cost(1) == pytest.approx(0.030) and cost(8) == pytest.approx(0.050)
    assert cost(4) == pytest.approx(0.030 + 0.020 * 3 / 7)
    assert cost(32) == pytest.approx(0.050 * draft_budget.prior(32) / draft_budget.prior(8))
    compute_bound = ForwardCost(decay=1.0, proportional=True)  # the draft forward's curve: linear past the data
    compute_bound.record(2, 0.020)
    assert compute_bound(8) == pytest.approx(0.080) and compute_bound(1) == pytest.approx(0.020 * draft_budget.prior(1)
                                                                                            / draft_budget.prior(2))


def test_acceptance_starts_from_the_pooled_estimate_and_follows_the_request():
    budget = DraftBudget(decay=1.0)
    assert budget.alpha(7) == pytest.approx(0.8)  # the optimistic prior: a new engine drafts and measures
    for _ in range(50):
        budget.record_verdict(1, 4, 4)  # request 1 accepts everything
        budget.record_verdict(2, 4, 0)  # request 2 nothing
    assert budget.alpha(1) > 0.95 and budget.alpha(2) < 0.05
    pooled = budget.pooled[0] / sum(budget.pooled)
    assert budget.alpha(3) == pytest.approx(pooled)  # a new request: the pooled estimate
    budget.release([1, 2])
    assert budget.alpha(1) == pytest.approx(pooled) and not budget.requests


def test_an_idle_request_is_probed_only_when_the_probe_is_cheap():
    cheap = _budget(lambda t: 0.03 * t, [0.9], None)  # steep: K = 0, but a probe with free drafting costs
    rounds = [cheap.plan(1, 1, [Candidate(0, 4)])[0] for _ in range(3 * draft_budget.PROBE_EVERY)]
    assert sum(rounds) == 0  # a 2-token probe costs 2 more steps there: more than PROBE_LOSS
    # a flat forward and a fixed draft cost just above break-even: 2 drafts emit 1.24 tokens for 1.245 steps
    near = _budget(lambda t: 0.03, [0.2], lambda k: 0.245 * 0.03, verify_row=0.0)
    near.requests[0] = [0.0, 0.0]
    near.pooled = [200.0, 800.0]  # alpha 0.2, which idle rounds fade towards
    rounds = [near.plan(1, 1, [Candidate(0, 2)])[0] for _ in range(3 * draft_budget.PROBE_EVERY)]
    assert rounds.count(draft_budget.PROBE_TOKENS) >= 2 and rounds.count(0) > len(rounds) // 2


def test_draft_seconds_follow_a_line_and_are_free_until_timed():
    budget = DraftBudget(decay=1.0)
    assert budget.draft_seconds(4) == 0.0
    budget.record_draft(4, 9.0)  # the first call pays one-time costs: not counted
    assert budget.draft_seconds(4) == 0.0
    for k in (1, 2, 4, 8):
        budget.record_draft(k, 0.001 + 0.002 * k)
    assert budget.draft_seconds(0) == 0.0
    assert budget.draft_seconds(6) == pytest.approx(0.013)
