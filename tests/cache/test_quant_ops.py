"""quant_ops: bit packing round trips, error bounds of every quantizer, fast dequant vs the plain formula."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.cache import quant_ops as ops


def _kv(tokens=64, dim=32, seed=0):
    """[B=2, H=3, S, D] states with a few outlier channels (what per-channel key quantization is for)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, tokens, dim, generator=gen)
    x[..., 3] *= 20.0
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, 2, -1])
def test_pack_unpack_round_trip(bits, dim):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (8, 4, 16), generator=gen, dtype=torch.uint8)
    packed = ops.pack_codes(codes, bits, dim=dim)
    assert packed.dtype == torch.uint8
    assert packed.shape[dim] == codes.shape[dim] * bits // 8  # exactly b bits per code, no padding
    assert torch.equal(ops.unpack_codes(packed, bits, dim=dim), codes)
    into = ops.unpack_codes_into(torch.empty(codes.shape), packed, bits, dim=dim % 3)
    assert torch.equal(into, codes.float())


def test_pack_layout_is_planar():
    codes = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # 4-bit: byte j holds codes j and j + 2
    assert ops.pack_codes(codes, 4).tolist() == [1 | 3 << 4, 2 | 4 << 4]


def test_pack_rejects_partial_bytes_and_bad_bits():
    with pytest.raises(ValueError, match="multiple of 4"):
        ops.pack_codes(torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="use 2, 4 or 8"):
        ops.pack_codes(torch.zeros(6, dtype=torch.uint8), 3)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [16, 32])
def test_kivi_keys_error_within_half_scale(bits, group):
    keys = _kv()
    q = ops.quantize_keys(keys, bits, group)
    assert q.codes.shape == (2, 3, 64 // group, group * bits // 8, 32)
    assert q.scale.shape == q.zero.shape == (2, 3, 64 // group, 1, 32) and q.scale.dtype == torch.float16
    err = (ops.dequantize_keys(q, bits, torch.float32) - keys).abs().unflatten(2, (64 // group, group))
    # scale/zero are rounded outward to fp16 before coding, so the bound holds with the stored values;
    # 1e-6 absorbs the fp32 rounding of code·scale + zero
    assert (err <= q.scale.float() / 2 + 1e-6).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_values_error_within_half_scale(bits):
    values = _kv()
    q = ops.quantize_values(values, bits, 16)
    assert q.codes.shape == (2, 3, 64, 32 * bits // 8) and q.scale.shape == (2, 3, 64, 2)
    err = (ops.dequantize_values(q, bits, torch.float32) - values).abs().unflatten(3, (2, 16))
    assert (err <= q.scale.float().unsqueeze(-1) / 2 + 1e-6).all()


def test_per_channel_keys_isolate_the_outlier_channel():
    """KIVI's reason for per-channel keys: the 20x channel must not inflate the other channels' scales."""
    q = ops.quantize_keys(_kv(), 4, 32)
    others = torch.cat([q.scale[..., :3], q.scale[..., 4:]], dim=-1).float()
    assert q.scale[..., 3].float().min() > 5 * others.max()


def test_fast_dequant_equals_plain_formula():
    """The in-place planar path (unpack straight into float, mul_/add_) vs ``codes · scale + zero``."""
    keys, values = _kv(seed=1), _kv(seed=2)
    qk, qv = ops.quantize_keys(keys, 4, 16), ops.quantize_values(values, 2, 16)
    plain_k = ops.dequantize_asymmetric(ops.unpack_codes(qk.codes, 4, dim=3), qk.scale, qk.zero, torch.float32)
    assert torch.equal(ops.dequantize_keys(qk, 4, torch.float32), plain_k.flatten(2, 3))
    codes_v = ops.unpack_codes(qv.codes, 2).unflatten(3, (2, 16))
    plain_v = ops.dequantize_asymmetric(codes_v, qv.scale.unsqueeze(4), qv.zero.unsqueeze(4), torch.float32)
    assert torch.equal(ops.dequantize_values(qv, 2, torch.float32), plain_v.flatten(3, 4))


def test_constant_group_is_exact_and_finite():
    x = torch.full((1, 1, 16, 8), 0.5)  # exactly representable in fp16: zero = 0.5, scale = 0, no division by 0
    q = ops.quantize_keys(x, 2, 16)
    assert (q.scale == 0).all()
    assert torch.equal(ops.dequantize_keys(q, 2, torch.float32), x)


def test_value_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="must divide it"):
        ops.quantize_values(torch.randn(1, 1, 4, 24), 4, 16)


def test_int8_symmetric_error_and_zero():
    x = _kv()
    x[0, 0, 0] = 0.0
    codes, scale = ops.quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (2, 3, 64, 1)
    back = ops.dequantize_int8(codes, scale, torch.float32)
    assert (back - x).abs().le(scale.float() / 2 + 1e-6).all()
    assert (back[0, 0, 0] == 0).all()  # symmetric: zero stays zero


def test_fp8_relative_error_and_per_token_scale():
    x = _kv()
    x[0, 0, 0] = 0.0
    codes, scale = ops.quantize_fp8(x)
    assert codes.dtype == ops.FP8_DTYPE and scale.shape == (2, 3, 64, 1) and scale.dtype == torch.float16
    back = ops.dequantize_fp8(codes, scale, torch.float32)
    normal = x.abs() > scale.float() * 2.0**-6  # e4m3 normal range: 3 mantissa bits -> relative error <= 2^-4
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + 1e-7)[normal].all()
    assert codes.float().abs().amax(-1).le(ops.FP8_MAX).all() and not codes.float().isnan().any()
    assert (back[0, 0, 0] == 0).all()  # an all-zero token stays zero (no division by a zero scale)
    louder, _ = ops.quantize_fp8(torch.cat([x, x * 100], 2))  # other tokens in the same call change nothing
    assert torch.equal(louder[:, :, :64].view(torch.uint8), codes.view(torch.uint8))
