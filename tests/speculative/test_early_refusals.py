"""What an assistant or a call cannot do is refused before the first target forward, with a message that names the
fix (#29 items 3, 6, 9, 13): construction-time refusals of the drafters' arguments, and call-time refusals that
need the target or the cache but no forward.

Every call-time case counts the target's forwards (a hook on its embedding) and asserts none ran.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_kvspec
from hf_kvspec import _compat
from hf_kvspec.cache.quantized import QuantizedKVCache
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from tests.tiny_models import tiny_model

MAX_NEW = 12


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def eagle(target):
    return EagleHead(EagleConfig.for_base_model(target, "tiny"))


@pytest.fixture(scope="module")
def medusa(target):
    return MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=3))


def _ids(batch=1):
    return torch.randint(1, 90, (batch, 9), generator=torch.Generator().manual_seed(1))


def _generate(model, assistant, ids=None, **kwargs):
    ids = _ids() if ids is None else ids
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          pad_token_id=0, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          **kwargs)


def _refused_before_any_forward(model, assistant, error, fragment, **kwargs):
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda *args: seen.append(1))
    try:
        with pytest.raises(error) as info:
            _generate(model, assistant, **kwargs)
    finally:
        handle.remove()
    assert fragment in str(info.value)
    assert not seen, f"{len(seen)} forwards ran before the refusal"


# ------------------------------------------------------------------------------------------ construction
def _eagle_head_with_trained_vocab(target, size=3):
    return EagleHead(EagleConfig.for_base_model(target, "tiny", draft_vocab_size=size))


CONSTRUCTION = [
    # (id, build(target, eagle, medusa), error, fragment naming the fix)
    ("medusa_rank_past_draft_vocab", lambda t, e, m: hf_kvspec.MedusaAssistant(
        m, draft_vocab_size=2, draft_vocab=torch.arange(96)), ValueError, "larger draft_vocab_size"),
    ("eagle_top_k_past_vocab", lambda t, e, m: hf_kvspec.EagleAssistant(e, top_k=200, draft_vocab_size=None),
     ValueError, "smaller top_k"),
    ("eagle_top_k_past_draft_vocab", lambda t, e, m: hf_kvspec.EagleAssistant(
        e, draft_vocab_size=3, draft_vocab=torch.arange(96)), ValueError, "smaller top_k"),
    ("eagle_default_top_k_past_trained_vocab", lambda t, e, m: hf_kvspec.EagleAssistant(
        _eagle_head_with_trained_vocab(t), draft_vocab_size=None), ValueError, "scores only 3"),
    ("eagle_static_rank_past_draft_vocab", lambda t, e, m: hf_kvspec.EagleAssistant(
        e, tree=[(0,), (5,)], draft_vocab_size=4, draft_vocab=torch.arange(96)), ValueError, "lower ranks"),
    ("negative_draft_vocab_ids", lambda t, e, m: hf_kvspec.EagleAssistant(
        e, draft_vocab_size=5, draft_vocab=torch.tensor([-1, 2, 3, 4, 5])), ValueError, "token ids"),
    ("draft_vocab_as_a_list", lambda t, e, m: hf_kvspec.EagleAssistant(
        e, top_k=2, draft_vocab_size=3, draft_vocab=[1, 2, 3]).vocab.token_ids.tolist() == [1, 2, 3] or None,
     None, None),
    ("draft_vocab_list_of_floats", lambda t, e, m: hf_kvspec.EagleAssistant(
        e, top_k=2, draft_vocab_size=2, draft_vocab=[1.0, 2.0]), ValueError, "token ids (ints)"),
    ("eagle_depth_float", lambda t, e, m: hf_kvspec.EagleAssistant(e, depth=2.5), ValueError, "depth must be an int"),
    ("eagle_top_k_bool", lambda t, e, m: hf_kvspec.EagleAssistant(e, top_k=True), ValueError, "top_k must be an int"),
    ("medusa_none", lambda t, e, m: hf_kvspec.MedusaAssistant(None), TypeError, "load_bundled_heads('medusa')"),
    ("medusa_eagle_head", lambda t, e, m: hf_kvspec.MedusaAssistant(e), TypeError, "EagleAssistant(head)"),
    ("medusa_target_model", lambda t, e, m: hf_kvspec.MedusaAssistant(t), TypeError, "goes to generate()"),
    ("eagle_medusa_heads", lambda t, e, m: hf_kvspec.EagleAssistant(m), TypeError, "MedusaAssistant(heads)"),
    ("tree_flat_list", lambda t, e, m: hf_kvspec.MedusaAssistant(m, tree=[0, 1]), ValueError, "tree=[(0,), (1,)"),
    ("tree_empty", lambda t, e, m: hf_kvspec.MedusaAssistant(m, tree=[]), ValueError, "tree='chain'"),
    ("tree_float_rank", lambda t, e, m: hf_kvspec.MedusaAssistant(m, tree=[(0.5,)]), ValueError, "int top-k ranks"),
    ("eagle_tree_flat_list", lambda t, e, m: hf_kvspec.EagleAssistant(e, tree=[0, 1]), ValueError, "tree=[(0,)"),
    ("layer_skip_bare_int", lambda t, e, m: hf_kvspec.LayerSkipAssistant(2), ValueError, "[2]"),
    ("calibration_tokens_zero", lambda t, e, m: hf_kvspec.LayerSkipAssistant([1], calibration_tokens=0), ValueError,
     "calibration_tokens must be an int >= 1"),
    ("calibration_tokens_negative", lambda t, e, m: hf_kvspec.LayerSkipAssistant([1], calibration_tokens=-3),
     ValueError, "calibration_tokens must be an int >= 1"),
]


@pytest.mark.parametrize("case", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_bad_assistant_arguments_are_refused_at_construction(target, eagle, medusa, case):
    _, build, error, fragment = case
    if error is None:  # accepted, and means what it says
        assert build(target, eagle, medusa) is True
        return
    with pytest.raises(error) as info:
        build(target, eagle, medusa)
    assert fragment in str(info.value)


def test_a_rank_inside_the_scored_vocabulary_still_runs(target, eagle):
    """The boundary of the top-k check: top_k equal to the draft vocabulary's size drafts and stays exact."""
    assistant = hf_kvspec.EagleAssistant(eagle, top_k=3, draft_vocab_size=3, draft_vocab=torch.arange(3, 96))
    plain = target.generate(_ids(), attention_mask=torch.ones_like(_ids()), do_sample=False, max_new_tokens=MAX_NEW,
                            pad_token_id=0)
    assert torch.equal(_generate(target, assistant), plain)


