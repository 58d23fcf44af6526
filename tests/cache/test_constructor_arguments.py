"""Cache constructors and lookups refuse wrong argument types at the call, naming the fix (not an AttributeError or
IndexError later): a model or None instead of its config, strings / bools / floats where counts belong, a row
that does not exist."""

from __future__ import annotations

import pytest

from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.cache.quantized import QuantizedKVCache
from tests.tiny_models import tiny_config, tiny_model

LLAMA = tiny_config("llama")


@pytest.mark.parametrize("make", [QuantizedKVCache, lambda c: PagedCache(c, num_blocks=8)], ids=["quantized", "paged"])
@pytest.mark.parametrize("given,words", [(None, "got None"), ("model", r"pass model\.config, not the model")])
def test_a_model_or_none_instead_of_a_config(make, given, words):
    config = tiny_model("llama") if given == "model" else None
    with pytest.raises(TypeError, match=words):
        make(config)


@pytest.mark.parametrize("kwargs,words", [
    (dict(bits="4"), r"bits='4' must be an int"),
    (dict(bits=True, method="int8"), r"bits=True must be an int"),
    (dict(residual_length=16.0), r"residual_length=16\.0 must be an int"),
    (dict(method="int8", residual_length=2.0), r"residual_length=2\.0 must be an int"),
    (dict(group_size=16.0), r"group_size=16\.0 must be an int"),
    (dict(sink_tokens=True), r"sink_tokens=True must be an int"),
])
def test_quantized_settings_must_be_ints(kwargs, words):
    with pytest.raises(ValueError, match=words):
        QuantizedKVCache(LLAMA, **kwargs)


def test_paged_block_size_true_is_refused():
    with pytest.raises(ValueError, match=r"block_size must be a positive integer, got True"):
        PagedCache(LLAMA, block_size=True, num_blocks=8)


def test_paged_block_table_of_a_missing_row():
    cache = PagedCache(LLAMA, block_size=4, num_blocks=8)
    with pytest.raises(IndexError, match=r"row 5: the cache holds 0 rows"):
        cache.block_table(5)
