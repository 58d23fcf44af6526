"""``QuantizedSelfAssistant``: the target drafts from an int8 / int4 copy of itself; output is the fp32 target's.

Greedy: token-identical to plain ``generate`` (the suite runs the target on the fast forward, as the loop does
by default). Sampling: the first speculative token's marginal against plain ``generate``'s exact distribution
(same tolerance argument as test_sampling.py: TV < 0.01 at N = 100k with a noise floor asserted below it).
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_kvspec
from hf_kvspec.kernels import quantized
from hf_kvspec.speculative.assistants import check_spec, make_assistant
from tests.speculative.helpers import batch
from tests.speculative.test_sampling import N, exact_second_token, speculative_samples
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not quantized.available(), reason="the quantized kernels need a C compiler")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return tiny_model(request.param, seed=0)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_greedy_is_identical_to_plain(target, weights):
    ids, mask = batch(3)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    expected = target.generate(ids, **kw)
    assistant = hf_kvspec.QuantizedSelfAssistant(target, weights=weights, num_draft_tokens=4)
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, expected)
    stats = out.acceptance
    assert stats.tokens_per_target_forward > 1.5  # a copy of the target agrees with it most of the time
    assert stats.drafter["weights"] == weights and stats.drafter["forward"] == "fast"
    bits = 8 if weights == "int8" else 4
    linear = sum(m.weight.numel() for m in target.modules() if isinstance(m, torch.nn.Linear))
    assert linear * bits // 8 <= stats.drafter["packed_bytes"] < linear * 4 // 2  # codes + scales, < half fp32


@pytest.mark.slow  # 100k rows through a tiny Llama: ~20 s on 2 cores
def test_sampled_first_token_has_the_targets_distribution():
    target = tiny_model("llama", seed=2)
    sampling = dict(temperature=0.5, top_k=6)
    exact = exact_second_token(target, **sampling)
    assert float((exact * (1 - exact) / (2 * math.pi * N)).sqrt().sum()) < 0.007
    torch.manual_seed(3)
    assistant = hf_kvspec.QuantizedSelfAssistant(target, weights="int4", num_draft_tokens=2)
    samples, stats = speculative_samples(target, assistant, **sampling)
    freq = torch.bincount(samples[:, 1], minlength=exact.shape[0]).double() / N
    assert 0.5 * float((freq - exact).abs().sum()) < 0.01
    assert 0.05 < stats.mean_acceptance < 0.999  # drafts were verified, and some rejected


def test_specs_and_refusals(target):
    assert check_spec("self-int8") == ("self", "int8") and check_spec("self-int4") == ("self", "int4")
    assistant = make_assistant("self-int4", target, 3)
    assert isinstance(assistant, hf_kvspec.QuantizedSelfAssistant) and assistant.weights == "int4"
    with pytest.raises(ValueError, match="weights must be one of"):
        hf_kvspec.QuantizedSelfAssistant(target, weights="int2")
    with pytest.raises(ValueError, match=r"sliding-window.*ngram"):
        hf_kvspec.QuantizedSelfAssistant(tiny_model("mistral"))
    other = tiny_model("llama", seed=9)
    with pytest.raises(ValueError, match="one per target"):
        other.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=3, do_sample=False,
                       custom_generate=hf_kvspec.speculative_generate, assistant=assistant)


def test_the_target_is_left_as_it_was(target):
    target.train()
    try:
        hf_kvspec.QuantizedSelfAssistant(target)
        assert target.training
    finally:
        target.eval()
