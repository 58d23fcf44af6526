"""QuantizedKVCache under the cache contract (C2 per-layer lengths, C3 crop / crop_layers, C4 keep_positions,
C6 refusals), and construction-time validation of the KIVI group against the model's head dim."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_kvspec.cache.quantized import QuantizedKVCache
from tests.tiny_models import tiny_config


# ---------------------------------------------------------------------------------------------------- head dim
@pytest.mark.parametrize("head_dim, works", [(80, "2, 4, 8, 10, 16, 20, 40, 80"),
                                              (96, "2, 4, 6, 8, 12, 16, 24, 32, 48, 96")])
def test_default_kivi_group_is_checked_against_head_dim_at_construction(head_dim, works):
    """Phi-2 (D = 80) / Phi-3 (D = 96) shapes: the default group 64 used to fail only at the first flush."""
    config = tiny_config("llama", hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="group_size=64 must divide it") as error:
        QuantizedKVCache(config)
    assert f"head_dim={head_dim}" in str(error.value) and works in str(error.value)


def test_explicit_head_dim_wins_and_a_dividing_group_constructs():
    config = tiny_config("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=80)
    with pytest.raises(ValueError, match="head_dim=80"):
        QuantizedKVCache(config, bits=4, group_size=64, residual_length=128)
    cache = QuantizedKVCache(config, bits=4, group_size=16, residual_length=128)
    keys = torch.randn(1, 2, 200, 80)
    cache.update(keys, keys, 0)  # flushes without error
    assert cache.layers[0].store.length > 0


# ---------------------------------------------------------------------------------------------------- refusals
def test_crop_layers_refuses_before_changing_anything():
    cache = QuantizedKVCache(tiny_config("llama", num_hidden_layers=3), method="int8", residual_length=4)
    states = torch.randn(1, 2, 9, 16)
    for i in range(3):
        cache.update(states[:, :, : 9 if i < 2 else 5], states[:, :, : 9 if i < 2 else 5], i)
    with pytest.raises(ValueError, match="layer 2 holds 5 tokens"):
        cache.crop_layers(7)
    with pytest.raises(ValueError, match=r"layers \[3\] do not exist"):
        cache.crop_layers(1, [0, 3])
    assert [cache.get_seq_length(i) for i in range(3)] == [9, 9, 5]
    cache.crop_layers(7, [0, 1])
    assert [cache.get_seq_length(i) for i in range(3)] == [7, 7, 5]


def test_a_tree_that_fits_the_stated_window_is_never_refused():
    """The documented guarantee: KIVI residual_length >= n + group_size - 1 keeps an n-node tree at full
    precision after the update that wrote it, wherever the flush boundary falls."""
    nodes, group, residual = 17, 16, 32  # 32 >= 17 + 16 - 1: the largest tree this window guarantees
    for prompt in range(1, 2 * group + 2):  # every position of the flush boundary relative to the tree
        cache = QuantizedKVCache(tiny_config("llama"), bits=4, group_size=group, residual_length=residual)
        assert cache.settings.keep_capacity() == nodes
        cache.update(torch.randn(1, 2, prompt, 16), torch.randn(1, 2, prompt, 16), 0)
        cache.update(torch.randn(1, 2, nodes, 16), torch.randn(1, 2, nodes, 16), 0)
        cache.keep_positions(prompt, torch.tensor([[0, 3, 16]]), layers=[0])
        assert cache.get_seq_length(0) == prompt + 3
    cache = QuantizedKVCache(tiny_config("llama"), bits=4, group_size=group, residual_length=group)  # too small
    cache.update(torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16), 0)
    cache.update(torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), 0)  # 19 > 16 tokens: flushes 0..15
    with pytest.raises(ValueError, match=r"positions 10\.\.15 .* residual_length=32"):
        cache.keep_positions(10, torch.tensor([[0, 3, 8]]), layers=[0])


# ---------------------------------------------------------------------------------------------------- state machine
# Shadow model: per layer, the full-precision value of every position ([B, H, S, D], plain tensors) — the input
# token, or, for a token a crop moved back out of a cut KIVI group, the dequantized value the cache now holds
# (checked against its bound when it moves). After every step each layer must read back:
#   sinks and window   bit-exact (they are slices of what was appended; keep_positions only gathers them);
#   store              within the bound of one quantization of the shadow values (see _store_bound).
HEADS, DIM, LAYERS = 2, 32, 3
TINY = tiny_config("llama", hidden_size=4 * DIM, num_attention_heads=4, num_key_value_heads=HEADS,
                   num_hidden_layers=LAYERS)  # D = 32: two KIVI value groups of 16 per head
FP16_EPS = 2.0 ** -10  # relative rounding of the fp16 scale (rounded up) and zero (rounded down)


def _group_bound(x: torch.Tensor, dim: int, levels: int, symmetric: bool) -> torch.Tensor:
    """Per-element bound for groups running along ``dim``: |x - deq(x)| <= scale / 2, with scale the group's
    range / levels (int8: amax / 127) rounded up to fp16; the zero's fp16 rounding (<= FP16_EPS·|min|) widens
    the range, and 1e-5 covers fp32 rounding of ``code·scale + zero`` on unit-variance values (~1e-7)."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if symmetric:
        span = torch.maximum(lo.abs(), hi.abs())
    else:
        span = hi - lo + FP16_EPS * (lo.abs() + hi.abs())
    return (span / levels * (1 + FP16_EPS) / 2 + 1e-5).expand_as(x)


