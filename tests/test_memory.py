"""KV byte arithmetic: formulas vs real caches (to the byte) and vs the seed's published numbers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvspec.memory import (
    format_bytes,
    kv_cache_bytes,
    max_batch_size,
    parse_bytes,
    quantized_token_split,
)
from hf_kvspec.presets import PRESETS, load_config
from tests.tiny_models import tiny_config, tiny_model

GiB = 2**30


def _stored_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2", "deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("prompt_len", [5, 20])
def test_formula_equals_dynamic_cache_bytes(kind, prompt_len):
    model = tiny_model(kind)
    ids = torch.randint(3, 90, (2, prompt_len))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, cache=cache)
        # three decode steps: sliding layers must stay capped, full layers must grow by one each
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache)
    seq_len = prompt_len + 3
    assert _stored_bytes(cache) == kv_cache_bytes(model.config, seq_len, batch_size=2, dtype=torch.float32)


def test_sliding_window_caps_tokens():
    config = tiny_config("mistral")  # window 8 -> 7 stored tokens per layer
    capped = kv_cache_bytes(config, 1000, dtype=torch.float32)
    assert capped == kv_cache_bytes(config, 7, dtype=torch.float32)
    assert kv_cache_bytes(config, 5, dtype=torch.float32) < capped


def test_seed_numbers_llama3_70b():
    config = load_config("llama-3-70b")
    assert kv_cache_bytes(config, 4096, dtype=torch.float16) == 1.25 * GiB
    mha = load_config("llama-3-70b")
    mha.num_key_value_heads = 64
    assert kv_cache_bytes(mha, 4096, dtype=torch.float16) == 10 * GiB


def test_seed_numbers_deepseek_v2_mla():
    config = load_config("deepseek-v2")  # 60 layers, d_c 512, d_r 64: L·(d_c + d_r)·2 B per token
    assert kv_cache_bytes(config, 4096, dtype=torch.float16) == 283_115_520 == 60 * 576 * 2 * 4096


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load(name):
    config = load_config(name)
    assert kv_cache_bytes(config, 1, dtype=torch.float16) > 0


def test_seed_check_a_decode_with_cache_equals_recomputation():
    """Prefill (1, 16, d) with head dim 128, decode 8 tokens through the cache, compare to no-cache recompute."""
    model = tiny_model("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    ids = torch.randint(3, 90, (1, 16))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(ids, cache=cache).logits[:, -1]]
        for _ in range(8):
            ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True)], dim=1)
            logits.append(model(ids[:, -1:], cache=cache).logits[:, -1])
        full = model(ids, use_cache=False).logits[:, 15:]
    assert cache.layers[0].keys.shape == (1, 1, 24, 128)
    # fp32 with a different reduction order (one query vs 24 at once): a few ulps of the logit scale
    torch.testing.assert_close(torch.stack(logits, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,name", [(8, "MHA"), (1, "MQA"), (2, "GQA")])
def test_seed_check_b_attention_variants(kv_heads, name):
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=kv_heads, hidden_size=64)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 90, (3, 11)), cache=cache)
    head_dim = 64 // 8
    assert cache.layers[0].keys.shape == (3, kv_heads, 11, head_dim), name
    expected = 2 * model.config.num_hidden_layers * kv_heads * head_dim * 4 * 11 * 3  # 2·L·H_kv·D·bytes·S·B
    assert _stored_bytes(cache) == expected == kv_cache_bytes(model.config, 11, 3, torch.float32)


def test_group_quantized_bits_per_element():
    config = load_config("llama-2-7b")
    fp16 = kv_cache_bytes(config, 4096, dtype=torch.float16)
    # b + 2·16/G bits per element: 4 + 0.5 = 4.5 bits; 2 + 1 = 3 bits
    assert kv_cache_bytes(config, 4096, dtype=torch.float16, bits=4, group_size=64) * 16 == fp16 * 4.5
    assert kv_cache_bytes(config, 4096, dtype=torch.float16, bits=2, group_size=32) * 16 == fp16 * 3


def test_residual_window_kept_in_full_precision():
    config = load_config("llama-2-7b")
    per_token_fp16 = kv_cache_bytes(config, 1, dtype=torch.float16)
    quantized, residual = quantized_token_split(4096, 64, 128)
    assert (quantized, residual) == (3968, 128)
    got = kv_cache_bytes(config, 4096, dtype=torch.float16, bits=4, group_size=64, residual_length=128)
    assert got == per_token_fp16 * 128 + kv_cache_bytes(config, 3968, dtype=torch.float16, bits=4, group_size=64)


@pytest.mark.parametrize("seq_len,expected", [(0, (0, 0)), (128, (0, 128)), (129, (64, 65)), (192, (64, 128)),
                                              (193, (128, 65))])
def test_quantized_token_split_flushes_whole_groups(seq_len, expected):
    quantized, residual = quantized_token_split(seq_len, 64, 128)
    assert (quantized, residual) == expected
    assert residual <= 128 and quantized % 64 == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 3}, "bits=3"),
    ({"bits": 4, "group_size": 0}, "group_size"),
    ({"bits": 4, "group_size": 64, "residual_length": 100}, "multiple of group_size"),
])
def test_invalid_quant_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kv_cache_bytes(load_config("llama-2-7b"), 16, **kwargs)


def test_max_batch_after_weights():
    config = load_config("llama-2-7b")
    per_seq = kv_cache_bytes(config, 4096, dtype=torch.float16)  # 2 GiB
    assert per_seq == 2 * GiB
    assert max_batch_size(config, 4096, 80 * GiB, torch.float16, weight_bytes=14 * GiB) == 33


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * GiB), ("1.5 KiB", 1536), ("500MB", 500 * 10**6),
                                           ("1024", 1024)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("eighty gigs")


def test_format_bytes():
    assert format_bytes(1.25 * GiB) == "1.25 GiB"
    assert format_bytes(512) == "512 B"


# --- refuse what the caches refuse; accept what users pass (issue 18, item 6) -----------------------------------


@pytest.mark.parametrize("overrides,kwargs,match", [
    ({"head_dim": 16}, {"bits": 4, "group_size": 64}, r"group_size=64 must divide it.*16"),
    ({"num_key_value_heads": 0}, {}, r"num_key_value_heads=0"),
    ({"num_key_value_heads": 3}, {}, r"num_attention_heads=4.*num_key_value_heads=3"),
])
def test_refuses_layouts_no_cache_accepts(overrides, kwargs, match):
    config = tiny_config("llama")
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        kv_cache_bytes(config, 256, **kwargs)


@pytest.mark.parametrize("seq_len,batch", [(4.5, 1), (4, 1.5), ("4", 1)])
def test_refuses_fractional_token_counts(seq_len, batch):
    with pytest.raises(TypeError, match="integer"):
        kv_cache_bytes(tiny_config("llama"), seq_len, batch)


@pytest.mark.parametrize("bad,match", [
    (None, "got None.*config"),
    (42, "got int.*config"),
])
def test_wrong_config_type_names_the_fix(bad, match):
    with pytest.raises(TypeError, match=match):
        kv_cache_bytes(bad, 16)


@pytest.mark.parametrize("dtype,expected", [
    ("fp16", torch.float16), ("float16", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
    ("fp32", torch.float32), ("fp8", torch.float8_e4m3fn), (torch.float16, torch.float16),
])
def test_accepts_dtype_names_and_a_model(dtype, expected):
    model = tiny_model("llama")
    assert kv_cache_bytes(model, 16, 2, dtype) == kv_cache_bytes(model.config, 16, 2, expected)


def test_unknown_dtype_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="'fp16'"):
        kv_cache_bytes(tiny_config("llama"), 16, dtype="half-ish")


def test_accepts_a_preset_name():
    assert kv_cache_bytes("llama-3-70b", 4096, dtype="fp16") == 1_342_177_280


def test_quantized_sliding_layers_follow_quantized_kv_cache():
    """QuantizedKVCache refuses explicit sliding layer types and keeps every token of a Mistral-style config."""
    with pytest.raises(ValueError, match="full-attention layers only"):
        kv_cache_bytes(tiny_config("gemma2"), 64, bits=4, group_size=16)
    mistral, full = tiny_config("mistral"), tiny_config("mistral", sliding_window=None)
    assert kv_cache_bytes(mistral, 64, bits=4, group_size=16) == kv_cache_bytes(full, 64, bits=4, group_size=16)
    assert kv_cache_bytes(mistral, 64) < kv_cache_bytes(full, 64)  # DynamicCache keeps window - 1 tokens
