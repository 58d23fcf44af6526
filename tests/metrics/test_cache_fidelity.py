"""cache_fidelity and its token_statistics helper on hand-made logits with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from hf_kvspec import load_metric
from hf_kvspec.metrics import token_statistics


def _compute(logits, reference_logits, labels) -> dict:
    return load_metric("cache_fidelity", keep_in_memory=True).compute(
        **token_statistics(logits, reference_logits, labels))


def test_identical_logits_give_zero_kl_and_full_agreement():
    logits = torch.randn(2, 7, 50, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    result = _compute(logits, logits.clone(), labels)
    assert result["kl_divergence"] == 0.0 and result["kl_divergence_max"] == 0.0  # exact: log p - log p is 0
    assert result["top1_agreement"] == 1.0 and result["delta_perplexity_percent"] == 0.0 and result["tokens"] == 14
    assert result["perplexity"] == result["reference_perplexity"]


def test_perplexity_matches_a_direct_cross_entropy():
    gen = torch.Generator().manual_seed(2)
    logits, reference = torch.randn(3, 9, 40, generator=gen), torch.randn(3, 9, 40, generator=gen)
    labels = torch.randint(0, 40, (3, 9), generator=gen)
    result = _compute(logits, reference, labels)
    direct = math.exp(torch.nn.functional.cross_entropy(logits.reshape(-1, 40).double(), labels.reshape(-1)).item())
    direct_reference = math.exp(torch.nn.functional.cross_entropy(reference.reshape(-1, 40).double(),
                                                                  labels.reshape(-1)).item())
    # fp32 log-softmax in the helper vs fp64 here: relative error ~1e-7 per token, averaged
    assert result["perplexity"] == pytest.approx(direct, rel=1e-6)
    assert result["reference_perplexity"] == pytest.approx(direct_reference, rel=1e-6)
    assert result["delta_perplexity_percent"] == pytest.approx(100 * (direct / direct_reference - 1), abs=1e-4)


def test_kl_and_agreement_by_hand():
    # two tokens, vocabulary 2. Token 0: full [1/2, 1/2], cache [1/4, 3/4]; token 1: full [0.9, 0.1], cache the same.
    reference = torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]).log()
    cache = torch.tensor([[[0.25, 0.75], [0.9, 0.1]]]).log()
    labels = torch.tensor([[1, 0]])
    kl_first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    result = _compute(cache, reference, labels)
    assert result["kl_divergence"] == pytest.approx(kl_first / 2, rel=1e-6)  # fp32 logs: ~1e-7 relative
    assert result["kl_divergence_max"] == pytest.approx(kl_first, rel=1e-6)
    # argmax: token 0 ties in the full model (torch picks index 0) vs 1 in the cache -> differ; token 1 agrees
    assert result["top1_agreement"] == 0.5
    assert result["perplexity"] == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.9)) / 2), rel=1e-6)


def test_ignored_labels_are_not_scored():
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([[3, -100, 5, -100]])
    stats = token_statistics(logits, logits, labels)
    assert len(stats["logprob"]) == 2
    assert stats["logprob"] == pytest.approx(torch.log_softmax(logits[0, [0, 2]], -1)[[0, 1], [3, 5]].tolist())


def test_a_full_precision_zero_probability_adds_nothing_to_kl():
    reference = torch.tensor([[[0.0, float("-inf"), 0.0]]])
    cache = torch.tensor([[[0.0, 0.0, 0.0]]])
    stats = token_statistics(cache, reference, torch.tensor([[0]]))
    assert stats["kl"] == pytest.approx([math.log(3 / 2)], rel=1e-6)  # sum over the two live tokens of 1/2 log(3/2)


def test_add_batch_over_chunks_equals_one_batch():
    gen = torch.Generator().manual_seed(4)
    logits, reference = torch.randn(1, 12, 30, generator=gen), torch.randn(1, 12, 30, generator=gen)
    labels = torch.randint(0, 30, (1, 12), generator=gen)
    metric = load_metric("cache_fidelity", keep_in_memory=True)
    for start in range(0, 12, 5):
        metric.add_batch(**token_statistics(logits[:, start:start + 5], reference[:, start:start + 5],
                                            labels[:, start:start + 5]))
    # per-row log-softmax may round differently in a smaller batch; sums are fsum (order-free)
    assert metric.compute() == pytest.approx(_compute(logits, reference, labels), rel=1e-6)


def test_shape_mismatch_names_the_fix():
    with pytest.raises(ValueError, match="shifted"):
        token_statistics(torch.zeros(1, 3, 5), torch.zeros(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["logits", "reference_logits"])
def test_non_finite_logits_are_refused(bad, which):
    """NaN (or +inf) logits used to flow into NaN perplexity and KL without a word."""
    logits = {"logits": torch.randn(1, 4, 10), "reference_logits": torch.randn(1, 4, 10)}
    logits[which][0, 2, 3] = bad
    with pytest.raises(ValueError, match=rf"{which} hold NaN or \+inf at \[0, 2\]"):
        token_statistics(**logits, labels=torch.randint(0, 10, (1, 4)))


def test_masked_vocabulary_entries_are_fine_but_an_all_masked_row_is_not():
    logits = torch.randn(1, 4, 10)
    logits[0, :, 5:] = float("-inf")  # a processor masked half the vocabulary: still a distribution
    stats = token_statistics(logits, logits, torch.zeros(1, 4, dtype=torch.long))
    assert stats["kl"] == [0.0] * 4
    logits[0, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"logits give no distribution at \[0, 1\]"):
        token_statistics(logits, logits.clone(), torch.zeros(1, 4, dtype=torch.long))


def test_nan_token_statistics_are_refused():
    with pytest.raises(ValueError, match=r"kl holds NaN"):
        load_metric("cache_fidelity", keep_in_memory=True).compute(
            logprob=[-1.0, -2.0], reference_logprob=[-1.0, -2.0], kl=[0.0, float("nan")], top1_match=[True, True])
