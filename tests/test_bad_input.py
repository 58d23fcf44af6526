"""Bad input is refused early, with the fix named: draft vocabularies, attention patches, and a table of the
public entry points' refusals (issue 18).

Each case states the input a user might pass and a fragment of the message that must name what was wrong.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError

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


def _linear_attention_config():
    """A copy of the tiny config whose odd layers are linear attention (a hybrid model's layer kind)."""
    import copy

    config = copy.deepcopy(_model().config)
    config.layer_types = ["full_attention", "linear_attention"] * (config.num_hidden_layers // 2)
    return config


def _ragged(config):
    from hf_kvspec.cache.ragged import RaggedPagedCache

    return RaggedPagedCache(config, num_blocks=8)


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
    ("PagedCache(config with linear attention)", lambda: hf_kvspec.PagedCache(_linear_attention_config(), 8),
     ValueError, "this config has ['linear_attention']"),
    ("RaggedPagedCache(config with linear attention)", lambda: _ragged(_linear_attention_config()), ValueError,
     "RaggedPagedCache supports ('full_attention', 'sliding_attention')"),
    ("QuantizedKVCache(config, method='KIVI')", lambda: hf_kvspec.QuantizedKVCache(_model().config, method="KIVI"),
     ValueError, "'kivi'"),
    ("QuantizedKVCache(config, sink_tokens=-1)", lambda: hf_kvspec.QuantizedKVCache(_model().config, sink_tokens=-1),
     ValueError, "sink_tokens=-1"),
    ("generate(custom_generate=speculative_generate, fast_forward='yes')", lambda: _generate(fast_forward="yes"),
     TypeError, "True, False or None"),
    ("QuantizedSelfAssistant(gemma2 model)", lambda: hf_kvspec.QuantizedSelfAssistant(tiny_model("gemma2")), ValueError,
     "model_type 'gemma2'"),
    ("generate(..., assistant='ngram')", lambda: _generate(assistant="ngram"), TypeError, "Assistant"),
    ("generate(..., assistant=NgramAssistant(), num_beams=2)",
     lambda: _generate(assistant=hf_kvspec.NgramAssistant(), num_beams=2), ValueError, "num_beams=1"),
]


@pytest.mark.parametrize(("call", "error", "fragment"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_with_the_fix_named(call, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        call()


# --- the audit, continued: drafters, heads, metrics, kernels and switches ---------------------------------------


# a config's validators run inside huggingface_hub's strict dataclass, which wraps their ValueError in its own
_CONFIG_ERROR = StrictDataclassClassValidationError


def _medusa_config(**kwargs):
    return hf_kvspec.MedusaConfig.for_base_model(_model(), **kwargs)


def _medusa():
    return hf_kvspec.MedusaHeads(_medusa_config(num_heads=2))


def _auto_length(**kwargs):
    from hf_kvspec.speculative.autok import AutoDraftLength

    return AutoDraftLength(**kwargs)


def _metric(name, *args, **kwargs):
    return hf_kvspec.load_metric(name, *args, keep_in_memory=True, **kwargs)


def _token_statistics(labels):
    from hf_kvspec.metrics import token_statistics

    logits = torch.zeros(1, 3, 10)
    return token_statistics(logits, logits, labels)


def _card(config, **fields):
    from hf_kvspec import hub

    return hub.render_model_card(config, hub.CardFields(**fields))


def _evaluate_head(depth):
    from hf_kvspec.heads.distill import Conversation
    from hf_kvspec.heads.evaluation import evaluate_head

    return evaluate_head(_medusa().attach(_model()), _model(), [Conversation([5, 6], [7, 8, 9])], depth=depth)


def _self_distill(prompts):
    from hf_kvspec.heads.distill import self_distill

    return self_distill(_model(), None, prompts, Path(tempfile.gettempdir(), "never_written.jsonl"), "fingerprint")


def _distill_settings(**kwargs):
    from hf_kvspec.heads.distill import DistillSettings

    return DistillSettings(**kwargs)


def _objective(**kwargs):
    from hf_kvspec.heads.objectives import TrainingObjective, TrainingVocabulary

    return TrainingObjective(_medusa(), TrainingVocabulary(_model().config.vocab_size), **kwargs)


BAD_INPUTS_AUDIT = [
    # drafters and the draft length
    ("NgramAssistant(num_draft_tokens=True)", lambda: hf_kvspec.NgramAssistant(num_draft_tokens=True), ValueError,
     "got True"),
    ("NgramAssistant(num_draft_tokens='auto', max_draft_tokens=0)",
     lambda: hf_kvspec.NgramAssistant(num_draft_tokens="auto", max_draft_tokens=0), ValueError,
     "max_draft_tokens must be a positive int, got 0"),
    ("NgramAssistant(num_draft_tokens='auto', max_draft_tokens=2.5)",
     lambda: hf_kvspec.NgramAssistant(num_draft_tokens="auto", max_draft_tokens=2.5), ValueError,
     "max_draft_tokens must be a positive int, got 2.5"),
    ("NgramAssistant(num_draft_tokens=4, max_draft_tokens=True)",
     lambda: hf_kvspec.NgramAssistant(num_draft_tokens=4, max_draft_tokens=True), ValueError,
     "max_draft_tokens must be a positive int, got True"),
    ("AutoDraftLength(max_draft_tokens=0)", lambda: _auto_length(max_draft_tokens=0), ValueError,
     "max_draft_tokens must be a positive int"),
    ("AutoDraftLength(decay=1.5)", lambda: _auto_length(decay=1.5), ValueError, "0 < decay <= 1"),
    ("AutoDraftLength(probe_every=0)", lambda: _auto_length(probe_every=0), ValueError, "probe_every"),
    ("AutoDraftLength(initial=-1)", lambda: _auto_length(initial=-1), ValueError, "initial"),
    ("AutoDraftLength(prior_slope_ratio=-1)", lambda: _auto_length(prior_slope_ratio=-1), ValueError,
     "prior_slope_ratio"),
    ("make_assistant(None, model)", lambda: hf_kvspec.make_assistant(None, _model()), TypeError,
     "spec must be a string: ngram | draft:<dir> | draft:truncated:<N>"),
    ("make_assistant('draft:truncated:0', model)", lambda: hf_kvspec.make_assistant("draft:truncated:0", _model()),
     ValueError, "at least 1 layer"),
    ("make_assistant('draft:', model)", lambda: hf_kvspec.make_assistant("draft:", _model()), ValueError,
     "draft:<dir>"),
    ("make_assistant('draft:truncated:1', None)", lambda: hf_kvspec.make_assistant("draft:truncated:1", None),
     TypeError, "target model"),
    # heads: configs, pairing, cards
    ("EagleConfig(hidden_size=0)", lambda: hf_kvspec.EagleConfig(hidden_size=0), _CONFIG_ERROR, "base_hidden_size"),
    ("MedusaConfig(vocab_size=10)", lambda: hf_kvspec.MedusaConfig(vocab_size=10), _CONFIG_ERROR, "base_vocab_size"),
    ("EagleConfig(base_hidden_size=0)", lambda: hf_kvspec.EagleConfig(base_hidden_size=0), _CONFIG_ERROR,
     "base_hidden_size=0"),
    ("MedusaConfig(base_vocab_size=-1)", lambda: hf_kvspec.MedusaConfig(base_vocab_size=-1), _CONFIG_ERROR,
     "base_vocab_size=-1"),
    ("MedusaConfig(num_heads=2.5)", lambda: hf_kvspec.MedusaConfig(num_heads=2.5), _CONFIG_ERROR, "num_heads"),
    ("MedusaConfig(num_layers=True)", lambda: hf_kvspec.MedusaConfig(num_layers=True), _CONFIG_ERROR, "num_layers"),
    ("EagleConfig(feature_layers=-1)", lambda: hf_kvspec.EagleConfig(feature_layers=-1), _CONFIG_ERROR, "[-1]"),
    ("EagleConfig(rms_norm_eps=0.0)", lambda: hf_kvspec.EagleConfig(rms_norm_eps=0.0), _CONFIG_ERROR, "rms_norm_eps"),
    ("EagleHead.for_base_model(model, feature_layers=[40])",
     lambda: hf_kvspec.EagleHead.for_base_model(_model(), feature_layers=[40]), _CONFIG_ERROR, "-3..2"),
    ("EagleHead.for_base_model(None)", lambda: hf_kvspec.EagleHead.for_base_model(None), TypeError,
     "loaded base model"),
    ("EagleConfig.for_base_model(model.config)", lambda: hf_kvspec.EagleConfig.for_base_model(_model().config),
     TypeError, "not its config"),
    ("MedusaConfig.for_base_model(None)", lambda: hf_kvspec.MedusaConfig.for_base_model(None), TypeError,
     "loaded base model"),
    ("MedusaHeads(config).attach(None)", lambda: _medusa().attach(None), TypeError, "loaded base model"),
    ("MedusaHeads(config).attach(model.config)", lambda: _medusa().attach(_model().config), TypeError,
     "not its config"),
    ("render_model_card(LlamaConfig)", lambda: _card(_model().config), TypeError, "MedusaConfig or EagleConfig"),
    ("render_model_card(config, CardFields(held_out={'tau': 2.0}))",
     lambda: _card(_medusa_config(), held_out={"tau": 2.0}), ValueError, "per_head_top1"),
    ("MedusaHeads.push_to_hub(repo, tau=2.0)", lambda: _medusa().push_to_hub("user/heads", tau=2.0), TypeError,
     "held_out="),
    ("evaluate_head(medusa with 2 heads, ..., depth=3)", lambda: _evaluate_head(depth=3), ValueError,
     "depth=3"),
    ("evaluate_head(..., depth=0)", lambda: _evaluate_head(depth=0), ValueError, "depth=0"),
    ("self_distill(model, tokenizer, 'one prompt', ...)", lambda: _self_distill("Explain recursion."), TypeError,
     "list of prompts"),
    ("DistillSettings(batch_size=0)", lambda: _distill_settings(batch_size=0), ValueError, "batch_size=0"),
    ("DistillSettings(max_new_tokens=0)", lambda: _distill_settings(max_new_tokens=0), ValueError,
     "max_new_tokens=0"),
    ("DistillSettings(do_sample=True, temperature=0)", lambda: _distill_settings(do_sample=True, temperature=0.0),
     ValueError, "do_sample=False"),
    ("TrainingObjective(head, vocab, label_source='text')", lambda: _objective(label_source="text"), ValueError,
     "'target' or 'data'"),
    ("TrainingObjective(medusa, vocab, unroll_steps=3)", lambda: _objective(unroll_steps=3), ValueError,
     "EAGLE"),
    # metrics
    ("load_metric('cache_fidelity', 'tree')", lambda: _metric("cache_fidelity", "tree"), ValueError,
     "one configuration"),
    ("draft_acceptance (chain).compute(..., tree=[[0], [1]])",
     lambda: _metric("draft_acceptance").compute(predictions=[[[1, 2]]], references=[[1, 2]], tree=[[0], [1]]),
     ValueError, "load_metric('draft_acceptance', 'tree')"),
    ("draft_acceptance ('tree').compute(..., tree=[[-1]])",
     lambda: _metric("draft_acceptance", "tree").compute(predictions=[[[[1], [2]]]], references=[[1, 2]],
                                                          tree=[[-1]]), ValueError, "ranks >= 0"),
    ("draft_acceptance.compute(predictions=[], references=[])",
     lambda: _metric("draft_acceptance").compute(predictions=[], references=[]), ValueError, "no responses"),
    ("token_statistics(logits, reference, labels=[[1, 2, 50]]) with V=10",
     lambda: _token_statistics(torch.tensor([[1, 2, 50]])), ValueError, "0..9"),
    ("token_statistics(..., labels float)", lambda: _token_statistics(torch.tensor([[1.0, 2.0, 3.0]])), TypeError,
     "integer"),
    ("token_statistics(lists)", lambda: hf_kvspec.metrics.token_statistics([[0.1]], [[0.1]], [[0]]), TypeError,
     "tensors"),
    # decode kernels
    ("decode_kernels(None)", lambda: hf_kvspec.decode_kernels(None), TypeError,
     "decode_kernels needs loaded models (torch.nn.Module)"),
    ("decode_kernels()", lambda: hf_kvspec.decode_kernels(), TypeError, "decode_kernels needs loaded models"),
    ("decode_kernels(model.config)", lambda: hf_kvspec.decode_kernels(_model().config), TypeError,
     "LlamaConfig"),
    ("DecodeKernels(model, min_weight_elements=-1)",
     lambda: hf_kvspec.DecodeKernels(_model(), min_weight_elements=-1), ValueError, "min_weight_elements must be >= 0"),
    ("DecodeKernels(model, memory_fraction=2)", lambda: hf_kvspec.DecodeKernels(_model(), memory_fraction=2),
     ValueError, "memory_fraction"),
    ("DecodeKernels(model, max_rows=2.5)", lambda: hf_kvspec.DecodeKernels(_model(), max_rows=2.5), ValueError,
     "max_rows"),
    ("release_decode_kernels(None)", lambda: hf_kvspec.release_decode_kernels(None), TypeError,
     "loaded models"),
    # enable / disable and the MLA patch
    ("enable(None)", lambda: hf_kvspec.enable(None), TypeError, "enable() needs a loaded transformers model"),
    ("disable(None)", lambda: hf_kvspec.disable(None), TypeError, "disable() needs a loaded transformers model"),
    ("enable(model.config)", lambda: hf_kvspec.enable(_model().config), TypeError, "not its config"),
    ("enable_mla_absorb(None)", lambda: hf_kvspec.enable_mla_absorb(None), TypeError, "loaded transformers model"),
    ("enable_mla_absorb(model.config)", lambda: hf_kvspec.enable_mla_absorb(_model().config), TypeError,
     "not its config"),
]


@pytest.mark.parametrize(("call", "error", "fragment"), [case[1:] for case in BAD_INPUTS_AUDIT],
                         ids=[case[0] for case in BAD_INPUTS_AUDIT])
def test_audit_bad_input_is_refused_with_the_fix_named(call, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        call()


def test_enabled_generate_refuses_a_second_custom_generate():
    """``enable(model)`` routes ``assistant=`` through speculative_generate; another ``custom_generate`` would reach
    generate twice (TypeError deep in the wrapper), so it is refused by name, and the model stays enabled."""
    model = hf_kvspec.enable(tiny_model("llama"))
    try:
        with pytest.raises(ValueError, match="drop custom_generate="):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, pad_token_id=0,
                           assistant=hf_kvspec.NgramAssistant(), custom_generate=hf_kvspec.speculative_generate)
    finally:
        hf_kvspec.disable(model)


def test_assistant_grammar_is_one_function_for_the_cli_and_make_assistant(tmp_path, monkeypatch):
    """``check_spec`` parses without loading anything; the CLI's early check and ``make_assistant`` agree, including a
    ``~`` path (the CLI expanded it, make_assistant did not)."""
    from hf_kvspec import cli
    from hf_kvspec.speculative.assistants import check_spec

    monkeypatch.setenv("HOME", str(tmp_path))
    tiny_model("llama", seed=5).save_pretrained(tmp_path / "draft")
    assert check_spec("ngram") == ("ngram", None)
    assert check_spec("draft:truncated:2") == ("truncated", 2)
    assert check_spec("draft:~/draft") == ("draft", tmp_path / "draft")
    assert isinstance(hf_kvspec.make_assistant("draft:~/draft", _model()), hf_kvspec.DraftModelAssistant)
    for spec in ("medusa", "draft:truncated:0", "draft:truncated:x", "draft:", f"draft:{tmp_path / 'missing'}"):
        with pytest.raises(ValueError) as refused:
            check_spec(spec)
        assert cli._assistant_problem(spec) == str(refused.value)
    assert cli._assistant_problem("draft:~/draft") is None


def test_eagle_feature_layers_in_range_are_accepted():
    """The range check's boundary: -(L+1) and L index the hidden_states tuple of an L-layer base model."""
    layers = _model().config.num_hidden_layers
    drafter = hf_kvspec.EagleHead.for_base_model(_model(), feature_layers=[-(layers + 1), layers])
    assert drafter.config.feature_layers == [-(layers + 1), layers]
