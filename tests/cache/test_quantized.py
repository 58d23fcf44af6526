"""QuantizedKVCache bookkeeping: flush rule, no re-quantization, nbytes == formula, sinks, crop, beams, errors.

Generation-level checks (greedy equality, logits tolerance, speculative decoding) are in
``test_quantized_generate.py``.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.cache.factory import make_cache
from hf_kvspec.cache.quantized import QuantizedKVCache
from hf_kvspec.memory import kv_cache_bytes, quantized_token_split
from tests.tiny_models import tiny_config

HEADS, DIM = 2, 64
CONFIG = tiny_config("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=HEADS)  # D = 64
SETTINGS = {
    "kivi4": dict(bits=4, group_size=16, residual_length=32),
    "kivi2": dict(bits=2, group_size=32, residual_length=0),
    "int8": dict(method="int8"),
    "int8-window": dict(method="int8", residual_length=5),
    "fp8": dict(method="fp8", residual_length=3),
}


def _states(tokens, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HEADS, tokens, DIM, generator=gen),
            torch.randn(batch, HEADS, tokens, DIM, generator=gen))


def _grow(cache, chunks, batch=2, seed=0):
    """Feed chunks of the given sizes to layer 0 (and the other layers, so nbytes covers the whole cache)."""
    outputs = []
    for i, size in enumerate(chunks):
        keys, values = _states(size, batch, seed + i)
        for layer in range(CONFIG.num_hidden_layers):
            outputs.append((keys, values, *cache.update(keys, values, layer)))
    return outputs


def _formula(cache, tokens, batch=2):
    sinks = min(tokens, cache.settings.sink_tokens)
    quantized = kv_cache_bytes(CONFIG, tokens - sinks, batch, torch.float32, **cache.settings.memory_kwargs())
    return quantized + kv_cache_bytes(CONFIG, sinks, batch, torch.float32)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_window_bounded_and_nbytes_equals_formula_at_every_step(name):
    cache = QuantizedKVCache(CONFIG, **SETTINGS[name])
    settings, total = cache.settings, 0
    for size in (37, 1, 1, 7, 16, 1, 40, 3):  # prompt, decode steps, speculative-sized chunks
        _grow(cache, [size])
        total += size
        layer = cache.layers[0]
        quantized, residual = quantized_token_split(total, settings.flush_unit, settings.residual_length)
        assert (layer.store.length, layer.keys.shape[2]) == (quantized, residual)
        window_cap = settings.residual_length or settings.flush_unit - 1  # window 0: only an incomplete unit
        assert layer.keys.shape[2] <= window_cap
        assert cache.get_seq_length() == total
        assert cache.nbytes() == _formula(cache, total)


@pytest.mark.parametrize("name", ["kivi4", "kivi2", "int8", "fp8"])
def test_quantized_tokens_are_never_requantized(name):
    cache = QuantizedKVCache(CONFIG, **SETTINGS[name])
    _grow(cache, [70])
    store = cache.layers[0].store
    before = {key: t.clone() for key, t in store.tensors().items()}
    stored = store.length
    _grow(cache, [1] * 40 + [33], seed=100)  # many more flushes
    after = store.tensors()
    for key, tensor in before.items():
        if key.startswith("k.") and name.startswith("kivi"):
            groups = stored // cache.settings.group_size
            assert torch.equal(after[key][:, :, :groups], tensor)  # key tensors are indexed by group
        else:
            assert torch.equal(after[key][:, :, :stored], tensor)


def test_returned_states_are_what_is_stored():
    """Read rule: the update returns [sinks | dequantized store | window], the window bit-exact."""
    cache = QuantizedKVCache(CONFIG, bits=4, group_size=16, residual_length=16, sink_tokens=3)
    keys, values, out_k, out_v = _grow(cache, [45])[0]
    layer = cache.layers[0]
    assert (layer.sink_keys.shape[2], layer.store.length, layer.keys.shape[2]) == (3, 32, 10)
    store_k, store_v = layer.store.dequantize(torch.float32)
    assert torch.equal(out_k, torch.cat([keys[:, :, :3], store_k, keys[:, :, 35:]], dim=2))
    assert torch.equal(out_v, torch.cat([values[:, :, :3], store_v, values[:, :, 35:]], dim=2))
    assert not torch.equal(store_k, keys[:, :, 3:35])  # really quantized


def test_sinks_stay_exact_and_count_in_nbytes():
    cache = QuantizedKVCache(CONFIG, bits=2, group_size=16, residual_length=0, sink_tokens=4)
    outputs = _grow(cache, [2, 1, 30, 1])  # sinks filled across updates
    chunk = [outputs[i * CONFIG.num_hidden_layers][0] for i in range(3)]  # layer 0's input of chunks 0..2
    first_keys = torch.cat([chunk[0], chunk[1], chunk[2][:, :, :1]], dim=2)
    assert torch.equal(cache.layers[0].sink_keys, first_keys)
    assert cache.nbytes() == _formula(cache, 34)


# ---------------------------------------------------------------------------------------------------- crop
def _state(cache):
    layer = cache.layers[0]
    return [layer.sink_keys, layer.keys, layer.values, *layer.store.tensors().values()]


def _assert_same_state(a, b):
    for x, y in zip(_state(a), _state(b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["int8-window", "fp8", "kivi4"])
def test_crop_inside_window_only_trims_the_window(name):
    cache = QuantizedKVCache(CONFIG, **SETTINGS[name])
    _grow(cache, [37, 1])
    before = [t.clone() for t in _state(cache)]
    cache.crop(-2)
    assert cache.get_seq_length() == 36
    after = _state(cache)
    for i in (1, 2):  # the window's keys and values lose their last 2 tokens
        assert torch.equal(after[i], before[i][:, :, :-2])
    for i in (0, *range(3, len(before))):  # sinks and the store are untouched
        assert torch.equal(after[i], before[i])


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_crop_inside_window_equals_never_having_seen_the_tokens(name):
    ref, cache = QuantizedKVCache(CONFIG, **SETTINGS[name]), QuantizedKVCache(CONFIG, **SETTINGS[name])
    _grow(ref, [37, 1])
    _grow(cache, [37, 1])
    settings, window = cache.settings, cache.layers[0].keys.shape[2]
    room = (settings.residual_length or settings.flush_unit - 1) - window  # tokens that fit without a flush
    assert room > 0
    _grow(cache, [room], seed=50)
    assert cache.layers[0].store.length == ref.layers[0].store.length  # really only the window grew
    cache.crop(-room)
    _assert_same_state(cache, ref)


def test_crop_across_window_drops_groups_and_keeps_positions():
    cache = QuantizedKVCache(CONFIG, bits=4, group_size=16, residual_length=16)
    outputs = _grow(cache, [60])
    layer = cache.layers[0]
    assert (layer.store.length, layer.keys.shape[2]) == (48, 12)
    key_codes = layer.store.keys.codes.clone()
    deq_keys, _ = layer.store.dequantize(torch.float32)
    cache.crop(-30)  # new length 30: group [16, 32) is cut in the middle, group [32, 48) dropped
    assert cache.get_seq_length() == 30
    assert layer.store.length == 16 and layer.keys.shape[2] == 14
    assert torch.equal(layer.store.keys.codes, key_codes[:, :, :1])  # the whole group before the cut is untouched
    assert torch.equal(layer.keys, deq_keys[:, :, 16:30])  # survivors come back dequantized, in place
    _grow(cache, [1], seed=9)  # decoding continues at position 30
    assert cache.get_seq_length() == 31 and outputs  # cache remains usable
    cache.crop(-31)
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


def test_int8_crop_across_window_is_exact_truncation():
    cache, ref = QuantizedKVCache(CONFIG, method="int8"), QuantizedKVCache(CONFIG, method="int8")
    _grow(cache, [20, 10])
    _grow(ref, [20])
    cache.crop(-10)
    _assert_same_state(cache, ref)


def test_crop_rejects_positive_argument():
    cache = QuantizedKVCache(CONFIG)
    _grow(cache, [5])
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


# ---------------------------------------------------------------------------------------------------- beams
@pytest.mark.parametrize("name", ["kivi4", "int8", "fp8"])
def test_reorder_cache_indexes_every_tensor(name):
    cache = QuantizedKVCache(CONFIG, sink_tokens=2, **SETTINGS[name])
    _grow(cache, [50], batch=3)
    before_k = cache.layers[0].store.dequantize(torch.float32)[0]
    before = [t.clone() for t in _state(cache)]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for old, new in zip(before, _state(cache), strict=True):
        assert torch.equal(new, old[beam_idx])
    assert torch.equal(cache.layers[0].store.dequantize(torch.float32)[0], before_k[beam_idx])  # no extra error


def test_batch_repeat_and_select():
    cache = QuantizedKVCache(CONFIG, bits=4, group_size=16, residual_length=16)
    _grow(cache, [40], batch=2)
    before = [t.clone() for t in _state(cache)]
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([1, 2]))
    for old, new in zip(before, _state(cache), strict=True):
        assert torch.equal(new, old[[0, 1]])


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=3), "bits=2 or 4"),
    (dict(bits=8), "method='int8'"),
    (dict(group_size=0), "positive integer"),
    (dict(group_size=6, bits=2), "multiple of 4"),
    (dict(group_size=64, residual_length=100), "multiple of group_size"),
    (dict(method="int4"), "unknown"),
    (dict(method="int8", bits=4), "8-bit"),
    (dict(method="fp8", group_size=32), "applies to method=.kivi. only"),
    (dict(method="int8", residual_length=-1), "non-negative"),
    (dict(sink_tokens=-2), "non-negative"),
])
def test_invalid_settings_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKVCache(CONFIG, **kwargs)


def test_group_must_divide_head_dim_at_construction():
    # refused when built from the config (issue: it used to fail only at the first flush, token 129)
    with pytest.raises(ValueError, match="must divide it"):
        QuantizedKVCache(tiny_config("llama"), bits=4, group_size=32, residual_length=0)  # D = 16


def test_sliding_window_models_are_refused():
    with pytest.raises(ValueError, match="full-attention"):
        QuantizedKVCache(tiny_config("gemma2"))


def test_factory_names():
    for name, (method, bits, group) in {"kivi4": ("kivi", 4, 64), "kivi2": ("kivi", 2, 32),
                                        "int8": ("int8", 8, None), "fp8": ("fp8", 8, None)}.items():
        cache = make_cache(name, CONFIG)
        assert isinstance(cache, QuantizedKVCache) and cache.is_croppable
        assert (cache.settings.method, cache.settings.bits, cache.settings.group_size) == (method, bits, group)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_store_dequantize_into_equals_reference_ops(name):
    """The layer's in-place dequantization (copy_ + mul_) vs the plain functions of quant_ops."""
    from hf_kvspec.cache import quant_ops as ops

    cache = QuantizedKVCache(CONFIG, **SETTINGS[name])
    _grow(cache, [20])
    store = cache.layers[0].store
    keys, values = store.dequantize(torch.float32)
    s = store.state
    if name == "int8":
        expected = ops.dequantize_int8(s["k.codes"], s["k.scale"], torch.float32), \
            ops.dequantize_int8(s["v.codes"], s["v.scale"], torch.float32)
    else:
        expected = ops.dequantize_fp8(s["k.codes"], s["k.scale"], torch.float32), \
            ops.dequantize_fp8(s["v.codes"], s["v.scale"], torch.float32)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_per_token_codes_do_not_depend_on_the_update_they_came_in(name):
    """Speculative decoding feeds the prompt together with the first drafts; plain decoding feeds it alone. The
    codes of the prompt tokens must be the same either way (identity of the two decodes rests on it): a token's
    codes and scale may depend on that token only, not on the other tokens of its update."""
    keys, values = _states(24)
    alone = QuantizedKVCache(CONFIG, method=name)
    alone.update(keys[:, :, :20], values[:, :, :20], 0)
    with_drafts = QuantizedKVCache(CONFIG, method=name)
    loud = (keys * 8, values * 8)  # drafts larger than anything in the prompt
    with_drafts.update(torch.cat([keys[:, :, :20], loud[0][:, :, 20:]], 2),
                       torch.cat([values[:, :, :20], loud[1][:, :, 20:]], 2), 0)
    with_drafts.crop(-4)  # the drafts were rejected
    expected, got = alone.layers[0].store.tensors(), with_drafts.layers[0].store.tensors()
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key].float(), tensor.float()), key
