"""Real model (bundled SmolLM2-135M, fp32): speculative greedy output equals plain greedy. Slow (~1 min)."""

from __future__ import annotations

import pytest
import torch

import hf_kvspec

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarize in one sentence: The council voted to build bicycle lanes on a trial basis for one year.",
    "Write a Python function that returns the square of a number.",
    "Name three colors.",
]


def _inputs(tokenizer, prompts):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@pytest.mark.parametrize("spec", ["ngram", "draft:truncated:2"])
def test_bundled_greedy_is_exact(bundled, spec):
    model, tokenizer = bundled
    inputs = _inputs(tokenizer, PROMPTS)
    expected = model.generate(**inputs, do_sample=False, max_new_tokens=24)
    assistant = hf_kvspec.make_assistant(spec, model, 4)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=24,
                         custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert not out.acceptance.empty
