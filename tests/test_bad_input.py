"""Bad input is refused early, with the fix named: draft vocabularies, attention patches, and a table of the
public entry points' refusals (issue 18).

Each case states the input a user might pass and a fragment of the message that must name what was wrong.
"""

from __future__ import annotations

import re

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


# --- the audit: public entry points refuse bad input early, naming the fix ------------------------------------

_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_model("llama")
    return _MODEL


def _generate(**kwargs):
    return _model().generate(torch.tensor([[5, 6, 7]]), pad_token_id=0, max_new_tokens=4,
                             custom_generate=hf_kvspec.speculative_generate, **kwargs)


# (input as a user writes it, call, exception, fragment of the message that names what was wrong or the fix)
BAD_INPUTS = [
    ("NgramAssistant(max_ngram=2.5)", lambda: hf_kvspec.NgramAssistant(max_ngram=2.5), ValueError, "max_ngram=2.5"),
    ("NgramAssistant(max_ngram=0)", lambda: hf_kvspec.NgramAssistant(max_ngram=0), ValueError, "1 <= min_ngram"),
    ("NgramAssistant(num_draft_tokens=-1)", lambda: hf_kvspec.NgramAssistant(num_draft_tokens=-1), ValueError,
     "non-negative int or 'auto'"),
    ("DraftModelAssistant(None)", lambda: hf_kvspec.DraftModelAssistant(None), TypeError, "AutoModelForCausalLM"),
    ("DraftModelAssistant('gpt2')", lambda: hf_kvspec.DraftModelAssistant("gpt2"), TypeError, "draft:<dir>"),
    ("truncated_draft(model, 1.5)", lambda: hf_kvspec.truncated_draft(_model(), 1.5), ValueError, "1..2"),
    ("truncated_draft(model, '1')", lambda: hf_kvspec.truncated_draft(_model(), "1"), ValueError, "1..2"),
    ("truncated_draft(model, 0)", lambda: hf_kvspec.truncated_draft(_model(), 0), ValueError, "1..2"),
    ("enable_gqa(None)", lambda: hf_kvspec.enable_gqa(None), TypeError, "loaded transformers model"),
    ("enable_gqa(model.config)", lambda: hf_kvspec.enable_gqa(_model().config), TypeError, "not its config"),
    ("enable_quantized_attention(None)", lambda: hf_kvspec.enable_quantized_attention(None), TypeError,
     "loaded transformers model"),
    ("enable_mla_absorb(llama)", lambda: hf_kvspec.enable_mla_absorb(_model()), hf_kvspec.UnsupportedMLAError,
     "supports the attention classes"),
    ("kv_cache_bytes(config, 16, scale_layout='token')",
     lambda: hf_kvspec.kv_cache_bytes(_model().config, 16, scale_layout="token"), ValueError, "bits=8"),
    ("kv_cache_bytes(config, -1)", lambda: hf_kvspec.kv_cache_bytes(_model().config, -1), ValueError,
     "seq_len=-1"),
    ("make_assistant('medusa', model)", lambda: hf_kvspec.make_assistant("medusa", _model()), ValueError,
     "Unknown assistant"),
    ("make_assistant('draft:truncated:99', model)", lambda: hf_kvspec.make_assistant("draft:truncated:99", _model()),
     ValueError, "1..2"),
    ("load_bundled_model('nope')", lambda: hf_kvspec.load_bundled_model("nope"), ValueError, "known:"),
    ("PagedCache(config, block_size=0)", lambda: hf_kvspec.PagedCache(_model().config, block_size=0), ValueError,
     "block_size"),
    ("PagedCache(config, num_blocks=2.5)", lambda: hf_kvspec.PagedCache(_model().config, num_blocks=2.5),
     ValueError, "positive integer"),
    ("PagedCache(config, memory_budget='lots')", lambda: hf_kvspec.PagedCache(_model().config, memory_budget="lots"),
     ValueError, "80GiB"),
    ("QuantizedKVCache(config, method='KIVI')", lambda: hf_kvspec.QuantizedKVCache(_model().config, method="KIVI"),
     ValueError, "'kivi'"),
    ("QuantizedKVCache(config, sink_tokens=-1)", lambda: hf_kvspec.QuantizedKVCache(_model().config, sink_tokens=-1),
     ValueError, "sink_tokens=-1"),
    ("generate(custom_generate=speculative_generate)", lambda: _generate(), ValueError, "needs an assistant"),
    ("generate(..., assistant='ngram')", lambda: _generate(assistant="ngram"), TypeError, "Drafter"),
    ("generate(..., assistant=NgramAssistant(), num_beams=2)",
     lambda: _generate(assistant=hf_kvspec.NgramAssistant(), num_beams=2), ValueError, "num_beams=1"),
]


@pytest.mark.parametrize(("call", "error", "fragment"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_with_the_fix_named(call, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        call()
