"""Prompt-lookup drafting and the automatic draft length."""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec.speculative.autok import AutoDraftLength
from hf_kvspec.speculative.drafters.base import RoundOutcome
from hf_kvspec.speculative.drafters.ngram import lookup_continuation
from tests.tiny_models import left_padded_batch, tiny_model


def test_lookup_takes_the_latest_longest_match():
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2])
    assert lookup_continuation(seq, 3, 1, 3).tolist() == [4, 5, 7]  # "1 2" last seen before "4 5 7"
    assert lookup_continuation(torch.tensor([8, 1, 2, 3, 6, 2, 3]), 3, 1, 2).tolist() == [6, 2]
    assert lookup_continuation(torch.tensor([5, 6, 7]), 3, 1, 4).tolist() == []  # no earlier occurrence
    assert lookup_continuation(torch.tensor([4, 4]), 3, 1, 4).tolist() == [4]  # unigram, clipped by the end
    assert lookup_continuation(torch.tensor([1, 2, 1, 3, 2]), 3, 2, 4).tolist() == []  # min_ngram=2: no bigram


REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 10, 11, 12, 10], [13, 14, 15, 13], [20, 21]]


@pytest.mark.parametrize("k", [3, "auto"])
def test_ngram_greedy_is_exact_in_a_batch(k):
    target = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch(REPETITIVE)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0)
    assistant = hf_kvspec.NgramAssistant(max_ngram=3, num_draft_tokens=k)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.draft_forwards == 0 and sum(out.acceptance.accepted) > 0


def _outcome(k, accepted, draft_s, verify_s):
    num = torch.tensor(accepted)
    return RoundOutcome(kept_width=0, num_accepted=num, alive=torch.ones_like(num, dtype=torch.bool),
                        num_draft_tokens=k, draft_time_s=draft_s, verify_time_s=verify_s)


def _feed(auto, k, accepted, draft_per_token, verify_base, slope=0.15):
    auto.update(_outcome(k, accepted, draft_per_token * k, verify_base * (1 + slope * k)))


def test_auto_k_grows_with_cheap_accurate_drafts():
    auto = AutoDraftLength(max_draft_tokens=12)
    for step in range(30):
        _feed(auto, [4, 6, 8][step % 3], [[4], [6], [8]][step % 3], draft_per_token=0.0, verify_base=0.1)
    assert auto.alpha > 0.9 and auto.choose() >= 8


def test_auto_k_falls_back_to_plain_decoding_and_probes():
    auto = AutoDraftLength(max_draft_tokens=8, probe_every=5)
    for step in range(20):
        _feed(auto, [2, 4][step % 2], [0], draft_per_token=0.01, verify_base=0.1)  # never accepted
    choices = [auto.choose() for _ in range(10)]
    assert choices.count(0) >= 8 and max(choices) >= 1  # mostly plain decoding, with periodic probes


def test_auto_k_times_every_round_but_the_calls_first():
    """The first round of a call pays one-time costs (kernel weight packing, first allocations): its acceptance
    counts, its times do not; every later round (a plain step too) is a cost sample."""
    auto = AutoDraftLength(max_draft_tokens=8)
    auto.start_call(1)
    auto.update(_outcome(4, [4], draft_s=3.0, verify_s=5.0))  # the call's first round: acceptance only
    assert auto.verify_time.n == 0 and auto.draft_time.n == 0
    alpha = (auto.decay + 4) / (2 * auto.decay + 4)  # the decayed 1:1 prior plus 4 accepted, no rejection
    assert auto.alpha == pytest.approx(alpha)
    auto.update(_outcome(4, [4], draft_s=0.3, verify_s=0.5))
    assert (auto.verify_time.n, auto.verify_time.sx, auto.verify_time.sy) == (1, 4, 0.5)
    assert (auto.draft_time.n, auto.draft_time.sx, auto.draft_time.sy) == (1, 4, 0.3)
    auto.update(_outcome(0, [0], draft_s=0.0, verify_s=0.1))  # a plain step: a verify sample only
    assert auto.verify_time.n == pytest.approx(1 + auto.decay) and auto.draft_time.n == 1
    auto.start_call(1)  # the next call's first round is untimed again, the estimates carry over
    auto.update(_outcome(4, [4], draft_s=9.0, verify_s=9.0))
    assert auto.draft_time.n == 1 and auto.draft_time.sy == pytest.approx(0.3)


def test_auto_k_priors_choose_the_first_round_and_price_drafts():
    """set_priors: the first K is the priors' best (0 where no draft pays), and an untimed draft costs the prior."""
    costly = AutoDraftLength(max_draft_tokens=8)
    costly.set_priors(draft_ratio=0.9, acceptance=0.6)  # a draft costs nearly a step: plain decoding pays more
    assert costly.choose() == 0
    cheap = AutoDraftLength(max_draft_tokens=8)
    cheap.set_priors(draft_ratio=0.05, acceptance=0.8)
    best = max(range(9), key=lambda k: (1 - 0.8 ** (k + 1)) / 0.2 / (1 + 0.15 * k + 0.05 * k))
    assert cheap.choose() == best >= 3
    cheap.update(_outcome(best, [best], draft_s=0.0, verify_s=1.0))  # first round: untimed
    cheap.update(_outcome(0, [0], draft_s=0.0, verify_s=0.1))  # t0 = 0.1; no draft timed yet -> the prior prices them
    t0, slope = cheap.verify_time.line(cheap.prior_slope_ratio)
    assert cheap.rate(2) == pytest.approx(cheap.expected_tokens(2) / (t0 + 2 * slope + 2 * 0.05 * t0))
    with pytest.raises(ValueError, match="acceptance"):
        cheap.set_priors(0.1, 1.0)


