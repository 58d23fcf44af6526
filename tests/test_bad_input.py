"""Bad input is refused early, with the fix named: draft vocabularies, attention patches, and a table of the
public entry points' refusals (issue 18).

Each case states the input a user might pass and a fragment of the message that must name what was wrong.
"""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec._compat import attn_implementation
from tests.tiny_models import tiny_model


@pytest.fixture(autouse=True)
def _leave_registrations_as_found():
    yield
    hf_kvspec.unregister()  # enable_* registers its attention; other modules' tests expect a clean registry

# --- a draft model with a smaller vocabulary (issue 18, item 1) ------------------------------------------------


def _spec_generate(target, draft, ids, **kwargs):
    assistant = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=3)
    return target.generate(ids, max_new_tokens=12, pad_token_id=0, custom_generate=hf_kvspec.speculative_generate,
                           assistant=assistant, **kwargs)


def test_draft_with_smaller_vocabulary_never_sees_ids_it_cannot_embed():
    """Target ids 90..95 do not exist in a 90-id draft: they reach the draft as a substitute id, so drafting
    never indexes past its embedding, and greedy output stays exactly the target's own."""
    target = tiny_model("llama", seed=0)  # 96 ids
    draft = tiny_model("llama", seed=3, vocab_size=90)
    ids = torch.tensor([[5, 93, 7, 95, 91, 9]])  # ids the draft cannot embed, in the prompt
    out = _spec_generate(target, draft, ids, do_sample=False)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0))


def test_draft_with_smaller_vocabulary_samples_without_crashing():
    """Sampling: every sampled target token may fall outside the draft's vocabulary (here half the ids do)."""
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=3, vocab_size=48)
    ids = torch.tensor([[5, 60, 7], [80, 9, 95]])
    for seed in range(4):
        torch.manual_seed(seed)
        out = _spec_generate(target, draft, ids, do_sample=True, temperature=2.0, top_k=0)
        assert out.shape == (2, 3 + 12)


def test_draft_with_another_tokenizer_is_refused_before_any_forward():
    target = tiny_model("llama", seed=0, vocab_size=2000)
    draft = tiny_model("llama", seed=3, vocab_size=96)
    calls = []
    draft.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="same tokenizer"):
        _spec_generate(target, draft, torch.tensor([[5, 6, 7]]), do_sample=False)
    assert calls == []


# --- attention patches: one rule for every switch (issue 18, item 4) ----------------------------------------------


def test_second_enable_gqa_refuses_and_removal_restores_in_any_order():
    model = tiny_model("llama")
    first = hf_kvspec.enable_gqa(model)
    with pytest.raises(ValueError, match=r"already.*\.remove\(\)"):
        hf_kvspec.enable_gqa(model)
    assert attn_implementation(model.config) == "kvspec_gqa"
    first.remove()
    assert attn_implementation(model.config) == "sdpa"


def test_enable_gqa_after_quantized_attention_refuses():
    model = tiny_model("llama")
    with hf_kvspec.enable_quantized_attention(model), pytest.raises(ValueError, match="kvspec_quant"):
        hf_kvspec.enable_gqa(model)
    assert attn_implementation(model.config) == "sdpa"
    with hf_kvspec.enable_gqa(model):  # after removal the model takes a new switch
        assert attn_implementation(model.config) == "kvspec_gqa"
    assert attn_implementation(model.config) == "sdpa"


def test_switch_state_is_per_model():
    first, second = tiny_model("llama"), tiny_model("llama")
    with hf_kvspec.enable_gqa(first), hf_kvspec.enable_gqa(second):
        assert attn_implementation(second.config) == "kvspec_gqa"
    assert attn_implementation(first.config) == attn_implementation(second.config) == "sdpa"
