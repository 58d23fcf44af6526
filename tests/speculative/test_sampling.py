"""Speculative sampling through ``generate`` has the distribution of plain ``generate`` sampling.

The target is a bigram ``MarkovLM`` (tests/speculative/markov.py), so 100k rows run in about a second. The
reference is exact, not sampled: plain ``generate``'s own processed scores (``output_scores``) for every prefix,
chained into the joint distribution of the second and third tokens (t2, t3) and summed over t1 (all three
come from speculative rounds; the first round verifies the prompt with its drafts). Tolerance: TV < 0.01 at N = 100k samples; the expected TV of an exact sampler over these
<= 64 outcomes is sum_i sqrt(p_i (1 - p_i) / (2 pi N)) (asserted < 0.008; over 64 cells the TV of an exact
sampler spreads ~10% around that mean, so 0.01 is > 3 sigma away), while the negative control (processors
applied without each position's own prefix) lands above 0.02.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_kvspec
from hf_kvspec.speculative import loop
from tests.speculative.markov import markov_pair

N = 100_000
PROMPT = [5, 6, 7, 3]

CASES = {
    "temperature": dict(temperature=0.7, top_k=0),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.8, top_k=0),
    "repetition_penalty": dict(repetition_penalty=1.8, top_k=0),
    "combined": dict(repetition_penalty=1.3, temperature=0.8, top_k=5, top_p=0.9),
}


def _next_probs(model, prefixes: torch.Tensor, **sampling) -> torch.Tensor:
    """Plain generate's processed next-token distribution [R, V] after each prefix [R, L]."""
    out = model.generate(prefixes, attention_mask=torch.ones_like(prefixes), do_sample=True, max_new_tokens=1,
                         output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **sampling)
    return torch.softmax(out.scores[0].double(), dim=-1)


def exact_second_token(model, **sampling) -> torch.Tensor:
    """[V] exact P(t2) of plain generate, summed over the first token t1."""
    vocab = model.config.vocab_size
    prompt = torch.tensor([PROMPT])
    p1 = _next_probs(model, prompt, **sampling)[0]
    p2 = _next_probs(model, torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1), **sampling)
    return torch.einsum("a,ab->b", p1, p2)


def exact_joint(model, **sampling) -> torch.Tensor:
    """[V, V] exact P(t2, t3) of plain generate, summed over the first token t1."""
    vocab = model.config.vocab_size
    prompt = torch.tensor([PROMPT])
    p1 = _next_probs(model, prompt, **sampling)[0]  # [V]
    t1 = torch.arange(vocab)[:, None]
    p2 = _next_probs(model, torch.cat([prompt.expand(vocab, -1), t1], 1), **sampling)  # [V(t1), V(t2)]
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (t1, t2)
    p3 = _next_probs(model, torch.cat([prompt.expand(vocab * vocab, -1), pairs], 1), **sampling)
    p3 = p3.view(vocab, vocab, vocab)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def speculative_samples(target, assistant, max_new_tokens=4, **sampling):
    """(new tokens [N, max_new_tokens], the call's AcceptanceStats) of one speculative call over N rows."""
    ids = torch.tensor([PROMPT]).expand(N, -1)
    out = target.generate(ids, do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True, **sampling)
    return out.sequences[:, len(PROMPT):], out.acceptance


def _joint_tv(samples: torch.Tensor, exact: torch.Tensor) -> float:
    vocab = exact.shape[0]
    counts = torch.bincount(samples[:, 1] * vocab + samples[:, 2], minlength=vocab * vocab).double() / N
    return 0.5 * float((counts - exact.reshape(-1)).abs().sum())


def _noise_floor(exact: torch.Tensor) -> float:
    p = exact.reshape(-1)
    return float((p * (1 - p) / (2 * math.pi * N)).sqrt().sum())


@pytest.fixture(scope="module")
def pair():
    return markov_pair(vocab_size=8, seed=0, sharpness=1.5)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sample_drafts", [True, False], ids=["stochastic", "point_mass"])
def test_two_token_joint_matches_plain_sampling(pair, case, sample_drafts):
    target, draft = pair
    sampling = CASES[case]
    exact = exact_joint(target, **sampling)
    assert _noise_floor(exact) < 0.008
    torch.manual_seed(0)
    assistant = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=3, sample_drafts=sample_drafts)
    samples, stats = speculative_samples(target, assistant, **sampling)
    assert _joint_tv(samples, exact) < 0.01
    assert 0.05 < stats.mean_acceptance < 0.95  # drafts were really verified, partly kept


def test_default_top_k_50_on_a_larger_vocabulary():
    """Default sampling (top_k=50) on V=64: the first speculative token's marginal matches plain generate."""
    target, draft = markov_pair(vocab_size=64, seed=1, sharpness=5.0)
    exact = exact_second_token(target)
    torch.manual_seed(1)
    samples, _ = speculative_samples(target, hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=2))
    freq = torch.bincount(samples[:, 1], minlength=64).double() / N
    assert float((exact * (1 - exact) / (2 * math.pi * N)).sqrt().sum()) < 0.007
    assert 0.5 * float((freq - exact).abs().sum()) < 0.01


def test_negative_control_prefix_blind_processors_are_caught(pair, monkeypatch):
    """If every position saw the same prefix (the round's start), repetition penalty would be wrong: TV > 0.02."""
    target, draft = pair
    sampling = CASES["repetition_penalty"]
    exact = exact_joint(target, **sampling)
    original = loop.PositionwiseProcessor.__call__

    def prefix_blind(self, history, draft_tokens, logits, start=0):
        # process each position as if it followed the history only (ignores the draft tokens before it)
        return torch.cat([original(self, history, draft_tokens[:, :0], logits[:, j: j + 1])
                          for j in range(logits.shape[1])], dim=1)

    monkeypatch.setattr(loop.PositionwiseProcessor, "__call__", prefix_blind)
    torch.manual_seed(0)
    samples, _ = speculative_samples(target, hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=3,
                                                                           sample_drafts=False), **sampling)
    assert _joint_tv(samples, exact) > 0.02

