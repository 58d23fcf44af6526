"""The CLI's cache factory: names to caches, and the attention each cache reads natively."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec import _compat
from hf_kvspec.cache.factory import CACHE_CHOICES, enable_cache_attention, make_cache
from tests.tiny_models import tiny_model


def test_quantized_caches_switch_to_code_reading_attention_and_back():
    model = tiny_model("llama", seed=0)
    before = _compat.attn_implementation(model.config)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    reference = model.generate(ids, cache=make_cache("int8", model.config), max_new_tokens=6, do_sample=False)
    patch = enable_cache_attention("int8", model)
    try:
        assert _compat.attn_implementation(model.config) == "kvspec_quant"
        fast = model.generate(ids, cache=make_cache("int8", model.config), max_new_tokens=6, do_sample=False)
        assert torch.equal(fast, reference)  # same codes read two ways: same greedy tokens on a tiny fp32 model
    finally:
        patch.remove()
    assert _compat.attn_implementation(model.config) == before


def test_other_caches_need_no_switch_and_unknown_names_fail():
    model = tiny_model("llama", seed=0)
    assert enable_cache_attention("dynamic", model) is None and enable_cache_attention("paged", model) is None
    assert set(CACHE_CHOICES) >= {"dynamic", "paged", "kivi4", "int8"}
    with pytest.raises(ValueError, match="choose one of"):
        enable_cache_attention("int3", model)


def test_paged_pool_sized_to_the_request():
    model = tiny_model("llama", seed=0)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    cache = make_cache("paged", model.config, max_tokens=ids.shape[1] + 27)
    assert cache.pool.num_blocks == 2 + 1  # ceil(32 / 16) blocks for the row plus one spare
    out = model.generate(ids, cache=cache, max_new_tokens=27, min_new_tokens=27, do_sample=False)
    expected = model.generate(ids, cache=make_cache("dynamic", model.config), max_new_tokens=27, min_new_tokens=27,
                              do_sample=False)
    assert torch.equal(out, expected)
    assert make_cache("paged", model.config, max_tokens=40, batch_size=3).pool.num_blocks == 3 * 3 + 1
    with pytest.raises(ValueError, match="must be positive"):
        make_cache("paged", model.config, max_tokens=0)
