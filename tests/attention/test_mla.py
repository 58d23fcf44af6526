"""MLA absorb vs the model's own (decompressing) attention, per layer in fp64 and end to end in fp32.

Shape legend: B batch, T new tokens, S cached tokens, C latent rank d_c, R RoPE dim d_r.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvspec import kv_cache_bytes
from hf_kvspec.attention import mla
from hf_kvspec.attention.mla import UnsupportedMLAError, enable_mla_absorb
from hf_kvspec.attention.mla_weights import MLADims
from tests.tiny_models import left_padded_batch, tiny_model

KINDS = ["deepseek_v3", "deepseek_v2", "deepseek_v3_yarn", "deepseek_v2_yarn"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [21, 22, 23, 24]]  # bs 2, left padded
FP32_TOL = 1e-4  # issue target; measured ~1e-6 (different summation order: latent-space vs per-head dot products)
FP64_TOL = 1e-10


def _padded_keep(pads: list[int], start: int, stop: int) -> torch.Tensor:
    """Bool [B, 1, T, S] for queries at positions start..stop-1: causal, row r's first pads[r] keys hidden."""
    q_pos = torch.arange(start, stop)[:, None]
    k_pos = torch.arange(stop)[None, :]
    keep = torch.stack([(k_pos <= q_pos) & (k_pos >= pad) for pad in pads])[:, None]
    return keep | (k_pos == q_pos)  # pad queries see themselves: no empty softmax rows


def _run_layer(attn, rotary, hidden, positions, keep, cache):
    position_embeddings = rotary(hidden, positions)
    out, _ = attn(hidden_states=hidden, position_embeddings=position_embeddings, attention_mask=keep, cache=cache)
    return out


@pytest.mark.parametrize("kind", [*KINDS, "deepseek_v3_no_interleave"])
@pytest.mark.parametrize("strategy", ["absorb", "decompress", "auto"])
def test_single_layer_fp64_prefill_and_decode(kind, strategy):
    overrides = {"rope_interleave": False} if kind.endswith("no_interleave") else {}
    model = tiny_model(kind.removesuffix("_no_interleave"), **overrides).double()
    attn, rotary = model.model.layers[0].self_attn, model.model.rotary_emb
    torch.manual_seed(1)
    pads, prefill, steps = [0, 4], 9, 3
    hidden = torch.randn(2, prefill + steps, model.config.hidden_size, dtype=torch.float64)
    caches, outputs = [DynamicCache(config=model.config) for _ in range(2)], [[], []]
    for index, patched in enumerate((False, True)):
        patch = enable_mla_absorb(model, strategy) if patched else None
        for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, prefill + steps)]:
            positions = torch.arange(start, stop)[None].expand(2, -1)
            keep = _padded_keep(pads, start, stop)
            outputs[index].append(_run_layer(attn, rotary, hidden[:, start:stop], positions, keep, caches[index]))
        if patch:
            patch.remove()
    for original, absorbed in zip(*outputs):
        torch.testing.assert_close(absorbed, original, atol=FP64_TOL, rtol=0)
    torch.testing.assert_close(caches[1].layers[0].keys, caches[0].layers[0].keys, atol=FP64_TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_end_to_end_logits_and_greedy_64_tokens(kind):
    model = tiny_model(kind)
    ids, attention_mask = left_padded_batch(PROMPTS)
    settings = dict(attention_mask=attention_mask, max_new_tokens=64, do_sample=False, pad_token_id=0)
    expected_logits = model(ids, attention_mask=attention_mask).logits
    expected = model.generate(ids, **settings)
    with enable_mla_absorb(model, strategy="absorb"):  # absorbed prefill too, not only decode
        logits = model(ids, attention_mask=attention_mask).logits
        generated = model.generate(ids, **settings)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected_logits[real], atol=FP32_TOL, rtol=0)
    assert torch.equal(generated, expected)


