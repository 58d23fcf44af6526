"""``SuffixAssistant`` in ``generate``: greedy output equals plain greedy (trees and chains, left-padded batches,
rows that finish early), a later call drafts from what earlier calls generated, sampled output keeps plain
sampling's joint law (point-mass drafts from a pool that other rows filled), and the draft size rule."""

from __future__ import annotations

import math

import pytest
import torch

import hf_kvspec
from hf_kvspec.speculative.drafters.suffix import SuffixAssistant, proposal_of, worth_verifying
from hf_kvspec.speculative.suffix_pool import SuffixDraft, SuffixPool
from tests.speculative.markov import markov_pair
from tests.speculative.test_sampling import PROMPT, _noise_floor, exact_joint
from tests.tiny_models import left_padded_batch, tiny_model

MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, vocab_size=16)  # few ids: the model's own output repeats, so drafts hit


def _plain(model, ids, mask, max_new=MAX_NEW):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=0)


def _suffix(model, ids, mask, assistant, max_new=MAX_NEW):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True)


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
def test_greedy_equals_plain_greedy_and_later_calls_draft_from_earlier_ones(target, tree):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 1, 2, 3, 4], [3]]
    ids, mask = left_padded_batch(prompts)
    assistant = SuffixAssistant(tree=tree, min_prob=0.05)
    first = _suffix(target, ids, mask, assistant)
    assert torch.equal(first.sequences, _plain(target, ids, mask))
    again = _suffix(target, ids, mask, assistant)  # the same prompts: the pool holds their whole outputs
    assert torch.equal(again.sequences, first.sequences)
    assert again.acceptance.tokens_per_target_forward > 3
    one, one_mask = left_padded_batch(prompts[2:3])  # one row alone, with rows finishing early elsewhere
    alone = _suffix(target, one, one_mask, assistant, max_new=9)
    assert torch.equal(alone.sequences, _plain(target, one, one_mask, max_new=9))
    stats = assistant.report()["suffix_pool"]
    assert stats["sequences"] == 9 and stats["hits"] > 0  # every row of every call stays as history


def test_a_draft_is_cut_where_verifying_more_stops_paying():
    sure = SuffixDraft((1, 2, 3, 4), (-1, 0, 1, 2), (1.0, 1.0, 1.0, 1.0), 4)
    assert worth_verifying(sure).tokens == (1, 2, 3, 4)
    # on the prior curve a 3-token forward costs 1.235 steps and a 2-token one 1.18: 0.05 more expected tokens
    # (1.95 / 1.235 = 1.58) do not pay, where 1.9 / 1.18 = 1.61 does
    doubtful = SuffixDraft((1, 2, 3), (-1, 0, 1), (0.9, 0.05, 0.04), 3)
    assert worth_verifying(doubtful).tokens == (1,)
    assert worth_verifying(SuffixDraft((1,), (-1,), (0.1,), 1)).tokens == ()


def test_rows_of_a_batch_share_one_proposal_shape():
    chain, tree = SuffixDraft((4, 5), (-1, 0), (1.0, 1.0)), SuffixDraft((6, 7, 8), (-1, 0, -1), (0.6, 0.6, 0.4))
    both = proposal_of([chain, tree, SuffixDraft()], fill=[1, 2, 3], tree=True)
    assert both.tokens.tolist() == [[4, 5, 1], [6, 7, 8], [3, 3, 3]]
    assert both.parents.tolist() == [[-1, 0, -1], [-1, 0, -1], [-1, -1, -1]]
    chains = proposal_of([chain, SuffixDraft((9,), (-1,), (1.0,))], fill=[1, 2], tree=True)
    assert chains.parents is None and chains.tokens.tolist() == [[4, 5], [9, 2]]


def test_sampled_output_keeps_plain_samplings_law():
    """Point-mass drafts from a pool filled by earlier rows' samples (so the drafts are often right, often
    wrong): the joint law of the second and third tokens is plain sampling's. 20k rows: the TV of an exact sampler
    is about the noise floor (spread ~10% around it); 1.35x the floor is > 3 spreads away."""
    model, _ = markov_pair(vocab_size=8, seed=0, sharpness=1.5)
    sampling = dict(temperature=0.7, top_k=0)
    pool = SuffixPool(share_unsalted=True)
    torch.manual_seed(1)
    rows = 20_000
    ids = torch.tensor([PROMPT]).expand(rows, -1)
    assistant = SuffixAssistant(pool=pool, tree=True, min_prob=0.05)
    model.generate(ids[:2000], do_sample=True, max_new_tokens=4, pad_token_id=0,
                   custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **sampling)  # fills the pool
    out = model.generate(ids, do_sample=True, max_new_tokens=4, pad_token_id=0, return_dict_in_generate=True,
                         custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **sampling)
    samples = out.sequences[:, len(PROMPT):]
    exact = exact_joint(model, **sampling)
    vocab = exact.shape[0]
    counts = torch.bincount(samples[:, 1] * vocab + samples[:, 2], minlength=vocab * vocab).double() / rows
    tv = 0.5 * float((counts - exact.reshape(-1)).abs().sum())
    floor = _noise_floor(exact) * math.sqrt(100_000 / rows)
    stats = out.acceptance
    assert sum(stats.drafted) > rows and 0.1 < stats.mean_acceptance < 0.9  # drafts were verified, kept, rejected
    assert tv < 1.35 * floor, f"TV {tv:.4f}, floor {floor:.4f}"


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="not 'auto'"):
        SuffixAssistant(num_draft_tokens="auto")
    with pytest.raises(TypeError, match="pool must be a SuffixPool"):
        SuffixAssistant(pool={})
    with pytest.raises(ValueError, match="min_prob"):
        SuffixAssistant(min_prob=0)
