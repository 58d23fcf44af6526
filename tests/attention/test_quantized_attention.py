"""Fused ``kvspec_quant`` attention vs dequantize-then-attend, inside a model, and its registration.

Tolerances: both paths compute in fp32 from the *same* stored codes; the fused one only reorders the
arithmetic (scales folded into queries/weights, zeros summed separately), so they differ by fp32 rounding:
measured ≤ 2e-6 on unit-variance states here. 1e-5 (attention outputs, |out| ≲ 1) and 1e-4 (logits summed
over layers, |logits| ≲ 5) leave 5-10x headroom and still fail on any real error (a wrong scale, zero, group
or token order moves outputs by ≥ 1e-2).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvspec import _compat
from hf_kvspec.attention.quantized import (
    ATTN_NAME,
    enable_quantized_attention,
    fused_quantized_attention,
    reference_quantized_attention,
    register_quantized_attention,
    unregister_quantized_attention,
)
from hf_kvspec.cache.quantized import QuantizedKVCache
from hf_kvspec.stored_kv import MAX_FUSED_QUERIES, QuantizedKV
from tests.tiny_models import left_padded_batch, tiny_config, tiny_model

HEADS, Q_HEADS, DIM = 2, 6, 64
CONFIG = tiny_config("llama", hidden_size=384, num_attention_heads=Q_HEADS, num_key_value_heads=HEADS)
SETTINGS = {
    "kivi4-sinks": dict(bits=4, group_size=16, residual_length=32, sink_tokens=3),
    "kivi2": dict(bits=2, group_size=32, residual_length=0),  # two value groups per head (D = 64)
    "int8": dict(method="int8", residual_length=4),
    "fp8": dict(method="fp8"),
}


def _filled_layer(name, tokens=150, batch=2):
    cache = QuantizedKVCache(CONFIG, **SETTINGS[name])
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(batch, HEADS, tokens, DIM, generator=gen) for _ in range(2))
    keys[..., 5] *= 8  # an outlier channel, as in real keys (KIVI's reason for per-channel key groups)
    dense_k, dense_v = cache.update(keys, values, 0)  # reference read: [sinks | dequantized store | window]
    layer = cache.layers[0]
    return layer, dense_k, dense_v


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_equals_dequantize_then_attend(name, q_len, padded):
    layer, dense_k, dense_v = _filled_layer(name)
    assert layer.store.length > 0
    total = dense_k.shape[2]
    query = torch.randn(2, Q_HEADS, q_len, DIM, generator=torch.Generator().manual_seed(1))
    mask = None
    if padded:  # row 0 left-padded by 7 tokens, causal over the last q_len positions
        mask = torch.ones(q_len, total, dtype=torch.bool).tril(total - q_len).expand(2, 1, q_len, total).clone()
        mask[0, :, :, :7] = False
    view = QuantizedKV(layer.store, layer.sink_keys, layer.sink_values, layer.workspace)
    fused = fused_quantized_attention(query, view, layer.keys, layer.values, mask, DIM ** -0.5)
    reference = reference_quantized_attention(query, dense_k, dense_v, mask, DIM ** -0.5)
    assert fused.shape == (2, q_len, Q_HEADS, DIM)
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-5)


def test_reference_attention_is_not_trivially_equal():
    """Negative control: exact (unquantized) keys give a visibly different output, so 1e-5 is a real check."""
    layer, _, _ = _filled_layer("kivi2")
    query = torch.randn(2, Q_HEADS, 1, DIM, generator=torch.Generator().manual_seed(1))
    view = QuantizedKV(layer.store, layer.sink_keys, layer.sink_values, layer.workspace)
    fused = fused_quantized_attention(query, view, layer.keys, layer.values, None, DIM ** -0.5)
    gen = torch.Generator().manual_seed(0)
    exact_k, exact_v = (torch.randn(2, HEADS, 150, DIM, generator=gen) for _ in range(2))
    exact_k[..., 5] *= 8
    exact = reference_quantized_attention(query, exact_k, exact_v, None, DIM ** -0.5)
    assert (fused - exact).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------- in a model
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # D = 64, GQA


def _teacher_forced_logits(model, ids, mask, settings, fused: bool):
    """Prefill 20 tokens, then 6 single steps and one 5-token (verify-sized) chunk; [B, 11, V] logits."""
    patch = enable_quantized_attention(model) if fused else None
    cache = QuantizedKVCache(model.config, **settings)
    calls = {"key_scores": 0}
    try:
        with torch.no_grad():
            model(ids[:, :20], attention_mask=mask[:, :20], cache=cache)
            store = cache.layers[0].store
            original = store.key_scores

            def counting(*args):
                calls["key_scores"] += 1
                return original(*args)

            store.key_scores = counting
            logits = [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits
                      for t in range(20, 26)]
            logits.append(model(ids[:, 26:31], attention_mask=mask[:, :31], cache=cache).logits)
    finally:
        if patch is not None:
            patch.remove()
    return torch.cat(logits, dim=1), calls["key_scores"]


@pytest.mark.parametrize("settings", [dict(bits=4, group_size=16, residual_length=0),
                                      dict(bits=2, group_size=16, residual_length=16, sink_tokens=2),
                                      dict(method="int8")], ids=["kivi4", "kivi2-sinks", "int8"])
def test_model_logits_fused_vs_reference(model, settings):
    """A left-padded batch (masks reach the fused path) across flushes; the fused path must really run."""
    rows = [list(range(5, 36)), list(range(40, 64))]  # 31 and 24 tokens
    ids, mask = left_padded_batch(rows)
    reference, reference_calls = _teacher_forced_logits(model, ids, mask, settings, fused=False)
    fused, fused_calls = _teacher_forced_logits(model, ids, mask, settings, fused=True)
    assert reference_calls == 0 and fused_calls == 7  # canary: 6 steps + 1 chunk read the codes of layer 0
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-4)


def test_long_prefill_reads_dense_and_other_caches_get_sdpa(model):
    ids = torch.randint(3, 90, (1, MAX_FUSED_QUERIES + 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids, cache=DynamicCache(config=model.config)).logits
        sdpa_quant = model(ids, cache=QuantizedKVCache(model.config, method="int8")).logits
        with enable_quantized_attention(model):
            # a prefill longer than MAX_FUSED_QUERIES goes to SDPA over dense keys/values: same as without the patch
            assert torch.equal(model(ids, cache=QuantizedKVCache(model.config, method="int8")).logits, sdpa_quant)
            # any other cache: kvspec_quant is SDPA
            assert torch.equal(model(ids, cache=DynamicCache(config=model.config)).logits, expected)


def test_layers_share_one_workspace():
    cache = QuantizedKVCache(CONFIG, bits=4, group_size=16, residual_length=16)
    assert all(layer.workspace is cache.layers[0].workspace for layer in cache.layers)


def test_register_is_idempotent_and_reversible(model):
    unregister_quantized_attention()  # earlier tests may have registered it
    before = _compat.attention_entries(ATTN_NAME)
    assert before == (None, None)
    register_quantized_attention()
    register_quantized_attention()
    assert _compat.attention_entries(ATTN_NAME)[0] is not None
    unregister_quantized_attention()
    unregister_quantized_attention()
    assert _compat.attention_entries(ATTN_NAME) == before
    previous = _compat.attn_implementation(model.config)
    with enable_quantized_attention(model):
        assert _compat.attn_implementation(model.config) == ATTN_NAME
    assert _compat.attn_implementation(model.config) == previous
    unregister_quantized_attention()
