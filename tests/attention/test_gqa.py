"""kvspec_gqa vs an eager repeat_kv reference, and end to end vs transformers' sdpa.

Shape legend: B batch, Hq/Hkv heads, T query tokens, S key tokens, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec import _compat
from hf_kvspec.attention.gqa import (
    ATTN_NAME,
    FOLD_MAX_QUERY_TOKENS,
    enable_gqa,
    gqa_attention_forward,
    register_gqa,
    unregister_gqa,
)
from hf_kvspec.attention.masks import additive_sdpa_mask
from tests.tiny_models import left_padded_batch, tiny_model

TOL = 1e-5  # fp32, head dim 16-64: summation-order differences between kernels stay ~1e-6


class _Module(torch.nn.Module):
    is_causal = True


def eager_reference(query, key, value, keep, scaling):
    """Textbook attention with K/V repeated per query head; ``keep`` [B, 1|Hq, T, S] bool or None."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * scaling
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)  # [B, T, Hq, Dv]


def make_mask(kind: str, batch: int, q_len: int, kv_len: int, heads: int, seed: int = 0) -> torch.Tensor:
    """Bool masks built by hand (not with transformers' helpers): causal at offset S - T, plus a pattern."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    keep = (k_pos <= q_pos)[None, None].expand(batch, 1, q_len, kv_len).clone()
    if kind == "left_padding":
        for row in range(batch):
            keep[row, :, :, : 3 * row] = False  # row r has 3·r pad tokens on the left
    elif kind == "sliding_window":
        keep &= (q_pos - k_pos < 4)[None, None]
    elif kind == "custom_4d":  # a random tree-like pattern; the diagonal stays visible so no row is empty
        generator = torch.Generator().manual_seed(seed)
        keep &= torch.rand(batch, 1, q_len, kv_len, generator=generator) < 0.6
        keep |= k_pos == q_pos
    elif kind == "per_head":
        generator = torch.Generator().manual_seed(seed)
        keep = keep.expand(batch, heads, q_len, kv_len) & (torch.rand(batch, heads, q_len, kv_len, generator=generator) < 0.7)
        keep |= k_pos == q_pos
    return keep


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (8, 2), (8, 1)])  # G = 1, 3, 4, 8
@pytest.mark.parametrize("q_len", [1, 7, FOLD_MAX_QUERY_TOKENS + 9])  # fold path and enable_gqa path
@pytest.mark.parametrize("mask_kind", ["left_padding", "sliding_window", "custom_4d", "per_head"])
@pytest.mark.parametrize("float_mask", [False, True])
def test_matches_eager_reference(q_heads, kv_heads, q_len, mask_kind, float_mask):
    torch.manual_seed(q_heads * 100 + q_len)
    batch, past, head_dim = 3, 11, 32
    kv_len = past + q_len
    query = torch.randn(batch, q_heads, q_len, head_dim)
    key, value = torch.randn(2, batch, kv_heads, kv_len, head_dim).unbind(0)
    keep = make_mask(mask_kind, batch, q_len, kv_len, q_heads)
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min) if float_mask else keep
    out, weights = gqa_attention_forward(_Module(), query, key, value, mask, scaling=0.125)
    assert weights is None and out.shape == (batch, q_len, q_heads, head_dim)
    torch.testing.assert_close(out, eager_reference(query, key, value, keep, 0.125), atol=TOL, rtol=0)


@pytest.mark.parametrize("q_len", [1, 9, FOLD_MAX_QUERY_TOKENS + 9])
def test_missing_mask_means_causal_like_sdpa(q_len):
    """transformers drops the mask for plain causal calls: T == S is causal, T == 1 sees everything."""
    torch.manual_seed(q_len)
    kv_len = q_len  # the only T > 1 case where transformers passes no mask with a dynamic cache
    query, key, value = torch.randn(3, 2, 8, q_len, 16).unbind(0)
    key, value = key[:, :2], value[:, :2]
    out, _ = gqa_attention_forward(_Module(), query, key, value, None, scaling=0.25)
    keep = make_mask("causal", 2, q_len, kv_len, 8)
    torch.testing.assert_close(out, eager_reference(query, key, value, keep, 0.25), atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,kv_len,padded", [(1, 9, False), (1, 9, True), (4, 9, False), (9, 9, False), (9, 9, True)])
def test_registered_mask_is_eager_mask_with_sdpa_none_shortcut(dtype, q_len, kv_len, padded):
    """Float values exactly as transformers' ``eager_mask``; ``None`` exactly where ``sdpa_mask`` skips."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    padding = torch.ones(2, kv_len, dtype=torch.bool)
    if padded:
        padding[1, :3] = False
    sizes = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len, attention_mask=padding)
    built = additive_sdpa_mask(**sizes, dtype=dtype, allow_is_causal_skip=True)
    if sdpa_mask(**sizes, allow_is_causal_skip=True) is None:
        assert built is None
    else:
        assert built.dtype == dtype and torch.equal(built, eager_mask(**sizes, dtype=dtype))
    assert (built is None) == (not padded and (q_len == 1 or q_len == kv_len))  # the shortcut is really taken


def test_float_mask_of_another_dtype_is_cast_to_the_query_dtype():
    """transformers may build the mask in a dtype other than the attention's (e.g. under autocast)."""
    torch.manual_seed(1)
    query = torch.randn(2, 6, 3, 16, dtype=torch.bfloat16)
    key, value = torch.randn(2, 2, 2, 8, 16, dtype=torch.bfloat16).unbind(0)
    keep = make_mask("left_padding", 2, 3, 8, 6)
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)  # float32 mask
    out, _ = gqa_attention_forward(_Module(), query, key, value, mask, scaling=0.25)
    expected = eager_reference(query.float(), key.float(), value.float(), keep, 0.25)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)  # bf16: 8 mantissa bits, |out| < 3