def test_eager_float_masks_and_auto_strategy():
    model = tiny_model("deepseek_v3", attn_implementation="eager")
    ids, attention_mask = left_padded_batch(PROMPTS)
    settings = dict(attention_mask=attention_mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True)
    expected = model.generate(ids, **settings)
    with enable_mla_absorb(model):
        generated = model.generate(ids, **settings)
    assert torch.equal(generated.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(generated.scores), torch.stack(expected.scores), atol=FP32_TOL, rtol=0)


def test_yarn_mscale_is_in_the_softmax_scale():
    """The YaRN config must change the scale (else the yarn cases above prove nothing about mscale)."""
    attn = tiny_model("deepseek_v3_yarn").model.layers[0].self_attn
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0  # DeepSeek's yarn_get_mscale(40, 1.0)
    assert attn.scaling == pytest.approx(attn.qk_head_dim ** -0.5 * mscale**2, rel=1e-12)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_tree_mask_on_a_cache(kind):
    """Verification shape: cached prompt, 4 new tokens under a custom 4D mask hiding sibling branches."""
    logits = []
    for patched in (False, True):
        model = tiny_model(kind)
        patch = enable_mla_absorb(model, strategy="absorb") if patched else None
        cache = model(torch.arange(3, 15)[None], use_cache=True).cache
        keep = torch.ones(1, 1, 4, 16, dtype=torch.bool)
        keep[0, 0, :, 12:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        positions = torch.tensor([[12, 13, 13, 14]])
        logits.append(model(torch.tensor([[40, 41, 42, 43]]), attention_mask=keep, position_ids=positions,
                            cache=cache).logits)
        if patch:
            patch.remove()
    torch.testing.assert_close(logits[1], logits[0], atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_cache_holds_latent_only(kind):
    """Seed check (c): d_c + d_r elements per token per layer, bytes == kv_cache_bytes(config)."""
    model = tiny_model(kind)
    config = model.config
    ids, attention_mask = left_padded_batch(PROMPTS)
    with enable_mla_absorb(model):
        cache = model(ids, attention_mask=attention_mask, use_cache=True).cache
        cache = model(torch.tensor([[30], [31]]), attention_mask=torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1),
                      cache=cache).cache
    batch, tokens = 2, ids.shape[1] + 1
    for layer in cache.layers:
        assert layer.keys.shape == (batch, 1, tokens, config.kv_lora_rank)
        assert layer.values.shape == (batch, 1, tokens, config.qk_rope_head_dim)
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert stored == kv_cache_bytes(config, tokens, batch, dtype=torch.float32)
    assert stored == batch * tokens * config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4


def test_remove_restores_exactly_including_a_previous_instance_forward():
    model = tiny_model("deepseek_v3")
    ids = torch.arange(3, 20)[None]
    before = model(ids).logits
    first = model.model.layers[0].self_attn
    wrapper = first.forward  # stands for an instance-level wrapper such as an accelerate hook
    first.forward = wrapper
    patch = enable_mla_absorb(model, strategy="absorb")
    assert patch.active and all("forward" in layer.self_attn.__dict__ for layer in model.model.layers)
    with pytest.raises(ValueError, match="already enabled"):
        enable_mla_absorb(model)
    patch.remove()
    patch.remove()  # idempotent
    assert first.__dict__["forward"] is wrapper
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers[1:])
    assert torch.equal(model(ids).logits, before)


def test_weights_follow_a_dtype_change():
    """``model.double()`` after enabling swaps the parameter storage: the split views must be rebuilt."""
    model = tiny_model("deepseek_v2")
    attn, rotary = model.model.layers[0].self_attn, model.model.rotary_emb
    hidden = torch.randn(2, 7, model.config.hidden_size, dtype=torch.float64)
    positions, keep = torch.arange(7)[None].expand(2, -1), _padded_keep([0, 3], 0, 7)
    with enable_mla_absorb(model, strategy="absorb"):
        model.double()
        absorbed = _run_layer(attn, rotary, hidden, positions, keep, None)
    expected = _run_layer(attn, rotary, hidden, positions, keep, None)
    torch.testing.assert_close(absorbed, expected, atol=FP64_TOL, rtol=0)


