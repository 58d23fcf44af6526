"""Reference quantize / dequantize / bit-packing functions for KV caches: KIVI int2/int4, int8, fp8.

Boundary: pure tensor functions with no cache bookkeeping (windows, flushes, crops live in ``quantized.py``).
Every function here is a plain, readable reference; tests check round trips and error bounds against them.

Layouts follow KIVI (Liu et al., arXiv:2402.02750):
    keys    per channel: a group is ``G`` consecutive *tokens* of one channel (outlier channels get their
            own scale); codes ``[B, H, N, G·b/8, D]`` packed along the token axis, scale/zero ``[B, H, N, 1, D]``.
    values  per token: a group is ``G`` consecutive *channels* of one token; codes ``[B, H, S, D·b/8]``,
            scale/zero ``[B, H, S, D/G]``.
    int8    per token, symmetric (scale only): codes int8 ``[B, H, S, D]``, scale ``[B, H, S, 1]``.
    fp8     e4m3 codes ``[B, H, S, D]`` with one fp16 scale per token ``[B, H, S, 1]`` (as int8).
Asymmetric groups store an fp16 scale and an fp16 zero (the group minimum): ``x ≈ code · scale + zero``.

Shape legend: ``B`` batch, ``H`` kv heads, ``S`` tokens, ``D`` head dim, ``G`` group size, ``N = S / G`` groups,
``b`` code bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127


@dataclass
class GroupCodes:
    """Asymmetric group-quantized tensor: ``x ≈ unpack(codes) · scale + zero`` (scale/zero broadcast)."""

    codes: torch.Tensor  # uint8, bit-packed
    scale: torch.Tensor  # fp16
    zero: torch.Tensor  # fp16 (the group minimum, rounded down)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


# ---------------------------------------------------------------------------------------------------- bit packing
def codes_per_byte(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits} cannot be packed into bytes; use 2, 4 or 8.")
    return 8 // bits


def pack_codes(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (uint8, values < 2**bits) along ``dim``: ``n`` codes -> ``n·bits/8`` bytes.

    Planar layout: with ``per = 8 / bits`` codes per byte and ``m = n / per``, byte ``j`` holds codes
    ``j, j + m, j + 2m, ...`` at bit offsets ``0, bits, 2·bits, ...``. Unpacking is then ``per`` shift-and-mask
    passes that each write one contiguous slice (no interleaving), faster than interleaved nibbles
    (figures in ``docs/quantized.md``).
    """
    per = codes_per_byte(bits)
    if per == 1:
        return codes.to(torch.uint8)
    if codes.shape[dim] % per:
        raise ValueError(f"cannot pack {codes.shape[dim]} codes of {bits} bits: need a multiple of {per}.")
    slices = codes.to(torch.uint8).chunk(per, dim)
    packed = slices[0].clone()
    for k in range(1, per):
        packed |= slices[k] << (k * bits)
    return packed


def _code_slices(packed: torch.Tensor, bits: int):
    """The ``8 / bits`` planar code slices of ``packed`` (uint8), lowest bits first."""
    mask = (1 << bits) - 1
    per = codes_per_byte(bits)
    for k in range(per):
        shifted = packed >> (k * bits) if k else packed
        yield shifted if k == per - 1 else shifted & mask  # the top slice needs no mask


def unpack_codes(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of ``pack_codes``: ``m`` bytes along ``dim`` -> ``m·8/bits`` uint8 codes."""
    if codes_per_byte(bits) == 1:
        return packed
    return torch.cat(list(_code_slices(packed, bits)), dim)


def unpack_codes_into(out: torch.Tensor, packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``unpack_codes`` written straight into ``out`` (any float dtype; the uint8 -> float cast is fused into
    the copy), skipping the uint8 intermediate and the concatenation."""
    for part, codes in zip(out.chunk(codes_per_byte(bits), dim), _code_slices(packed, bits)):
        part.copy_(codes)
    return out


# ---------------------------------------------------------------------------------------------------- asymmetric
def _round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp16 value <= x (so the stored zero never exceeds the group minimum)."""
    y = x.half()
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -torch.inf)), y)


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp16 value >= x (so the stored scale covers the group range)."""
    y = x.half()
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, torch.inf)), y)