def _store_bound(settings, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys/values [B, H, S, D] (shadow values of the stored positions) -> per-element bounds, same shape."""
    if settings.method == "int8":
        return _group_bound(keys, 3, 127, True), _group_bound(values, 3, 127, True)
    g, levels = settings.group_size, (1 << settings.bits) - 1
    k = keys.unflatten(2, (keys.shape[2] // g, g))  # KIVI keys: per channel, groups of G tokens
    v = values.unflatten(3, (DIM // g, g))  # values: per token, groups of G channels
    return _group_bound(k, 3, levels, False).flatten(2, 3), _group_bound(v, 4, levels, False).flatten(3, 4)


def _snapshot(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        if layer.is_initialized:
            out += [layer.sink_keys, layer.sink_values, layer.keys, layer.values, *layer.store.tensors().values()]
    return [t.clone() for t in out]


class QuantizedContract(RuleBasedStateMachine):
    settings_kwargs: ClassVar[dict] = {}

    def __init__(self):
        super().__init__()
        self.cache = QuantizedKVCache(TINY, **self.settings_kwargs)
        self.batch = 2
        self.ref = [None] * LAYERS  # per layer (keys, values) [B, H, S, D] or None before the first update

    # ---- helpers
    def _length(self, i: int) -> int:
        return 0 if self.ref[i] is None else self.ref[i][0].shape[2]

    def _parts(self, i: int) -> tuple[int, int]:
        layer = self.cache.layers[i]
        return (layer.sink_keys.shape[2], layer.store.length) if layer.is_initialized else (0, 0)

    def _bounds(self, i: int):
        sinks, stored = self._parts(i)
        keys, values = (r[:, :, sinks:sinks + stored] for r in self.ref[i])
        return sinks, _store_bound(self.cache.settings, keys, values)

    def _adopt_survivors(self, before: dict) -> None:
        """Positions a crop moved from the store back to the window come back dequantized: within the bound of
        their quantization, after which the shadow takes the cache's value (it will be quantized again)."""
        for i, (sinks, flushed_end, (bound_k, bound_v)) in before.items():
            if self.ref[i] is None:
                continue
            _, stored = self._parts(i)
            lo, hi = sinks + stored, min(flushed_end, self._length(i))
            if lo >= hi:
                continue
            layer, window_at = self.cache.layers[i], sinks + stored
            got_k, got_v = (w[:, :, lo - window_at:hi - window_at] for w in (layer.keys, layer.values))
            ref_k, ref_v = self.ref[i]
            assert ((got_k - ref_k[:, :, lo:hi]).abs() <= bound_k[:, :, lo - sinks:hi - sinks]).all()
            assert ((got_v - ref_v[:, :, lo:hi]).abs() <= bound_v[:, :, lo - sinks:hi - sinks]).all()
            ref_k[:, :, lo:hi], ref_v[:, :, lo:hi] = got_k, got_v
            event("crop moved dequantized tokens back to the window")

    def _before_cut(self, layers) -> dict:
        out = {}
        for i in layers:
            if self.ref[i] is not None:
                sinks, bounds = self._bounds(i)
                out[i] = (sinks, sinks + self._parts(i)[1], bounds)
        return out

    def _truncate_ref(self, i: int, length: int) -> None:
        if self.ref[i] is not None:
            self.ref[i] = tuple(r[:, :, :length].clone() for r in self.ref[i])

    # ---- rules
    @initialize(tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
    def prefill(self, tokens, seed):
        self.update(tokens, LAYERS, seed)

    @rule(tokens=st.integers(1, 40), upto=st.integers(1, LAYERS), seed=st.integers(0, 2**16))
    def update(self, tokens, upto, seed):
        """Append to layers 0..upto-1 (upto < LAYERS: a self-speculation draft writing its first layers)."""
        gen = torch.Generator().manual_seed(seed)
        keys, values = (torch.randn(self.batch, HEADS, tokens, DIM, generator=gen) for _ in range(2))
        for i in range(upto):
            self.cache.update(keys, values, i)
            old = self.ref[i]
            self.ref[i] = (keys.clone(), values.clone()) if old is None else \
                (torch.cat([old[0], keys], 2), torch.cat([old[1], values], 2))

    @rule(data=st.data())
    def crop(self, data):
        k = data.draw(st.integers(0, min(self._length(i) for i in range(LAYERS))))
        before = self._before_cut(range(LAYERS))
        lengths = [self._length(i) for i in range(LAYERS)]
        self.cache.crop(-k)
        for i in range(LAYERS):
            self._truncate_ref(i, lengths[i] - k)
        self._adopt_survivors(before)

    @rule(data=st.data())
    def crop_layers(self, data):
        first = data.draw(st.integers(0, LAYERS - 1))
        layers = list(range(first, data.draw(st.integers(first + 1, LAYERS))))
        length = data.draw(st.integers(0, min(self._length(i) for i in layers)))
        before = self._before_cut(layers)
        self.cache.crop_layers(length, layers)
        for i in layers:
            self._truncate_ref(i, length)
        self._adopt_survivors(before)

    @rule(data=st.data())
    def keep_positions(self, data):
        """Keep positions of a segment ending at the shortest chosen layer's length (any size: often illegal)."""
        layers = list(range(data.draw(st.integers(1, LAYERS))))
        shortest = min(self._length(i) for i in layers)
        self._keep(data, layers, shortest - data.draw(st.integers(0, min(shortest, 12))), shortest)

    @rule(nodes=st.integers(1, 8), seed=st.integers(0, 2**16), data=st.data())
    def tree(self, nodes, seed, data):
        """What a tree verification does: append N nodes to every layer, then keep each row's accepted path."""
        self.update(nodes, LAYERS, seed)
        self._keep(data, list(range(LAYERS)), min(self._length(i) for i in range(LAYERS)) - nodes,
                   min(self._length(i) for i in range(LAYERS)))

    def _keep(self, data, layers, start, end):
        segment = end - start  # indices must be valid in every chosen layer
        k = data.draw(st.integers(min(segment, 1), segment))
        rows = []
        for _ in range(self.batch):  # ascending distinct positions, a short row padded by repeating one
            count = data.draw(st.integers(min(k, 1), k))
            kept = sorted(data.draw(st.sets(st.integers(0, segment - 1), min_size=count, max_size=count))) \
                if count else []
            rows.append(kept + [kept[-1] if kept else 0] * (k - len(kept)))
        indices = torch.tensor(rows, dtype=torch.long).reshape(self.batch, k)
        per_token = self.cache.settings.method != "kivi"  # int8: codes move like states (after the sinks)
        legal = all(self._parts(i)[1] == 0 or start >= sum(self._parts(i)) or (per_token and start >= self._parts(i)[0])
                    for i in layers)
        event(f"keep_positions {'legal' if legal else 'refused'}")
        if not legal:
            before = _snapshot(self.cache)
            with pytest.raises(ValueError, match=r"must fit in the residual window|keep positions after the sinks"):
                self.cache.keep_positions(start, indices, layers)
            assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(self.cache), strict=True))
            return
        self.cache.keep_positions(start, indices, layers)
        for i in layers:  # the plain reference: row by row
            self.ref[i] = tuple(torch.stack([torch.cat([r[b, :, :start], r[b, :, start + indices[b]]], 1)
                                             for b in range(self.batch)]) for r in self.ref[i])
            self._adopt_dequantized_holes(i)

    def _adopt_dequantized_holes(self, i: int) -> None:
        """int8 keep-positions: a window slot whose (repeated, hole) index named a stored token holds that token
        dequantized: within its quantization bound, after which the shadow takes the cache's value."""
        sinks, stored = self._parts(i)
        layer, (ref_k, ref_v) = self.cache.layers[i], self.ref[i]
        for got, ref in ((layer.keys, ref_k), (layer.values, ref_v)):
            want = ref[:, :, sinks + stored:]
            if torch.equal(got, want):
                continue
            bound, _ = _store_bound(self.cache.settings, want, want)
            assert ((got - want).abs() <= bound).all()
            want.copy_(got)
            event("keep_positions read a hole back dequantized")

    @rule(data=st.data())
    def reorder(self, data):
        beam = torch.tensor(data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch,
                                               max_size=self.batch)))
        self.cache.reorder_cache(beam)
        self.ref = [None if r is None else tuple(t[beam] for t in r) for r in self.ref]

    @precondition(lambda self: self.batch > 1)
    @rule(data=st.data())
    def batch_select(self, data):
        rows = torch.tensor(sorted(data.draw(st.sets(st.integers(0, self.batch - 1), min_size=1,
                                                     max_size=self.batch - 1))))
        self.cache.batch_select_indices(rows)
        self.batch = len(rows)
        self.ref = [None if r is None else tuple(t[rows] for t in r) for r in self.ref]

    @precondition(lambda self: self.batch == 1)
    @rule()
    def batch_repeat(self):
        self.cache.batch_repeat_interleave(2)
        self.batch = 2
        self.ref = [None if r is None else tuple(t.repeat_interleave(2, dim=0) for t in r) for r in self.ref]

    # ---- the check after every step
    @invariant()
    def reads_back_the_reference(self):
        s = self.cache.settings
        for i, layer in enumerate(self.cache.layers):
            assert self.cache.get_seq_length(i) == self._length(i)
            if self.ref[i] is None:
                continue
            ref_k, ref_v = self.ref[i]
            sinks, stored = self._parts(i)
            assert sinks == min(s.sink_tokens, self._length(i)) and stored % s.flush_unit == 0
            assert layer.keys.shape[2] <= max(s.residual_length, s.flush_unit - 1)
            assert torch.equal(layer.sink_keys, ref_k[:, :, :sinks]) and torch.equal(layer.sink_values, ref_v[:, :, :sinks])
            assert torch.equal(layer.keys, ref_k[:, :, sinks + stored:])
            assert torch.equal(layer.values, ref_v[:, :, sinks + stored:])
            if stored:
                got_k, got_v = layer.store.dequantize(torch.float32)
                _, (bound_k, bound_v) = self._bounds(i)
                assert ((got_k - ref_k[:, :, sinks:sinks + stored]).abs() <= bound_k).all()
                assert ((got_v - ref_v[:, :, sinks:sinks + stored]).abs() <= bound_v).all()


class Int8NoWindow(QuantizedContract):
    settings_kwargs: ClassVar[dict] = dict(method="int8")


class Int8Window(QuantizedContract):
    settings_kwargs: ClassVar[dict] = dict(method="int8", residual_length=6, sink_tokens=2)


class Kivi4Window(QuantizedContract):
    settings_kwargs: ClassVar[dict] = dict(bits=4, group_size=16, residual_length=32, sink_tokens=3)


_RUN = settings(max_examples=25, stateful_step_count=20, deadline=None)
TestInt8NoWindow = Int8NoWindow.TestCase
TestInt8NoWindow.settings = _RUN
TestInt8Window = Int8Window.TestCase
TestInt8Window.settings = _RUN
TestKivi4Window = Kivi4Window.TestCase
TestKivi4Window.settings = _RUN