@pytest.mark.parametrize("q_len,masked,folds", [(1, False, True), (1, True, True), (9, False, False),
                                                (FOLD_MAX_QUERY_TOKENS, True, True),
                                                (FOLD_MAX_QUERY_TOKENS + 1, True, False)])
def test_dispatch_rule_on_cpu(monkeypatch, q_len, masked, folds):
    """Decode and masked short queries fold; unmasked T > 1 and masked long queries call SDPA with enable_gqa."""
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        calls.append((query.shape[1] == key.shape[1], kwargs.get("enable_gqa", False)))
        return real_sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    kv_len = q_len if not masked and q_len > 1 else q_len + 5
    query = torch.randn(1, 6, q_len, 16)
    key, value = torch.randn(2, 1, 2, kv_len, 16).unbind(0)
    mask = make_mask("left_padding", 1, q_len, kv_len, 6) if masked else None
    gqa_attention_forward(_Module(), query, key, value, mask, scaling=0.25)
    assert calls == ([(True, False)] if folds else [(False, True)])  # (same head count: folded, enable_gqa)


def test_head_count_mismatch_is_a_clear_error():
    query, key = torch.randn(1, 6, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        gqa_attention_forward(_Module(), query, key, key, None)


def test_softcap_refused():
    query = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="eager"):
        gqa_attention_forward(_Module(), query, query, query, None, softcap=30.0)


@pytest.fixture
def registered():
    before = _compat.attention_entries(ATTN_NAME)
    register_gqa()
    yield
    unregister_gqa()
    assert _compat.attention_entries(ATTN_NAME) == before


def test_registration_idempotent_and_reversible():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert _compat.attention_entries(ATTN_NAME) == (None, None)
    hf_kvspec.register()
    hf_kvspec.register()
    assert AttentionInterface()[ATTN_NAME] is gqa_attention_forward
    assert AttentionMaskInterface()[ATTN_NAME] is additive_sdpa_mask
    hf_kvspec.unregister()
    assert _compat.attention_entries(ATTN_NAME) == (None, None)
    hf_kvspec.unregister()  # safe when nothing is registered


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])  # G = 2, 4, 2; mistral: sliding window 8
def test_greedy_identical_to_sdpa_with_left_padding(kind):
    model = tiny_model(kind)
    ids, attention_mask = left_padded_batch([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [21, 22, 23]])
    settings = dict(attention_mask=attention_mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **settings)
    sdpa_logits = model(ids, attention_mask=attention_mask).logits
    with enable_gqa(model) as patch:
        assert model.config._attn_implementation == ATTN_NAME
        generated = model.generate(ids, **settings)
        logits = model(ids, attention_mask=attention_mask).logits
    assert not patch.active and model.config._attn_implementation == "sdpa"
    assert torch.equal(generated, expected)
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], sdpa_logits[real], atol=TOL, rtol=0)
    unregister_gqa()


def test_padding_is_honoured_and_needs_the_mask_registration(registered):
    """A left-padded row must give the logits of the same prompt alone. Without the mask entry
    transformers builds no mask for an unknown implementation name, and the pads leak in."""
    model = tiny_model("llama", attn_implementation=ATTN_NAME)
    prompt = [31, 32, 33, 34]
    ids, attention_mask = left_padded_batch([prompt, [7] * 9])
    alone = model(torch.tensor([prompt])).logits[0]
    padded = model(ids, attention_mask=attention_mask).logits[0, -len(prompt):]
    torch.testing.assert_close(padded, alone, atol=TOL, rtol=0)

    function, _ = _compat.attention_entries(ATTN_NAME)
    _compat.restore_attention_entries(ATTN_NAME, function, None)  # drop only the mask registration
    leaked = model(ids, attention_mask=attention_mask).logits[0, -len(prompt):]
    assert (leaked - alone).abs().max() > 1e-2


def test_decode_with_custom_4d_mask_matches_eager(registered):
    """Tree-verification shape: cached prompt, 4 new tokens whose 4D mask hides sibling branches."""
    torch.manual_seed(0)
    outputs = {}
    for impl in ("eager", ATTN_NAME):
        model = tiny_model("qwen2", attn_implementation=impl)
        prompt = torch.randint(3, 90, (1, 12))
        cache = model(prompt, use_cache=True).cache
        tree = torch.tensor([[40, 41, 42, 43]])
        keep = torch.ones(1, 1, 4, 16, dtype=torch.bool)
        keep[0, 0, :, 12:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        positions = torch.tensor([[12, 13, 13, 14]])
        outputs[impl] = model(tree, attention_mask=mask, position_ids=positions, cache=cache).logits
    torch.testing.assert_close(outputs[ATTN_NAME], outputs["eager"], atol=TOL, rtol=0)


@pytest.mark.slow
def test_bundled_model_greedy_identical_to_sdpa(bundled):
    model, tokenizer = bundled
    batch = tokenizer(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True,
                      padding_side="left")
    settings = dict(**batch, max_new_tokens=16, do_sample=False)
    expected = model.generate(**settings)
    with enable_gqa(model):
        generated = model.generate(**settings)
    unregister_gqa()
    assert torch.equal(generated, expected)
