"""The stored forms and the cache -> attention channel (``hf_kvspec.stored_kv``): a cache pairs with an attention
function once, at construction, and what ``update`` returns never changes afterwards."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hf_kvspec import stored_kv
from hf_kvspec.attention.gqa import enable_gqa
from hf_kvspec.attention.quantized import enable_quantized_attention
from hf_kvspec.cache.quantized import QuantizedKVCache
from hf_kvspec.stored_kv import PagedKV, QuantizedKV, StoredKV
from tests.tiny_models import tiny_model

SETTINGS = dict(method="int8")  # residual 0: every token is in the store, so a paired layer hands codes over


def test_stored_forms_name_their_reader_and_are_frozen():
    view = PagedKV(torch.zeros(1, 1, dtype=torch.long), 1)
    assert isinstance(view, StoredKV) and issubclass(QuantizedKV, StoredKV)
    assert (PagedKV.reader, QuantizedKV.reader) == ("kvspec_paged", "kvspec_quant")
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.kv_length = 2


@pytest.mark.parametrize("running", ["sdpa", "eager", "kvspec_paged", "kvspec_quant", None])
def test_paired_reader_is_the_form_reader_only_when_the_model_runs_it(running):
    config = SimpleNamespace(_attn_implementation=running)
    for form in (PagedKV, QuantizedKV):
        assert stored_kv.paired_reader(config, form) == (form.reader if running == form.reader else None)
    assert stored_kv.paired_reader(None, PagedKV) is None


def test_hand_over_refuses_a_model_that_no_longer_runs_the_reader():
    view, kwargs = PagedKV(torch.zeros(1, 1, dtype=torch.long), 1), {}
    stored_kv.hand_over(kwargs, view, SimpleNamespace(_attn_implementation="kvspec_paged"), "PagedCache")
    assert stored_kv.received(kwargs) is view and kwargs == {}
    with pytest.raises(ValueError, match=r"now runs 'sdpa'.*Build the cache after switching attention"):
        stored_kv.hand_over(kwargs, view, SimpleNamespace(_attn_implementation="sdpa"), "PagedCache")
    assert kwargs == {}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


def _step_logits(model, cache, ids) -> torch.Tensor:
    """Prefill ids[:, :-1], then one decode step; [1, V] logits of the step."""
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        return model(ids[:, -1:], cache=cache).logits[:, -1]


def test_switching_attention_after_building_never_changes_what_update_returns(model):
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    dense_cache = QuantizedKVCache(model.config, **SETTINGS)  # built under sdpa: dequantized keys/values for good
    with enable_gqa(model):  # kvspec_quant with nothing handed over attends as kvspec_gqa does
        reference = _step_logits(model, QuantizedKVCache(model.config, **SETTINGS), ids)
    with enable_quantized_attention(model):
        fused_cache = QuantizedKVCache(model.config, **SETTINGS)
        assert (dense_cache.paired_attention, fused_cache.paired_attention) == (None, "kvspec_quant")
        # a cache built before the switch keeps handing dequantized keys over: bit-for-bit the kvspec_gqa result
        assert torch.equal(_step_logits(model, dense_cache, ids), reference)
        with torch.no_grad():
            model(ids[:, :-1], cache=fused_cache)
            kwargs: dict = {}
            keys, _ = fused_cache.layers[0].update(torch.ones(1, 2, 1, 64), torch.ones(1, 2, 1, 64), kwargs=kwargs)
        assert isinstance(kwargs[stored_kv.KWARG], QuantizedKV) and keys.shape[2] == 0  # window only (residual 0)
    with pytest.raises(ValueError, match="QuantizedKVCache was built while the model ran 'kvspec_quant'"):
        _step_logits(model, fused_cache, ids)  # the codes would otherwise reach sdpa as a (window-only) key
