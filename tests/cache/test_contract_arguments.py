"""Every cache refuses the same bad contract arguments (C3 ``crop_layers``, C4 ``keep_positions``, C6) with the
same words and before anything changes: transformers' DynamicCache / StaticCache through ``contract``, and
``PagedCache`` / ``QuantizedKVCache`` through their own methods (reached through ``contract`` as the loop does)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, DynamicLayer

from hf_kvspec.cache import contract
from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.cache.quantized import QuantizedKVCache
from tests.tiny_models import tiny_config

B, H, D, LAYERS, TOKENS = 3, 2, 16, 3, 10
LLAMA = tiny_config("llama", num_hidden_layers=LAYERS)  # D = 64 / 4 = 16, 2 kv heads

CACHES = {
    "dynamic": lambda: DynamicCache(config=LLAMA),
    "static": lambda: StaticCache(config=LLAMA, max_cache_len=32),
    "paged": lambda: PagedCache(LLAMA, block_size=4, num_blocks=32),
    "quantized": lambda: QuantizedKVCache(LLAMA, method="int8", residual_length=16),  # 10 tokens: none flushed
}
ROWS = torch.tensor([[0], [1], [0]])  # one kept position per row

BAD_CALLS = {  # name -> (call, words every cache must say)
    "float length": (lambda c: contract.crop_layers(c, 5.0), r"crop_layers\(5\.0\): layer 0 holds 10 tokens"),
    "length past a layer": (lambda c: contract.crop_layers(c, 11), r"pass a length in 0\.\.10"),
    "missing layer": (lambda c: contract.crop_layers(c, 5, [0, 3]), r"layers \[3\] do not exist"),
    "bool layer": (lambda c: contract.crop_layers(c, 5, [True]), r"layers \[True\] do not exist"),
    "float layer": (lambda c: contract.crop_layers(c, 5, [1.0]), r"layers \[1\.0\] do not exist"),
    "float start": (lambda c: contract.keep_positions(c, 8.0, ROWS), "start=8.0 is outside"),
    "start past the layer": (lambda c: contract.keep_positions(c, 12, ROWS), "start=12 is outside"),
    "float indices": (lambda c: contract.keep_positions(c, 8, ROWS.float()), "integer tensor"),
    "complex indices": (lambda c: contract.keep_positions(c, 8, ROWS.to(torch.complex64)), "integer tensor"),
    "missing row": (lambda c: contract.keep_positions(c, 8, ROWS[:2]), "2 rows but the cache holds 3"),
    "too many kept": (lambda c: contract.keep_positions(c, 8, torch.zeros(3, 3, dtype=torch.long)),
                      "cannot keep 3 positions of a 2-token segment"),
    "index past the segment": (lambda c: contract.keep_positions(c, 8, torch.tensor([[0], [2], [1]])),
                               r"must lie in 0\.\.1"),
    "bool layer in keep": (lambda c: contract.keep_positions(c, 8, ROWS, layers=[False]),
                           r"layers \[False\] do not exist"),
}


def _filled(kind: str):
    cache = CACHES[kind]()
    gen = torch.Generator().manual_seed(0)
    for i in range(LAYERS):
        keys, values = torch.randn(B, H, TOKENS, D, generator=gen), torch.randn(B, H, TOKENS, D, generator=gen)
        cache.update(keys, values, i)
    return cache


def _held(cache, i: int) -> torch.Tensor:
    """Keys of layer ``i`` at positions 0..length-1, [B, H, S, D], read without changing anything."""
    length = int(cache.get_seq_length(i))
    if isinstance(cache, PagedCache):
        return cache.gather_positions(i, torch.arange(length).expand(B, -1))[0]
    return cache.layers[i].keys[:, :, :length]  # dynamic, static (preallocated) and the quantized window


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_every_cache_refuses_a_bad_argument_with_the_same_words_before_any_change(name):
    call, words = BAD_CALLS[name]
    messages = set()
    for kind in CACHES:
        cache = _filled(kind)
        before = [_held(cache, i).clone() for i in range(LAYERS)]
        with pytest.raises(ValueError, match=words) as caught:
            call(cache)
        assert contract.seq_lengths(cache) == [TOKENS] * LAYERS, kind
        assert all(torch.equal(a, _held(cache, i)) for i, a in enumerate(before)), kind
        messages.add(str(caught.value).replace(type(cache).__name__, "<cache>"))
    assert len(messages) == 1, messages  # one helper, one wording


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_a_zero_d_integer_tensor_is_an_integer(kind):
    cache = _filled(kind)
    contract.crop_layers(cache, torch.tensor(9), layers=[torch.tensor(0)])
    contract.keep_positions(cache, torch.tensor(7), torch.tensor([[1], [0], [2]]), layers=[1])
    assert contract.seq_lengths(cache) == [9, 8, TOKENS]


# ---------------------------------------------------------------------------------------------------- one check
class _OwnLayer(DynamicLayer):
    """A layer kind contract.py does not edit (it crops like DynamicLayer, but is not one by exact type)."""


def test_the_loop_check_is_the_contract_check():
    from hf_kvspec.speculative.rollback import check_cache

    class NoCrop(DynamicCache):
        is_croppable = False

    for check in (check_cache, contract.check_contract):
        with pytest.raises(ValueError, match=r"NoCrop cannot be cropped \(is_croppable is False.*DynamicCache\("):
            check(NoCrop(config=LLAMA))
        with pytest.raises(ValueError, match="must fit in the residual window"):
            check(QuantizedKVCache(LLAMA, group_size=16, residual_length=128), keep_positions=True, segment=200)
    own = Cache(layers=[_OwnLayer() for _ in range(LAYERS)])
    check_cache(own)  # rolling back needs crop(-k) only: any croppable layer kind will do
    contract.check_contract(own)
    with pytest.raises(ValueError, match="_OwnLayer, which hf_kvspec cannot crop per layer"):
        check_cache(own, per_layer=True)
