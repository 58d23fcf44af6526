"""Verifier: pure tensor checks against closed-form acceptance and output distributions.

Tolerances: with N samples, an empirical frequency has standard error sqrt(p(1-p)/N); at N = 100k over the
<= 16 outcomes used here the expected TV of an exact sampler is about sum_i sqrt(p_i/(2 pi N)) ~ 0.004, so
TV < 0.01 leaves > 2x margin, while the broken verifiers below land at TV > 0.05.
"""

from __future__ import annotations

import torch

from hf_kvspec.speculative.verify import greedy_verify, is_chain, rejection_verify, sample_tokens

N = 100_000
V = 16


def _dists(seed: int, rows: int, sharp: float = 1.5):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=gen) * sharp, dim=-1)


def _freq(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def test_greedy_chain_longest_matching_prefix():
    draft = torch.tensor([[3, 4, 5], [3, 9, 5], [7, 4, 5]])
    target = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    result = greedy_verify(draft, target)
    assert result.num_accepted.tolist() == [3, 1, 0]
    assert result.next_tokens.tolist() == [6, 4, 3]
    assert result.accepted_nodes.tolist() == [[0, 1, 2], [0, -1, -1], [-1, -1, -1]]


def test_greedy_tree_follows_the_matching_branch():
    # root -> {0: 3, 1: 8}; 0 -> {2: 4}; 1 -> {3: 4}. Target argmax: root 8, after node 1 -> 4, after node 3 -> 6
    parents = torch.tensor([-1, -1, 0, 1])
    draft = torch.tensor([[3, 8, 4, 4]])
    target = torch.tensor([[8, 0, 4, 0, 6]])  # column n + 1 = after node n
    result = greedy_verify(draft, target, parents)
    assert result.num_accepted.tolist() == [2]
    assert result.accepted_nodes.tolist() == [[1, 3]]
    assert result.next_tokens.tolist() == [6]
    chain = torch.tensor([-1, 0, 1])
    assert is_chain(chain, 3) and not is_chain(parents, 4)


def test_acceptance_rate_matches_sum_of_min():
    """Seed check (d): alpha from 100k samples within 1% of sum(min(p, q))."""
    torch.manual_seed(0)
    target, draft = _dists(1, 1), _dists(2, 1)
    tokens = torch.multinomial(draft.expand(N, V), 1)  # [N, 1] drafts really sampled from q
    result = rejection_verify(tokens, target[:, None].expand(N, 2, V), draft[:, None].expand(N, 1, V))
    alpha = float(result.num_accepted.double().mean())
    expected = float(torch.minimum(target, draft).sum())
    assert abs(alpha - expected) < 0.01 * expected, (alpha, expected)


def test_emitted_token_distribution_is_target():
    """Seed check (e): the first emitted token of speculative sampling is distributed as the target."""
    torch.manual_seed(1)
    target, draft = _dists(3, 1), _dists(4, 1)
    tokens = torch.multinomial(draft.expand(N, V), 1)
    result = rejection_verify(tokens, target[:, None].expand(N, 2, V), draft[:, None].expand(N, 1, V))
    first = torch.where(result.num_accepted > 0, tokens[:, 0], result.next_tokens)
    assert _tv(_freq(first), target[0]) < 0.01


def test_point_mass_drafts_keep_target_distribution():
    torch.manual_seed(2)
    target = _dists(5, 1)
    fixed = torch.full((N, 1), int(target.argmin()))  # a bad deterministic draft: rarely right, never biased
    result = rejection_verify(fixed, target[:, None].expand(N, 2, V), None)
    first = torch.where(result.num_accepted > 0, fixed[:, 0], result.next_tokens)
    assert _tv(_freq(first), target[0]) < 0.01
    assert abs(float(result.num_accepted.double().mean()) - float(target.min())) < 0.005


def _markov_chain_samples(parents=None, stochastic=True, seed=0):
    """Two emitted tokens from a chain/tree over a Markov target p(x_t | x_{t-1}) and draft q(x_t | x_{t-1})."""
    torch.manual_seed(seed)
    p_table, q_table = _dists(10, V), _dists(11, V)  # [V, V] row = previous token
    last = torch.full((N,), 3)
    if parents is None:  # chain of 2: x1 ~ q(.|last), x2 ~ q(.|x1)
        x1 = torch.multinomial(q_table[last], 1)[:, 0]
        x2 = torch.multinomial(q_table[x1], 1)[:, 0]
        drafts = torch.stack([x1, x2], 1)
        draft_probs = torch.stack([q_table[last], q_table[x1]], 1)
        target_probs = torch.stack([p_table[last], p_table[x1], p_table[x2]], 1)
    else:  # two siblings drawn i.i.d. from q(.|last)
        drafts = torch.multinomial(q_table[last], 2, replacement=True)
        draft_probs = q_table[last][:, None].expand(N, 2, V)
        target_probs = torch.stack([p_table[last], p_table[drafts[:, 0]], p_table[drafts[:, 1]]], 1)
    result = rejection_verify(drafts, target_probs, draft_probs if stochastic else None, parents)
    emitted = torch.cat([result.accepted_tokens(drafts), result.next_tokens[:, None]], 1)
    emitted.scatter_(1, result.num_accepted[:, None], result.next_tokens[:, None])
    return emitted, result, p_table[3]


def test_chain_first_token_is_target_distribution():
    emitted, result, p_first = _markov_chain_samples()
    assert _tv(_freq(emitted[:, 0]), p_first) < 0.01
    assert set(result.num_accepted.unique().tolist()) == {0, 1, 2}  # rejected, recovered and bonus all occur


def test_tree_siblings_keep_target_distribution():
    parents = torch.tensor([-1, -1])
    for stochastic in (True, False):
        emitted, result, p_first = _markov_chain_samples(parents, stochastic, seed=3)
        assert _tv(_freq(emitted[:, 0]), p_first) < 0.01
        assert int(result.num_accepted.max()) == 1


def test_accept_everything_verifier_would_be_caught():
    """Negative control: transformers PR #28508's bug (accept every draft) is far outside the tolerance."""
    torch.manual_seed(4)
    target, draft = _dists(3, 1), _dists(4, 1)
    tokens = torch.multinomial(draft.expand(N, V), 1)
    assert _tv(_freq(tokens[:, 0]), target[0]) > 0.05


def test_sample_tokens_draws_the_categorical_distribution():
    """The loop's inverse-CDF sampler vs the exact probabilities (unnormalised input, zeros never drawn);
    TV < 0.01 at 100k samples, the same tolerance as checks (d)/(e)."""
    torch.manual_seed(5)
    probs = _dists(6, 1)[0]
    probs[::3] = 0.0  # a third of the vocabulary impossible
    drawn = sample_tokens(3.5 * probs.expand(N, V))  # [N]
    assert not bool(torch.isin(drawn, torch.arange(0, V, 3)).any())
    assert _tv(_freq(drawn), probs / probs.sum()) < 0.01
