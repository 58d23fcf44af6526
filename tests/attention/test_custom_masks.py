"""Custom 4D masks (a token tree) through every attention function of ours, against transformers' own.

The tree (hand-written in ``TREES``): a cached prefix of ``PREFIX`` tokens, then ``NODES = 7`` new tokens, each
seeing the prefix, its ancestors and itself, never a sibling's subtree (row 0: the subtrees under roots 0 and 1
hide each other; row 1: the subtree {5, 6} is hidden from {0..4}). The two batch rows have different trees and
row 1's prefix is left padded by 2 tokens, so the rows differ and none is causal-shaped. Position ids are
``PREFIX + depth - 1``. The bool form (True = attend) is what a caller passes to sdpa, the float form
(0 / ``finfo.min``) what a caller passes to eager.

References are transformers' own attention functions (``AttentionInterface()["sdpa"]``, the modeling files'
``eager_attention_forward``) or whole transformers models under ``attn_implementation="sdpa"`` / ``"eager"``.

Shape legend: B batch, Hq/Hkv heads, G = Hq / Hkv, T new tokens (tree nodes), S keys (prefix + T), D head dim.

Tolerances (fp32). ``ATOL`` 1e-5 on attention outputs: ours and the reference add the same products in another
order (folded queries vs ``repeat_kv``, fused SDPA vs matmul + softmax, scales folded into queries vs a
dequantized copy); measured at most 8e-7 on outputs of magnitude ~1, so >10x headroom, while one wrongly visible
key moves an output by more than 1e-2 (the negative controls). ``LOGITS_ATOL`` 1e-4 on whole-model logits: the
same rounding carried through 2-3 layers and the LM head (measured at most 2e-7; 1e-4 is the MLA tests' bound).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as softcap_eager_attention
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_kvspec.attention import masks
from hf_kvspec.attention.gqa import ATTN_NAME as GQA
from hf_kvspec.attention.gqa import enable_gqa, gqa_attention_forward, register_gqa, unregister_gqa
from hf_kvspec.attention.mla import enable_mla_absorb
from hf_kvspec.attention.paged import ATTN_NAME as PAGED
from hf_kvspec.attention.paged import (
    paged_attention_forward,
    reference_paged_attention,
    register_paged_attention,
    unregister_paged_attention,
)
from hf_kvspec.attention.quantized import ATTN_NAME as QUANT
from hf_kvspec.attention.quantized import (
    quantized_attention_forward,
    reference_quantized_attention,
    register_quantized_attention,
    unregister_quantized_attention,
)
from hf_kvspec.cache.quantized import QuantizedKVCache
from hf_kvspec.stored_kv import KWARG, PagedKV, QuantizedKV
from tests.tiny_models import tiny_config, tiny_model

PREFIX, NODES, PADS = 6, 7, (0, 2)
ATOL, LOGITS_ATOL = 1e-5, 1e-4
SDPA = AttentionInterface()["sdpa"]
TREES = (  # [T, T] ancestors-or-self of each node, one tree per batch row
    # row 0, parents [-1, -1, 0, 0, 1, 2, 4]
    [[1, 0, 0, 0, 0, 0, 0],
     [0, 1, 0, 0, 0, 0, 0],
     [1, 0, 1, 0, 0, 0, 0],
     [1, 0, 0, 1, 0, 0, 0],
     [0, 1, 0, 0, 1, 0, 0],
     [1, 0, 1, 0, 0, 1, 0],
     [0, 1, 0, 0, 1, 0, 1]],
    # row 1, parents [-1, 0, 0, 1, 1, -1, 5]
    [[1, 0, 0, 0, 0, 0, 0],
     [1, 1, 0, 0, 0, 0, 0],
     [1, 0, 1, 0, 0, 0, 0],
     [1, 1, 0, 1, 0, 0, 0],
     [1, 1, 0, 0, 1, 0, 0],
     [0, 0, 0, 0, 0, 1, 0],
     [0, 0, 0, 0, 0, 1, 1]],
)
DEPTHS = torch.tensor([[1, 1, 2, 2, 2, 3, 3], [1, 2, 2, 3, 3, 1, 2]])


def tree_keep(prefix: int = PREFIX, heads: int = 1) -> torch.Tensor:
    """Bool ``[2, heads, T, prefix + T]``; with ``heads > 1`` head h also hides prefix key ``2 + h % 4``."""
    keep = torch.ones(2, 1, NODES, prefix + NODES, dtype=torch.bool)
    for row, (pads, tree) in enumerate(zip(PADS, TREES)):
        keep[row, 0, :, :pads] = False
        keep[row, 0, :, prefix:] = torch.tensor(tree, dtype=torch.bool)
    keep = keep.expand(2, heads, NODES, prefix + NODES).clone()
    if heads > 1:
        for head in range(heads):
            keep[:, head, :, 2 + head % 4] = False
    return keep


def as_float(keep: torch.Tensor, fill: float = torch.finfo(torch.float32).min) -> torch.Tensor:
    return torch.zeros(keep.shape).masked_fill(~keep, fill)


def form(keep: torch.Tensor, kind: str) -> torch.Tensor:
    return {"bool": keep, "float": as_float(keep), "-inf": as_float(keep, float("-inf"))}[kind]


class _Attention(torch.nn.Module):
    """What attention functions read from the calling attention module."""

    is_causal = True

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def qkv(q_heads=6, kv_heads=2, dim=16, prefix=PREFIX, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(2, q_heads, NODES, dim, generator=gen)  # [B, Hq, T, D]
    key, value = (torch.randn(2, kv_heads, prefix + NODES, dim, generator=gen) for _ in range(2))  # [B, Hkv, S, D]
    return query, key, value


def reference(query, key, value, keep, scaling=0.25):
    """transformers' sdpa with the bool mask; checked equal to its eager with the float mask."""
    module = _Attention(query.shape[1] // key.shape[1])
    sdpa, _ = SDPA(module, query, key, value, keep, scaling=scaling)
    eager, _ = eager_attention_forward(module, query, key, value, as_float(keep), scaling=scaling)
    torch.testing.assert_close(eager, sdpa, atol=ATOL, rtol=0)
    return sdpa  # [B, T, Hq, D]


def to_pages(key, value, block_size=4, seed=0):
    """Pages ``[N, P, Hkv, D]`` under a random block permutation, NaN in every slot no row owns; tables [B, M]."""
    batch, heads, length, dim = key.shape
    per_row = -(-length // block_size)
    num_blocks = batch * per_row + 3
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: batch * per_row]
    tables = tables.view(batch, per_row)
    positions = torch.arange(length)
    slots = tables[:, positions // block_size] * block_size + positions % block_size  # [B, S]
    pages = []
    for dense in (key, value):
        page = torch.full((num_blocks, block_size, heads, dim), float("nan"))
        page.view(-1, heads, dim)[slots.flatten()] = dense.transpose(1, 2).reshape(-1, heads, dim)
        pages.append(page)
    return pages[0], pages[1], tables


# ---------------------------------------------------------------------------------------------- attention functions
def test_the_tree_mask_matters():
    """Negative control: the tree output differs from plain causal attention by far more than ATOL."""
    query, key, value = qkv()
    causal = torch.ones(NODES, PREFIX + NODES, dtype=torch.bool).tril(PREFIX).expand(2, 1, -1, -1)
    assert (reference(query, key, value, tree_keep()) - reference(query, key, value, causal)).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("heads", [1, 6], ids=["shared", "per-head"])
@pytest.mark.parametrize("q_heads,kv_heads", [(6, 2), (6, 6), (6, 1)])
def test_kvspec_gqa(kind, heads, q_heads, kv_heads):
    query, key, value = qkv(q_heads, kv_heads)
    keep = tree_keep(heads=heads)
    got, _ = gqa_attention_forward(_Attention(q_heads // kv_heads), query, key, value, form(keep, kind), scaling=0.25)
    torch.testing.assert_close(got, reference(query, key, value, keep), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("heads", [1, 6], ids=["shared", "per-head"])  # a [B, Hq, T, S] mask is folded, not refused
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "pages"])
def test_kvspec_paged(kind, heads, paged):
    query, key, value = qkv()
    keep = tree_keep(heads=heads)
    expected = reference(query, key, value, keep)
    mask = form(keep, kind)
    if not paged:
        got, _ = paged_attention_forward(_Attention(3), query, key, value, mask, scaling=0.25)
    else:
        key_pages, value_pages, tables = to_pages(key, value)
        view = PagedKV(tables, PREFIX + NODES)
        got, _ = paged_attention_forward(_Attention(3), query, key_pages, value_pages, mask, scaling=0.25,
                                         **{KWARG: view})
        oracle = reference_paged_attention(query, key_pages, value_pages, tables, PREFIX + NODES, mask, 0.25)
        torch.testing.assert_close(oracle, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_kvspec_paged_softcap_path(kind):
    """The einsum path (soft-capped logits) against Gemma-2's own eager attention with the float mask."""
    query, key, value = qkv()
    keep = tree_keep()
    key_pages, value_pages, tables = to_pages(key, value)
    got, _ = paged_attention_forward(_Attention(3), query, key_pages, value_pages, form(keep, kind), scaling=0.25,
                                     softcap=5.0, **{KWARG: PagedKV(tables, PREFIX + NODES)})
    expected, _ = softcap_eager_attention(_Attention(3), query, key, value, as_float(keep), scaling=0.25, softcap=5.0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


QUANT_SETTINGS = {"kivi4-sinks": dict(bits=4, group_size=16, residual_length=16, sink_tokens=2),
                  "int8": dict(method="int8", residual_length=4)}
QUANT_PREFIX = 40  # long enough that most of the prefix sits in codes, not in the full-precision window


def quantized_case(name: str, seed: int = 0):
    """A real quantized layer holding prefix + tree tokens: (query, QuantizedKV, window K/V, dequantized K/V)."""
    config = tiny_config("llama", hidden_size=384, num_attention_heads=6, num_key_value_heads=2)  # D = 64, G = 3
    cache = QuantizedKVCache(config, **QUANT_SETTINGS[name])
    query, key, value = qkv(dim=64, prefix=QUANT_PREFIX, seed=seed)
    cache.update(key[:, :, :QUANT_PREFIX], value[:, :, :QUANT_PREFIX], 0)
    dense_key, dense_value = cache.update(key[:, :, QUANT_PREFIX:], value[:, :, QUANT_PREFIX:], 0)  # [B, Hkv, S, D]
    layer = cache.layers[0]
    assert layer.store.length > 0  # codes are really read
    view = QuantizedKV(layer.store, layer.sink_keys, layer.sink_values, layer.workspace)
    return query, view, layer.keys, layer.values, dense_key, dense_value


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("heads", [1, 6], ids=["shared", "per-head"])
@pytest.mark.parametrize("name", sorted(QUANT_SETTINGS))
def test_kvspec_quant(kind, heads, name):
    query, view, window_key, window_value, dense_key, dense_value = quantized_case(name)
    keep = tree_keep(QUANT_PREFIX, heads)
    scaling = 64 ** -0.5
    got, _ = quantized_attention_forward(_Attention(3), query, window_key, window_value, form(keep, kind),
                                         scaling=scaling, **{KWARG: view})
    oracle = reference_quantized_attention(query, dense_key, dense_value, form(keep, kind), scaling)
    expected = reference(query, dense_key, dense_value, keep, scaling)  # transformers over the dequantized copy
    torch.testing.assert_close(oracle, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- whole models
def tree_logits(model, mask: torch.Tensor) -> torch.Tensor:
    """Prefill a left-padded prefix into a DynamicCache, then the tree with ``mask`` and explicit positions."""
    gen = torch.Generator().manual_seed(5)
    prefix_ids = torch.randint(3, 90, (2, PREFIX), generator=gen)
    tree_ids = torch.randint(3, 90, (2, NODES), generator=gen)
    padding = torch.ones(2, PREFIX, dtype=torch.long)
    padding[1, : PADS[1]] = 0
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix_ids, attention_mask=padding, position_ids=torch.arange(PREFIX)[None].expand(2, -1), cache=cache)
        return model(tree_ids, attention_mask=mask, position_ids=PREFIX + DEPTHS - 1, cache=cache).logits


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_llama_logits_under_kvspec_gqa_equal_sdpa_and_eager(kind):
    keep = tree_keep()
    sdpa = tree_logits(tiny_model("llama"), keep)
    eager = tree_logits(tiny_model("llama", attn_implementation="eager"), as_float(keep))
    torch.testing.assert_close(eager, sdpa, atol=LOGITS_ATOL, rtol=0)
    model = tiny_model("llama")
    with enable_gqa(model):
        ours = tree_logits(model, form(keep, kind))
    unregister_gqa()
    torch.testing.assert_close(ours, sdpa, atol=LOGITS_ATOL, rtol=0)
    causal = keep.clone()
    causal[..., PREFIX:] = torch.ones(NODES, NODES, dtype=torch.bool).tril()
    assert (tree_logits(model, causal) - sdpa).abs().max() > 1e-2  # the tree mask really reached every layer


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("fully_masked", [False, True])
@pytest.mark.parametrize("strategy", ["absorb", "decompress"])  # latent-space softmax, and kvspec_gqa over K/V
def test_mla_absorbed_equals_naive(kind, fully_masked, strategy):
    """Tiny DeepSeek-V3, fp32: the patched attention vs the model's own (sdpa for bool, eager for float masks)."""
    keep = tree_keep()
    if fully_masked:
        keep[0, 0, 3] = False  # node 3 of row 0 sees nothing: rule 2 of masks.py
    reference_impl = "sdpa" if kind == "bool" else "eager"
    expected = tree_logits(tiny_model("deepseek_v3", attn_implementation=reference_impl), form(keep, kind))
    model = tiny_model("deepseek_v3")
    with enable_mla_absorb(model, strategy=strategy):
        absorbed = tree_logits(model, form(keep, kind))
    torch.testing.assert_close(absorbed, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.fixture
def registered():
    register_gqa(), register_paged_attention(), register_quantized_attention()
    yield
    unregister_gqa(), unregister_paged_attention(), unregister_quantized_attention()


@pytest.mark.parametrize("impl", [GQA, PAGED, QUANT, "mla"])
def test_missing_mask_on_an_empty_static_cache_is_sdpa(registered, impl):
    """Rule 1 of masks.py: transformers drops the mask of a prefill into an empty StaticCache, whose slots past
    T are unused; every function of ours must then read keys 0..t only, as sdpa does (a bottom-right default
    would attend to the empty slots)."""
    kind = "deepseek_v3" if impl == "mla" else "llama"
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    model = tiny_model(kind)
    expected = model(ids, cache=StaticCache(config=model.config, max_cache_len=20)).logits
    if impl == "mla":
        with enable_mla_absorb(model, strategy="absorb"):
            got = model(ids, cache=StaticCache(config=model.config, max_cache_len=20)).logits
    else:
        model = tiny_model(kind, attn_implementation=impl)
        got = model(ids, cache=StaticCache(config=model.config, max_cache_len=20)).logits
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- rule 2
@pytest.mark.parametrize("kind", ["bool", "-inf", "float"])
def test_one_fully_masked_row_rule(kind):
    """A query row that sees no key: zero output for bool / -inf masks, uniform weights for a row of finfo.min,
    exactly what transformers' sdpa returns, through every attention function of ours."""
    keep = tree_keep()
    keep[0, 0, 3] = False
    mask = form(keep, kind)
    query, key, value = qkv()
    expected, _ = SDPA(_Attention(3), query, key, value, mask, scaling=0.25)  # [B, T, Hq, D]
    if kind == "float":  # finfo.min is a number: the row is uniform, in sdpa and in eager alike
        torch.testing.assert_close(expected[0, 3], value[0].mean(1).repeat_interleave(3, 0), atol=ATOL, rtol=0)
        eager, _ = eager_attention_forward(_Attention(3), query, key, value, mask, scaling=0.25)
        torch.testing.assert_close(eager, expected, atol=ATOL, rtol=0)
    else:
        assert torch.equal(expected[0, 3], torch.zeros_like(expected[0, 3]))
    key_pages, value_pages, tables = to_pages(key, value)
    view = {KWARG: PagedKV(tables, PREFIX + NODES)}
    ours = {
        "gqa": gqa_attention_forward(_Attention(3), query, key, value, mask, scaling=0.25)[0],
        "paged": paged_attention_forward(_Attention(3), query, key_pages, value_pages, mask, scaling=0.25, **view)[0],
        "paged-reference": reference_paged_attention(query, key_pages, value_pages, tables, PREFIX + NODES, mask, 0.25),
    }
    for name, got in ours.items():
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=name)
    probs = masks.masked_softmax(torch.randn(2, 6, NODES, PREFIX + NODES), mask)
    assert (probs[0, :, 3] == 0).all() if kind != "float" else torch.allclose(probs[0, :, 3], probs.new_tensor(1 / 13))

    query, view, window_key, window_value, dense_key, dense_value = quantized_case("kivi4-sinks")
    keep = tree_keep(QUANT_PREFIX)
    keep[0, 0, 3] = False
    mask = form(keep, kind)
    expected, _ = SDPA(_Attention(3), query, dense_key, dense_value, mask, scaling=0.125)
    fused, _ = quantized_attention_forward(_Attention(3), query, window_key, window_value, mask, scaling=0.125,
                                           **{KWARG: view})
    torch.testing.assert_close(fused, expected, atol=ATOL, rtol=0)
    oracle = reference_quantized_attention(query, dense_key, dense_value, mask, 0.125)
    torch.testing.assert_close(oracle, expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- the channel
def test_channel_is_read_and_a_wrong_stored_form_is_refused():
    query, key, value = qkv()
    key_pages, value_pages, tables = to_pages(key, value)
    expected = reference(query, key, value, tree_keep())
    wrong = PagedKV(tables.flip(0), PREFIX + NODES)  # the rows' tables swapped: another answer
    got, _ = paged_attention_forward(_Attention(3), query, key_pages, value_pages, tree_keep(), scaling=0.25,
                                     **{KWARG: PagedKV(tables, PREFIX + NODES)})
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    with pytest.raises(TypeError, match="kvspec_quant"):
        paged_attention_forward(_Attention(3), query, key, value, None, **{KWARG: object.__new__(QuantizedKV)})
    with pytest.raises(TypeError, match="kvspec_paged"):
        quantized_attention_forward(_Attention(3), query, key, value, None, **{KWARG: wrong})


def test_a_mask_with_a_wrong_head_count_names_the_fix():
    with pytest.raises(ValueError, match=r"\[B, Hq, T, S\]"):
        masks.fold_mask(torch.ones(1, 4, 2, 5, dtype=torch.bool), groups=3, num_kv_heads=2)