def test_auto_k_follows_the_rows_left_after_others_finish():
    """Four rows accept everything, then three finish and the last accepts nothing: the costs are measured again
    and the acceptance restarts from the prior, so auto K falls to plain decoding within a few rounds."""
    auto = AutoDraftLength(max_draft_tokens=8)
    auto.start_call(4)
    for _ in range(12):
        _feed(auto, 4, [4, 4, 4, 4], draft_per_token=0.02, verify_base=0.2)
    assert auto.choose() >= 4
    choices = []
    for _ in range(8):
        k = auto.choose()
        choices.append(k)
        num = torch.tensor([0, 0, 0, 0])
        alive = torch.tensor([False, False, True, False])
        auto.update(RoundOutcome(kept_width=0, num_accepted=num, alive=alive, num_draft_tokens=k,
                                 draft_time_s=0.01 * k, verify_time_s=0.06 * (1 + 0.15 * k)))
    # the first one-row round still drafts the old K (nothing seen yet), then plain steps
    assert choices[0] >= 4 and choices[1:] == [0] * 7 and auto.verify_time.n < 8 and auto.alpha < 0.5


def test_auto_k_paces_a_batch_by_the_row_that_accepts_least():
    """Three rows accept every draft, one accepts none: the pooled acceptance is high, but the call lasts as long
    as the fourth row, which gains nothing from a draft, so auto K drafts nothing; rows keep their estimates by
    call row when another row leaves (call_rows), and once the poor row has left, the others draft again."""
    auto = AutoDraftLength(max_draft_tokens=8)
    auto.start_call(4)
    for _ in range(12):
        k = max(auto.choose(), 1)
        num = torch.tensor([k, k, 0, k])
        auto.update(RoundOutcome(kept_width=0, num_accepted=num, alive=torch.ones(4, dtype=torch.bool),
                                 num_draft_tokens=k, draft_time_s=0.02 * k, verify_time_s=0.2 * (1 + 0.15 * k),
                                 call_rows=[0, 1, 2, 3]))
    assert auto.pooled_alpha > 0.7 and auto.alpha == auto.row_alpha(2) < 0.2
    assert auto.choose() == 0
    # row 2 finishes and leaves; rows 0, 1, 3 are now active rows 0, 1, 2 and keep their own estimates
    for _ in range(4):
        k = max(auto.choose(), 1)
        auto.update(RoundOutcome(kept_width=0, num_accepted=torch.tensor([k, k, k]),
                                 alive=torch.ones(3, dtype=torch.bool), num_draft_tokens=k, draft_time_s=0.02 * k,
                                 verify_time_s=0.15 * (1 + 0.15 * k), call_rows=[0, 1, 3]))
    assert auto.live_rows == [0, 1, 3] and auto.alpha > 0.8 and auto.choose() >= 3


def test_a_row_that_leaves_in_a_plain_round_stops_pacing_the_choice():
    """The least-accepting row holds K at 0; it finishes during one of those plain rounds (K = 0). From that round
    on the rows still generating are the ones tracked: the acceptance the choice uses is theirs, not the departed
    row's, and the next round drafts again."""
    auto = AutoDraftLength(max_draft_tokens=8)
    auto.start_call(4)
    for _ in range(12):
        k = max(auto.choose(), 1)
        auto.update(RoundOutcome(kept_width=0, num_accepted=torch.tensor([k, k, 0, k]),
                                 alive=torch.ones(4, dtype=torch.bool), num_draft_tokens=k, draft_time_s=0.02 * k,
                                 verify_time_s=0.2 * (1 + 0.15 * k), call_rows=[0, 1, 2, 3]))
    assert auto.choose() == 0 and auto.alpha == auto.row_alpha(2) < 0.2
    auto.update(RoundOutcome(kept_width=0, num_accepted=torch.zeros(4, dtype=torch.long),
                             alive=torch.tensor([True, True, False, True]), num_draft_tokens=0, draft_time_s=0.0,
                             verify_time_s=0.2, call_rows=[0, 1, 2, 3]))
    assert auto.live_rows == [0, 1, 3]
    assert auto.alpha == min(auto.row_alpha(row) for row in (0, 1, 3)) > 0.8
    assert auto.choose() > 0  # the three rows left accept nearly everything: draft again


def test_auto_k_refuses_a_draft_as_costly_as_the_target():
    auto = AutoDraftLength(max_draft_tokens=8)
    for step in range(20):
        _feed(auto, [2, 4][step % 2], [[2], [4]][step % 2], draft_per_token=0.1, verify_base=0.1)
    assert auto.rate(0) > auto.rate(1) and auto.choose() == 0
