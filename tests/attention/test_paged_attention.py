"""Paged attention vs the gather-then-attend reference, and its registration with transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_kvspec.attention.paged import (
    ATTN_NAME,
    paged_attention_forward,
    paged_attention_mask,
    reference_paged_attention,
    register_paged_attention,
    unregister_paged_attention,
)
from hf_kvspec.stored_kv import KWARG, PagedKV

# fp32 SDPA vs einsum-softmax on D=16: reassociation error is ~1e-7 per element; 1e-5 leaves margin
TOL = dict(rtol=1e-5, atol=1e-5)


class _Module(torch.nn.Module):  # what the attention function reads from the calling layer
    pass


def paged_case(groups: int, seed: int, block_size: int = 4, batch: int = 3, q_len: int = 3, kv_len: int = 10):
    """Random pages under a random block permutation; every slot no row owns holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim = 2, 16
    blocks_per_row = -(-kv_len // block_size)
    num_blocks = batch * blocks_per_row + 3
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_row].view(batch, blocks_per_row)
    key_pages = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    value_pages = torch.full_like(key_pages, float("nan"))
    positions = torch.arange(kv_len)
    slots = tables[:, positions // block_size] * block_size + positions % block_size  # [B, S] written slots
    key_pages.view(-1, kv_heads, dim)[slots.flatten()] = torch.randn(batch * kv_len, kv_heads, dim, generator=gen)
    value_pages.view(-1, kv_heads, dim)[slots.flatten()] = torch.randn(batch * kv_len, kv_heads, dim, generator=gen)
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=gen)
    padding = torch.ones(batch, kv_len, dtype=torch.bool)
    padding[0, :2] = False  # row 0 is left padded
    mask = sdpa_mask(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len,
                     attention_mask=padding, allow_is_causal_skip=False)
    return query, key_pages, value_pages, tables, kv_len, mask


@pytest.mark.parametrize("groups", [1, 3, 4])  # MHA and GQA ratios 3 and 4
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fast_path_matches_reference_under_block_permutations(groups, seed, softcap):
    query, key_pages, value_pages, tables, kv_len, mask = paged_case(groups, seed)
    expected = reference_paged_attention(query, key_pages, value_pages, tables, kv_len, mask, 0.25, softcap)
    got, weights = paged_attention_forward(
        _Module(), query, key_pages, value_pages, mask, scaling=0.25, softcap=softcap, **{KWARG: PagedKV(tables, kv_len)}
    )
    assert weights is None and got.shape == (3, 3, 2 * groups, 16)  # [B, T, Hq, D]
    assert not got.isnan().any()  # the NaN-filled unused slots were never read
    torch.testing.assert_close(got, expected, **TOL)


def test_reference_matches_plain_attention_on_contiguous_kv():
    """Anchor the oracle itself to torch SDPA with repeat_kv on contiguous K/V (block size = S, identity table)."""
    query, key_pages, value_pages, tables, kv_len, mask = paged_case(3, 0, block_size=10, kv_len=10)
    key = key_pages[tables[:, 0]].transpose(1, 2)  # [B, Hkv, S, D]
    value = value_pages[tables[:, 0]].transpose(1, 2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    got = reference_paged_attention(query, key_pages, value_pages, tables, kv_len, mask, 0.25)
    torch.testing.assert_close(got, expected, **TOL)


def test_without_paged_kv_it_is_grouped_attention_with_causal_default():
    query, key_pages, value_pages, tables, kv_len, _ = paged_case(4, 2, block_size=10, kv_len=10)
    key, value = key_pages[tables[:, 0]].transpose(1, 2), value_pages[tables[:, 0]].transpose(1, 2)
    # transformers passes no mask with T < S only for a StaticCache prefill, whose later keys are unused slots:
    # the causal default is therefore SDPA's is_causal (query t sees keys 0..t), not bottom-right alignment
    causal = torch.ones(3, 10, dtype=torch.bool).tril(0).expand(3, 1, 3, 10)
    got, _ = paged_attention_forward(_Module(), query, key, value, None, scaling=0.25)
    expected = reference_paged_attention(query, key_pages, value_pages, tables, kv_len, causal, 0.25)
    torch.testing.assert_close(got, expected, **TOL)


def test_registration_is_idempotent_and_reversible():
    assert ATTN_NAME not in AttentionInterface._global_mapping
    register_paged_attention()
    register_paged_attention()
    try:
        assert AttentionInterface._global_mapping[ATTN_NAME] is paged_attention_forward
        assert AttentionMaskInterface._global_mapping[ATTN_NAME] is paged_attention_mask
    finally:
        unregister_paged_attention()
    assert ATTN_NAME not in AttentionInterface._global_mapping
    assert ATTN_NAME not in AttentionMaskInterface._global_mapping
    unregister_paged_attention()  # a second undo is a no-op


def test_hf_kvspec_register_installs_paged_attention():
    import hf_kvspec

    hf_kvspec.register()
    try:
        assert AttentionInterface._global_mapping.get(ATTN_NAME) is paged_attention_forward
    finally:
        hf_kvspec.unregister()
    assert ATTN_NAME not in AttentionInterface._global_mapping


def test_mask_keeps_padding_and_may_skip_only_pure_causality():
    padded = paged_attention_mask(batch_size=1, q_length=1, kv_length=4, q_offset=3,
                                  attention_mask=torch.tensor([[False, True, True, True]]))
    assert padded is not None and padded[0, 0, 0].tolist() == [False, True, True, True]
    assert paged_attention_mask(batch_size=1, q_length=1, kv_length=4, q_offset=3) is None  # decode, no padding


@pytest.mark.parametrize("groups", [1, 3])
def test_single_query_without_mask_sees_every_key(groups):
    query, key_pages, value_pages, tables, kv_len, _ = paged_case(groups, 3, q_len=1)
    everything = torch.ones(3, 1, 1, kv_len, dtype=torch.bool)
    got, _ = paged_attention_forward(_Module(), query, key_pages, value_pages, None, scaling=0.25,
                                     **{KWARG: PagedKV(tables, kv_len)})
    expected = reference_paged_attention(query, key_pages, value_pages, tables, kv_len, everything, 0.25)
    torch.testing.assert_close(got, expected, **TOL)