def quantize_asymmetric(x: torch.Tensor, bits: int, dim: int) -> GroupCodes:
    """Min/scale quantization of groups that run along ``dim`` (the whole extent of ``dim`` is one group).

    Codes are not packed here. Scale and zero are rounded to fp16 *outward* before computing codes, so that
    dequantizing with the stored fp16 values is within ``scale / 2`` of ``x`` for every element.
    """
    levels = (1 << bits) - 1
    xf = x.float()
    zero = _round_down_fp16(xf.amin(dim=dim, keepdim=True))
    scale = _round_up_fp16((xf.amax(dim=dim, keepdim=True) - zero.float()) / levels)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()  # constant group: every code is 0
    codes = ((xf - zero.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return GroupCodes(codes, scale, zero)


def dequantize_asymmetric(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """``codes · scale + zero`` in ``dtype`` (unpacked uint8 codes; scale/zero broadcast)."""
    return torch.addcmul(zero.to(dtype), codes.to(dtype), scale.to(dtype))


# ---------------------------------------------------------------------------------------------------- KIVI keys/values
def quantize_keys(keys: torch.Tensor, bits: int, group_size: int) -> GroupCodes:
    """KIVI keys, per channel. keys ``[B, H, N·G, D]`` -> codes ``[B, H, N, G·b/8, D]``, scale/zero ``[B, H, N, 1, D]``."""
    grouped = keys.unflatten(2, (keys.shape[2] // group_size, group_size))  # [B, H, N, G, D]
    q = quantize_asymmetric(grouped, bits, dim=3)
    return GroupCodes(pack_codes(q.codes, bits, dim=3), q.scale, q.zero)


def dequantize_keys(q: GroupCodes, bits: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``quantize_keys`` -> ``[B, H, N·G, D]``, written into ``out`` (a view of that shape) if given."""
    batch, heads, groups, packed_len, dim = q.codes.shape
    group = packed_len * 8 // bits
    if out is None:
        out = torch.empty(batch, heads, groups * group, dim, dtype=dtype, device=q.codes.device)
    grouped = out.unflatten(2, (groups, group))  # [B, H, N, G, D]
    unpack_codes_into(grouped, q.codes, bits, dim=3)
    grouped.mul_(q.scale).add_(q.zero)
    return out


def quantize_values(values: torch.Tensor, bits: int, group_size: int) -> GroupCodes:
    """KIVI values, per token. values ``[B, H, S, D]`` -> codes ``[B, H, S, D·b/8]``, scale/zero ``[B, H, S, D/G]``."""
    head_dim = values.shape[-1]
    if head_dim % group_size:
        raise ValueError(f"value groups run along head_dim={head_dim}; group_size={group_size} must divide it.")
    grouped = values.unflatten(3, (head_dim // group_size, group_size))  # [B, H, S, D/G, G]
    q = quantize_asymmetric(grouped, bits, dim=4)
    return GroupCodes(pack_codes(q.codes.flatten(3, 4), bits), q.scale.squeeze(4), q.zero.squeeze(4))


def dequantize_values(q: GroupCodes, bits: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``quantize_values`` -> ``[B, H, S, D]``, written into ``out`` (a view of that shape) if given."""
    batch, heads, tokens, packed_len = q.codes.shape
    if out is None:
        out = torch.empty(batch, heads, tokens, packed_len * 8 // bits, dtype=dtype, device=q.codes.device)
    unpack_codes_into(out, q.codes, bits, dim=3)
    grouped = out.unflatten(3, (q.scale.shape[-1], -1))  # [B, H, S, D/G, G]
    grouped.mul_(q.scale.unsqueeze(4)).add_(q.zero.unsqueeze(4))
    return out


# ---------------------------------------------------------------------------------------------------- int8 / fp8
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8. x ``[B, H, S, D]`` -> (codes int8 ``[B, H, S, D]``, fp16 scale ``[B, H, S, 1]``)."""
    xf = x.float()
    scale = _round_up_fp16(xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = (xf / safe).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype) * scale.to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3. x ``[B, H, S, D]`` -> (codes ``[B, H, S, D]``, fp16 scale ``[B, H, S, 1]``). The scale maps
    the token's largest magnitude onto e4m3's largest value (rounded up to fp16, so nothing saturates), so a
    token's codes depend on that token alone, never on the other tokens of its update."""
    xf = x.float()
    scale = _round_up_fp16(xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return (xf / safe).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale  # clamp: a plain cast overflows to NaN


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)


_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()  # byte -> its e4m3 value


def fp8_codes_into(out: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The unscaled e4m3 values of ``codes`` written into ``out`` through a 256-entry table: on CPU, torch's
    fp8 -> float cast is element by element, slower than an int32 gather (figures in ``docs/quantized.md``); the
    values are identical."""
    table = _FP8_TABLE.to(device=out.device, dtype=out.dtype)
    index = codes.view(torch.uint8).reshape(-1).int()
    return out.copy_(table.index_select(0, index).view(codes.shape))


def dequantize_fp8_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dequantize_fp8`` written into ``out`` (table decode, then the per-token scale)."""
    return fp8_codes_into(out, codes).mul_(scale)