def test_decode_uses_the_absorbed_path(monkeypatch):
    calls = {"absorbed": 0, "decompressed": 0}
    for name in calls:
        real = getattr(mla, f"_{name}_attention")
        monkeypatch.setattr(mla, f"_{name}_attention",
                            lambda *a, _real=real, _name=name: (calls.__setitem__(_name, calls[_name] + 1), _real(*a))[1])
    model = tiny_model("deepseek_v3")
    with enable_mla_absorb(model):
        model.generate(torch.arange(3, 60)[None], max_new_tokens=4, do_sample=False)
    layers = model.config.num_hidden_layers
    assert calls == {"decompressed": layers, "absorbed": 3 * layers}  # long prefill decompresses, decode absorbs


def test_cost_model_with_deepseek_v3_sizes():
    dims = MLADims(heads=128, latent=512, rope=64, nope=128, value=128)
    assert dims.absorb_is_cheaper(1, 8192) and dims.absorb_is_cheaper(8, 8192)
    # long cache: absorbing pays up to ~170 new tokens; an empty cache (T == S) always decompresses
    assert dims.absorb_is_cheaper(160, 8192) and not dims.absorb_is_cheaper(180, 8192)
    assert not dims.absorb_is_cheaper(16, 16) and not dims.absorb_is_cheaper(4096, 4096)


def test_unsupported_models_and_arguments_are_refused():
    with pytest.raises(UnsupportedMLAError, match="DeepseekV3Attention"):
        enable_mla_absorb(tiny_model("llama"))
    with pytest.raises(ValueError, match="strategy"):
        enable_mla_absorb(tiny_model("deepseek_v3"), strategy="fast")
    model = tiny_model("deepseek_v2")
    model.config.qk_nope_head_dim = 0  # a NoPE-less variant cannot absorb W_UK
    with pytest.raises(UnsupportedMLAError, match="qk_nope_head_dim"):
        enable_mla_absorb(model)
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)  # nothing half-patched


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "youtu"])
def test_derivative_architectures(model_type):
    """transformers models whose attention is a verbatim copy of DeepSeek-V3's (checked by source diff)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, attention_mask = left_padded_batch(PROMPTS)
    settings = dict(attention_mask=attention_mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **settings)
    with enable_mla_absorb(model, strategy="absorb"):
        assert torch.equal(model.generate(ids, **settings), expected)


def test_paged_cache_stores_the_latent_and_greedy_matches():
    """Any Cache works: PagedCache pages hold [blocks, P, 1, C] latents and [blocks, P, 1, R] RoPE keys."""
    from hf_kvspec.cache.paged import PagedCache

    model = tiny_model("deepseek_v3")
    config = model.config
    ids, attention_mask = left_padded_batch(PROMPTS)
    settings = dict(attention_mask=attention_mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **settings)
    cache = PagedCache(config, block_size=4, num_blocks=32)
    with enable_mla_absorb(model):
        generated = model.generate(ids, cache=cache, **settings)
    assert torch.equal(generated, expected)
    pages = cache.layers[0]
    assert pages.keys.shape[2:] == (1, config.kv_lora_rank) and pages.values.shape[2:] == (1, config.qk_rope_head_dim)
    assert cache.nbytes() == 32 * 4 * config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4


def test_positional_and_training_calls_fall_back_to_the_original():
    model = tiny_model("deepseek_v3")
    attn, rotary = model.model.layers[0].self_attn, model.model.rotary_emb
    hidden = torch.randn(1, 5, model.config.hidden_size)
    embeddings = rotary(hidden, torch.arange(5)[None])
    expected, _ = attn(hidden, embeddings, None)  # V3 order: hidden, position_embeddings, attention_mask
    with enable_mla_absorb(model, strategy="absorb"):
        assert torch.equal(attn(hidden, embeddings, None)[0], expected)
        model.train()
        assert torch.equal(attn(hidden_states=hidden, position_embeddings=embeddings, attention_mask=None)[0],
                           expected)

