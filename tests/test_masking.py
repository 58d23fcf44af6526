"""``hf_kvspec.masking``: bool -> additive conversion and key padding, against the inline forms it replaced.

References: the conversions the mask builders used to write out themselves (``torch.where`` with a zero scalar,
and ``zeros.masked_fill(~keep, finfo.min)``) and the additive key padding of the tree and partial-forward paths,
re-typed here from their old text. Equality is exact: the same numbers are written either way.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.attention.masks import masked_softmax
from hf_kvspec.masking import additive_mask, pad_keys

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _old_where(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the streaming view's and attention/masks.py's old form
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def _old_masked_fill(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the EAGLE head, EAGLE drafter, tree and partial-forward old form
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _old_pad(mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    # the two old copies of _pad_keys (additive masks only)
    extra = kv_length - mask.shape[-1]
    if extra <= 0:
        return mask
    return torch.nn.functional.pad(mask, (0, extra), value=torch.finfo(mask.dtype).min)


def _random_keep(seed: int, shape=(3, 1, 5, 11)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=generator) < 0.6
    keep[0, 0, 1] = False  # one fully masked row
    keep[1, 0, 2] = True  # one fully visible row
    return keep


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_values_dtype_and_shape(dtype):
    keep = torch.tensor([[True, False, True], [False, False, False]])
    mask = additive_mask(keep, dtype)
    assert mask.dtype == dtype and mask.shape == keep.shape
    lowest = torch.finfo(dtype).min
    assert mask.tolist() == [[0.0, lowest, 0.0], [lowest, lowest, lowest]]
    assert torch.isfinite(mask).all()  # finfo.min, never -inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_additive_equals_the_old_inline_conversions(dtype, seed):
    keep = _random_keep(seed)
    assert torch.equal(additive_mask(keep, dtype), _old_where(keep, dtype))
    assert torch.equal(additive_mask(keep, dtype), _old_masked_fill(keep, dtype))
    expanded = keep[:, :, :1].expand(-1, 2, 4, -1)  # a broadcast view, as the builders pass
    assert torch.equal(additive_mask(expanded, dtype), _old_masked_fill(expanded.contiguous(), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fully_masked_row_softmaxes_as_before(dtype):
    # a row of finfo.min adds one constant to every score: uniform weights, in eager's softmax, in SDPA and in
    # masked_softmax (rule 2); rows that see something are untouched by it
    keep = _random_keep(7)
    scores = torch.randn(keep.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    new, old = additive_mask(keep, dtype), _old_masked_fill(keep, dtype)
    weights = torch.softmax(scores + new, dim=-1)
    assert torch.equal(weights, torch.softmax(scores + old, dim=-1))
    assert torch.equal(masked_softmax(scores, new), masked_softmax(scores, old))
    uniform = torch.full((keep.shape[-1],), 1 / keep.shape[-1], dtype=dtype)
    torch.testing.assert_close(weights[0, 0, 1], uniform, atol=0, rtol=1e-12 if dtype == torch.float64 else 1e-6)
    query, key, value = (torch.randn(1, 1, 2, 4, dtype=dtype) for _ in range(3))
    none_seen = additive_mask(torch.zeros(1, 1, 2, 2, dtype=torch.bool), dtype)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=none_seen)
    torch.testing.assert_close(out, value.mean(dim=2, keepdim=True).expand_as(out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pad_keys_masks_the_added_columns(dtype):
    keep = _random_keep(3)
    padded = pad_keys(keep, 15)
    assert padded.dtype == torch.bool and padded.shape == (3, 1, 5, 15)
    assert torch.equal(padded[..., :11], keep) and not padded[..., 11:].any()
    additive = pad_keys(additive_mask(keep, dtype), 15)
    assert torch.equal(additive, _old_pad(additive_mask(keep, dtype), 15))
    assert (additive[..., 11:] == torch.finfo(dtype).min).all()
    # padding then converting (the partial forward) equals converting then padding (the old order)
    assert torch.equal(additive_mask(padded, dtype), additive)


def test_pad_keys_leaves_a_long_enough_mask_alone():
    keep = _random_keep(5)
    assert pad_keys(keep, 11) is keep and pad_keys(keep, 4) is keep


def test_builders_return_bool_and_convert_through_the_owner():
    from hf_kvspec.heads.modeling_eagle import unrolled_step_mask
    from hf_kvspec.speculative.drafters.eagle import _catch_up_mask
    from hf_kvspec.speculative.partial_forward import causal_key_mask

    key_mask = torch.tensor([[0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]])
    built = causal_key_mask(key_mask, 2)
    assert built.dtype == torch.bool and built.shape == (2, 1, 2, 6)
    assert built[0, 0].tolist() == [[False, True, True, True, False, False], [False, True, True, True, False, True]]
    assert built[1, 0].tolist() == [[True] * 5 + [False], [True] * 6]
    assert unrolled_step_mask(key_mask.bool(), 2).dtype == torch.bool
    catch_up = _catch_up_mask(key_mask, 3)  # [B, 1, 3, 6]; a hole query (column 4) sees itself
    assert catch_up.dtype == torch.bool and catch_up[0, 0, 1].tolist() == [False, True, True, True, True, False]
