"""``hf_kvspec.cache.contract`` on transformers' DynamicCache / StaticCache (and sliding layers) against plain
tensors, forwarding to our caches, and the refusal messages. Everything here is exact (gathers and slices only)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, QuantizedCache, QuantizedLayer

from hf_kvspec.cache import contract
from hf_kvspec.cache.quantized import QuantizedKVCache
from tests.tiny_models import tiny_config

B, H, D = 3, 2, 16
LLAMA = tiny_config("llama", num_hidden_layers=3)  # D = 64 / 4 = 16, 2 kv heads
MISTRAL = tiny_config("mistral")  # sliding_window = 8: DynamicSlidingWindowLayer layers
MAX = 40


def _states(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, tokens, D, generator=gen), torch.randn(B, H, tokens, D, generator=gen)


class Reference:
    """Per layer, the plain [B, H, S, D] keys/values a cache should hold."""

    def __init__(self, layers: int):
        self.k = [torch.zeros(B, H, 0, D) for _ in range(layers)]
        self.v = [torch.zeros(B, H, 0, D) for _ in range(layers)]

    def append(self, cache, tokens: int, layers, seed: int) -> None:
        keys, values = _states(tokens, seed)
        for i in layers:
            cache.update(keys, values, i)
            self.k[i], self.v[i] = torch.cat([self.k[i], keys], 2), torch.cat([self.v[i], values], 2)

    def keep(self, start: int, indices: torch.Tensor, layers) -> None:
        for i in layers:  # row by row, the obvious way
            for store in (self.k, self.v):
                store[i] = torch.stack([torch.cat([store[i][b, :, :start], store[i][b, :, start + indices[b]]], 1)
                                        for b in range(B)])

    def crop(self, length: int, layers) -> None:
        for i in layers:
            self.k[i], self.v[i] = self.k[i][:, :, :length], self.v[i][:, :, :length]


def _held(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """What a transformers layer holds for positions 0..length-1 (static: the written prefix)."""
    length = contract._length(layer)
    if isinstance(layer.keys, torch.Tensor) and layer.keys.shape[2] > length:  # static: preallocated
        return layer.keys[:, :, :length], layer.values[:, :, :length]
    return layer.keys, layer.values


def _assert_matches(cache, ref: Reference) -> None:
    assert contract.seq_lengths(cache) == [k.shape[2] for k in ref.k]
    for i, layer in enumerate(cache.layers):
        keys, values = _held(layer)
        assert torch.equal(keys, ref.k[i]) and torch.equal(values, ref.v[i])


CACHES = {
    "dynamic": lambda: DynamicCache(config=LLAMA),
    "static": lambda: StaticCache(config=LLAMA, max_cache_len=MAX),
}
HOLES = torch.tensor([[0, 2, 5], [1, 3, 3], [4, 4, 4]])  # row 1 keeps 2 tokens, row 2 one (repeated = holes)
PAIRS = torch.tensor([[0, 2], [1, 3], [3, 3]])  # 2 of a segment of 4 (row 2 keeps one)


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_keep_positions_then_decode_equals_reference(kind):
    cache, ref = CACHES[kind](), Reference(3)
    ref.append(cache, 7, range(3), seed=0)  # prompt
    ref.append(cache, 6, range(3), seed=1)  # a 6-node tree
    contract.keep_positions(cache, 7, HOLES)
    ref.keep(7, HOLES, range(3))
    _assert_matches(cache, ref)
    ref.append(cache, 2, range(3), seed=2)  # decoding continues right after the kept tokens
    _assert_matches(cache, ref)


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_per_layer_append_and_crop_layers(kind):
    cache, ref = CACHES[kind](), Reference(3)
    ref.append(cache, 5, range(3), seed=0)
    ref.append(cache, 4, range(2), seed=1)  # draft tokens in layers 0..1 only
    assert contract.seq_lengths(cache) == [9, 9, 5]
    contract.keep_positions(cache, 5, PAIRS, layers=[0, 1])  # keep within the draft layers only
    ref.keep(5, PAIRS, [0, 1])
    _assert_matches(cache, ref)
    contract.crop_layers(cache, 6, layers=[0, 1])
    ref.crop(6, [0, 1])
    _assert_matches(cache, ref)
    contract.crop_layers(cache, 5)
    ref.crop(5, range(3))
    _assert_matches(cache, ref)


def test_static_edits_stay_in_place():
    """StaticCache keeps static addresses (torch.compile): the same key tensor and the same length tensor."""
    cache, ref = StaticCache(config=LLAMA, max_cache_len=MAX), Reference(3)
    ref.append(cache, 10, range(3), seed=0)
    layer = cache.layers[0]
    keys_ptr, length_tensor = layer.keys.data_ptr(), layer.cumulative_length
    contract.keep_positions(cache, 4, HOLES)
    contract.crop_layers(cache, 5, layers=[0])
    assert layer.keys.data_ptr() == keys_ptr and layer.cumulative_length is length_tensor
    assert int(layer.cumulative_length) == 5 and contract.seq_lengths(cache) == [5, 7, 7]


def test_gather_segment_equals_row_loop():
    states = torch.randn(B, H, 9, D)
    indices = torch.tensor([[8, 0], [3, 3], [1, 7]])
    expected = torch.stack([states[b, :, indices[b]] for b in range(B)])
    assert torch.equal(contract.gather_segment(states, indices), expected)


# ---------------------------------------------------------------------------------------------------- sliding
def test_sliding_layer_keeps_positions_only_while_it_holds_them():
    cache, ref = DynamicCache(config=MISTRAL), Reference(2)
    ref.append(cache, 4, range(2), seed=0)
    ref.append(cache, 3, range(2), seed=1)  # 7 tokens < window 8: everything is held
    contract.keep_positions(cache, 4, torch.tensor([[0, 2], [1, 1], [2, 2]]))
    ref.keep(4, torch.tensor([[0, 2], [1, 1], [2, 2]]), range(2))
    _assert_matches(cache, ref)
    with pytest.raises(ValueError, match="activate_past_recording"):
        contract.check_contract(cache, keep_positions=True)
    ref.append(cache, 6, range(2), seed=2)  # 12 tokens: the layer dropped all but its last 7
    before = [t.clone() for t in (cache.layers[0].keys, cache.layers[1].keys)]
    with pytest.raises(ValueError, match="no longer holds positions"):
        contract.keep_positions(cache, 9, torch.tensor([[0], [1], [2]]))
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.layers[0].keys, cache.layers[1].keys)))


def test_sliding_layer_recording_its_past_keeps_positions_past_the_window():
    cache = DynamicCache(config=MISTRAL)
    cache.activate_past_recording()
    contract.check_contract(cache, keep_positions=True, per_layer=True)
    ref = Reference(2)
    ref.append(cache, 10, range(2), seed=0)
    cache.crop(0)  # back to the window: positions 3..9 held
    ref.append(cache, 5, range(2), seed=1)  # a 5-node tree at positions 10..14
    contract.keep_positions(cache, 10, PAIRS)
    cache.crop(0)
    ref.keep(10, PAIRS, range(2))
    for i, layer in enumerate(cache.layers):
        assert contract._length(layer) == 12 and layer.keys.shape[2] == 7  # the window's last 7 tokens
        assert torch.equal(layer.keys, ref.k[i][:, :, -7:]) and torch.equal(layer.values, ref.v[i][:, :, -7:])


# ---------------------------------------------------------------------------------------------------- our caches
def test_quantized_cache_is_forwarded_and_refuses_flushed_segments_by_rule():
    cache = QuantizedKVCache(LLAMA, bits=4, group_size=16, residual_length=32)
    ref = Reference(3)
    ref.append(cache, 20, range(3), seed=0)
    ref.append(cache, 6, range(3), seed=1)  # 26 tokens, nothing flushed yet
    contract.keep_positions(cache, 20, HOLES)
    ref.keep(20, HOLES, range(3))
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys, ref.k[i]) and torch.equal(layer.values, ref.v[i])
    ref.append(cache, 30, range(3), seed=2)  # 53 tokens: 32 flushed, a 30-token segment cannot fit
    with pytest.raises(ValueError, match=r"must fit in the residual window.*residual_length=48"):
        contract.keep_positions(cache, 23, HOLES)
    assert contract.seq_lengths(cache) == [53, 53, 53]


def test_quantized_int8_without_window_keeps_positions_among_its_codes():
    """Per-token codes move like states (#29 item 2): window 0 keeps a segment that is all codes already."""
    cache = QuantizedKVCache(LLAMA, method="int8")
    cache.update(*_states(12, 0), 0)
    cache.keep_positions(8, PAIRS, layers=[0])
    assert cache.get_seq_length(0) == 8 + PAIRS.shape[1] and cache.layers[0].store.length == 8 + PAIRS.shape[1]


def test_quantized_kivi_without_room_names_the_window_and_why():
    cache = QuantizedKVCache(LLAMA, bits=2, group_size=16, residual_length=0)
    cache.update(*_states(12, 0), 0)
    cache.update(*_states(8, 1), 0)  # 20 tokens: the first group of 16 is flushed
    with pytest.raises(ValueError, match=r"flushed into kivi codes.*per channel.*residual_length=32"):
        cache.keep_positions(8, PAIRS, layers=[0])


# ---------------------------------------------------------------------------------------------------- refusals
class _IdentityQuantizedLayer(QuantizedLayer):
    """transformers' QuantizedLayer with an identity 'backend' (optimum-quanto / hqq are not installed here)."""

    def _quantize(self, tensor, axis):
        return tensor

    def _dequantize(self, q_tensor):
        return q_tensor


def test_transformers_quantized_cache_is_refused_by_name():
    cache = QuantizedCache.__new__(QuantizedCache)  # its __init__ needs a quantization backend
    Cache.__init__(cache, layers=[_IdentityQuantizedLayer()])
    with pytest.raises(ValueError, match=r"QuantizedCache holds transformers' quantized layers.*QuantizedKVCache"):
        contract.check_contract(cache)


def test_static_sliding_layer_longer_than_its_window_is_refused():
    cache = StaticCache(config=MISTRAL, max_cache_len=32)  # window 8 < 32: evicted states are gone
    with pytest.raises(ValueError, match="is_croppable is False"):
        contract.check_contract(cache)
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer longer than its window"):
        contract.crop_layers(cache, 0)


def test_capabilities_are_class_flags_of_our_caches():
    from hf_kvspec.cache.paged import PagedCache

    flags = lambda cls: (cls.keeps_positions, cls.crops_layers, cls.has_keep_capacity)  # noqa: E731
    assert flags(PagedCache) == (True, True, False) and flags(QuantizedKVCache) == (True, True, True)
    assert not isinstance(DynamicCache(config=LLAMA), contract.Capabilities)  # transformers': the layer table decides

    class NoKeep(QuantizedKVCache):  # a cache of ours that does not keep positions: refused by its flag, by name
        keeps_positions = False

    cache = NoKeep(LLAMA, method="int8", residual_length=8)
    contract.check_contract(cache, per_layer=True)
    for call in (lambda: contract.check_contract(cache, keep_positions=True),
                 lambda: contract.keep_positions(cache, 0, torch.zeros(1, 0, dtype=torch.long))):
        with pytest.raises(ValueError, match=r"NoKeep has no keep_positions\(\)"):
            call()


def test_contract_accepts_what_it_supports():
    for cache in (DynamicCache(config=LLAMA), StaticCache(config=LLAMA, max_cache_len=MAX),
                  QuantizedKVCache(LLAMA, method="int8", residual_length=8), None):
        contract.check_contract(cache, keep_positions=True, per_layer=True, segment=8)
    contract.check_contract(QuantizedKVCache(LLAMA, method="int8"), per_layer=True)  # rollback needs no window


@pytest.mark.parametrize("settings, segment, fix", [
    (dict(bits=2, group_size=16, residual_length=0), None, "residual_length=16"),  # window 0: no tree can be kept
    (dict(bits=4, group_size=16, residual_length=32), 18, "residual_length=48"),  # 32 - 16 + 1 = 17 < 18
])
def test_quantized_cache_too_small_for_the_tree_is_refused_up_front(settings, segment, fix):
    with pytest.raises(ValueError, match=f"must fit in the residual window.*{fix}"):
        contract.check_contract(QuantizedKVCache(LLAMA, **settings), keep_positions=True, segment=segment)
    contract.check_contract(QuantizedKVCache(LLAMA, **settings), keep_positions=False)


@pytest.mark.parametrize("settings", [dict(method="int8"), dict(method="fp8", residual_length=3)])
def test_per_token_quantized_caches_take_trees_of_any_size(settings):
    contract.check_contract(QuantizedKVCache(LLAMA, **settings), keep_positions=True, segment=200)


@pytest.mark.parametrize("start, indices, match", [
    (3, torch.tensor([[0], [1], [2]]).float(), "integer tensor"),
    (3, torch.tensor([[0], [1]]), "2 rows but the cache holds 3"),
    (12, torch.tensor([[0], [0], [0]]), "start=12 is outside"),
    (8, torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2]]), "cannot keep 3 positions of a 2-token segment"),
    (8, torch.tensor([[0], [2], [1]]), r"0\.\.1"),
])
@pytest.mark.parametrize("kind", sorted(CACHES))
def test_bad_keep_arguments_are_refused_before_any_change(kind, start, indices, match):
    cache, ref = CACHES[kind](), Reference(3)
    ref.append(cache, 10, range(3), seed=0)
    with pytest.raises(ValueError, match=match):
        contract.keep_positions(cache, start, indices)
    _assert_matches(cache, ref)


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_crop_layers_refuses_a_length_past_a_layer(kind):
    cache, ref = CACHES[kind](), Reference(3)
    ref.append(cache, 6, range(3), seed=0)
    ref.append(cache, 2, range(2), seed=1)
    with pytest.raises(ValueError, match="layer 2 holds 6 tokens"):
        contract.crop_layers(cache, 7)  # layers 0, 1 could, layer 2 cannot: nothing changes
    _assert_matches(cache, ref)