# ------------------------------------------------------------------------------------------ call time
def test_a_static_cache_too_small_for_a_tree_round_is_refused_before_the_prefill(target, eagle):
    # 9 prompt + 12 new: plain decoding fits 24 positions, a tree round of up to 24 nodes does not
    assistant = hf_kvspec.EagleAssistant(eagle, draft_vocab_size=None)
    _refused_before_any_forward(target, assistant, ValueError, "max_cache_len >= 44",
                                cache=StaticCache(config=target.config, max_cache_len=24))


def test_a_static_cache_with_the_room_a_tree_round_needs_runs_exactly(target, eagle):
    assistant = hf_kvspec.EagleAssistant(eagle, draft_vocab_size=None)
    out = _generate(target, assistant, cache=StaticCache(config=target.config, max_cache_len=44))
    plain = target.generate(_ids(), attention_mask=torch.ones_like(_ids()), do_sample=False, max_new_tokens=MAX_NEW,
                            pad_token_id=0)
    assert torch.equal(out, plain)


def test_a_chain_on_a_static_cache_sized_for_plain_decoding_runs(target):
    out = _generate(target, hf_kvspec.NgramAssistant(num_draft_tokens=4),
                    cache=StaticCache(config=target.config, max_cache_len=9 + MAX_NEW - 1))
    plain = target.generate(_ids(), attention_mask=torch.ones_like(_ids()), do_sample=False, max_new_tokens=MAX_NEW,
                            pad_token_id=0)
    assert torch.equal(out, plain)


def test_streaming_sparse_view_over_a_quantized_cache_is_refused_before_the_prefill(target):
    _refused_before_any_forward(target, hf_kvspec.SparseKVAssistant(window=4), ValueError, "Use DynamicCache",
                                cache=QuantizedKVCache(target.config, method="int8"))


def test_an_exit_adapter_of_the_wrong_width_is_refused_before_the_prefill(target):
    adapter = torch.nn.Linear(32, 32)
    assistant = hf_kvspec.EarlyExitAssistant(1, adapter=adapter, draft_vocab_size=None)
    _refused_before_any_forward(target, assistant, ValueError, "hidden size 64")


def test_an_exit_adapter_returning_another_width_is_refused(target):
    assistant = hf_kvspec.EarlyExitAssistant(1, adapter=torch.nn.Linear(64, 32), draft_vocab_size=None)
    _refused_before_any_forward(target, assistant, ValueError, "hidden size 64")


def test_sliding_window_with_a_tree_names_the_chain_tree():
    mistral = tiny_model("mistral")
    head = EagleHead(EagleConfig.for_base_model(mistral, "tiny"))
    _refused_before_any_forward(mistral, hf_kvspec.EagleAssistant(head, draft_vocab_size=None), NotImplementedError,
                                "tree='chain'")


def test_calling_the_loop_without_generate_says_how_to_call_it(target):
    with pytest.raises(TypeError, match=r"custom_generate=hf_kvspec\.speculative_generate"):
        hf_kvspec.speculative_generate(target, _ids(), None, None, None, assistant=hf_kvspec.NgramAssistant())


def test_unregister_while_a_model_runs_a_switched_attention_switches_it_back():
    hf_kvspec.register()
    model = tiny_model("llama")
    ids = torch.tensor([[1, 2, 3]])
    reference = model(ids).logits
    handle = hf_kvspec.enable_gqa(model)
    with pytest.warns(UserWarning, match="switched 1 model"):
        hf_kvspec.unregister()
    assert not handle.active
    assert _compat.attn_implementation(model.config) == "sdpa"
    assert torch.allclose(model(ids).logits, reference, atol=1e-6)  # runs, on the attention it had before
    handle.remove()  # idempotent
    hf_kvspec.register()


def test_a_switch_record_does_not_keep_a_forgotten_model_alive():
    import gc
    import weakref

    hf_kvspec.register()
    model = tiny_model("llama")
    hf_kvspec.enable_gqa(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_cache_holding_the_whole_prompt_needs_no_extra_forward(target):
    """(the cache-held prompt path stays one prefill forward, #29 item 5)"""
    cache = DynamicCache(config=target.config)
    target(_ids(), cache=cache)
    out = _generate(target, hf_kvspec.NgramAssistant(num_draft_tokens=3), cache=cache, return_dict_in_generate=True)
    assert out.acceptance.prefill_forwards == 1
