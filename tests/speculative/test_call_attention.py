"""The call's attention switch (speculative/call_attention.py): sdpa -> kvspec_gqa for one call, exact, undone."""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec import _compat
from hf_kvspec.speculative.call_attention import call_attention, switch_applies
from hf_kvspec.speculative.drafters.ngram import NgramAssistant
from tests.tiny_models import left_padded_batch, tiny_model

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10, 11, 9, 10, 11, 9]]


def _generate(model, assistant=None, **kwargs):
    ids, mask = left_padded_batch(PROMPTS)
    extra = dict(custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                 return_dict_in_generate=True) if assistant else {}
    return model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                          **extra, **kwargs)


class _Recording(NgramAssistant):
    """N-gram drafts, recording the target's attention at every proposal."""

    def __init__(self, model, **kwargs):
        super().__init__(max_ngram=3, num_draft_tokens=3, **kwargs)
        self.target, self.seen = model, []

    def propose(self, ctx):
        self.seen.append(_compat.attn_implementation(self.target.config))
        return super().propose(ctx)


def test_rule_grouped_sdpa_only():
    assert switch_applies(tiny_model("llama"))  # 4 query heads over 2 K/V heads, sdpa
    assert not switch_applies(tiny_model("llama", num_key_value_heads=4))  # no groups: nothing to save
    assert not switch_applies(tiny_model("llama", attn_implementation="eager"))


@pytest.mark.parametrize("switch", [None, False])
def test_greedy_equals_plain_with_and_without_the_switch(switch):
    model = tiny_model("llama")
    plain = _generate(model)
    assistant = _Recording(model)
    out = _generate(model, assistant, call_attention=switch)
    assert torch.equal(out.sequences, plain)
    assert set(assistant.seen) == ({"kvspec_gqa"} if switch is None else {"sdpa"})
    assert out.acceptance.attention == ("kvspec_gqa (switched from sdpa for this call)" if switch is None else None)
    assert _compat.attn_implementation(model.config) == "sdpa"


def test_switch_is_undone_when_the_call_fails():
    model = tiny_model("llama")

    class Failing(_Recording):
        def propose(self, ctx):
            super().propose(ctx)
            raise RuntimeError("drafter broke")

    assistant = Failing(model)
    with pytest.raises(RuntimeError, match="drafter broke"):
        _generate(model, assistant)
    assert assistant.seen == ["kvspec_gqa"] and _compat.attn_implementation(model.config) == "sdpa"


def test_explicit_switch_on_a_model_it_does_not_fit_is_refused():
    model = tiny_model("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match="call_attention=True"):
        _generate(model, _Recording(model), call_attention=True)
    with call_attention(model, None) as switched:  # the rule leaves eager alone
        assert switched is None and _compat.attn_implementation(model.config) == "eager"


def test_a_user_switch_is_left_alone():
    """A model the user switched to kvspec_gqa already: nothing to switch, nothing recorded, still switched."""
    model = tiny_model("llama")
    with hf_kvspec.enable_gqa(model):
        out = _generate(model, _Recording(model))
        assert out.acceptance.attention is None and _compat.attn_implementation(model.config) == "kvspec_gqa"
    assert _compat.attn_implementation(model.config) == "sdpa"
