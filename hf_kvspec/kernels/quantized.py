"""Weight-only quantized linear layers for CPU decoding: int8 per output row, int4 per group of inputs.

Boundary: pure functions on tensors. ``quantize_int8`` / ``quantize_int4`` pack an fp32 weight into a
``QuantizedWeight``; ``qlinear`` multiplies fp32 activations by it with the C kernel of ``qgemv.c`` (built at first
use by ``build.py``); ``dequantize`` is the plain reference, and ``F.linear(x, dequantize(q), bias)`` is what
``qlinear`` computes up to fp32 rounding (tests/kernels/test_quantized.py compares them). Nothing here touches an
``nn.Module``; swapping layers of a model is the caller's business.

Why: a decode step on CPU is bound by reading weights. Keeping them in 8 or 4 bits and widening them to fp32 in
registers reads about 1/4 (int8) or 1/6 (int4, group 32, with its scales) of the fp32 bytes per call;
activations, accumulation and outputs stay fp32 (weight-only), so the only error is the weights' rounding, which
``dequantize`` shows exactly.

Formats (``q`` the stored code):
    int8   W[o, i] = q[o, i] * scale[o]                      q in -127..127, scale = max|W[o]| / 127 (fp32)
    int4   W[o, i] = q[o, i] * scale[o, g] + offset[o, g]    q in 0..15, g = i // group_size, fp16 scale/offset
           asymmetric (default, group 32): offset <= min of the group, scale covers its range in 15 steps;
           symmetric: offset = -8 * scale, scale = max|group| / 7.5.
Rounding: every weight lies within scale / 2 of its dequantized value (fp16 scales are rounded up and fp16
offsets down so that the 16 levels still cover the group).

Shapes: ``R`` activation rows, ``I`` in features, ``O`` out features, ``G = I // group_size`` groups per row.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from hf_kvspec.kernels.build import KernelBuildError, shared_library

__all__ = ["KernelBuildError", "QuantizedWeight", "available", "dequantize", "qlinear", "quantize_int4",
           "quantize_int8"]

ROW_BLOCK = 4  # output rows interleaved per block (the kernel's tile height)
INT4_BLOCK = 32  # inputs per packed 16-byte block of int4 codes (the kernel's unit); group sizes are multiples
FP16_MAX = 65504.0


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight [O, I] in 8 or 4 bits, packed for ``qlinear``.

    Output rows are interleaved 4 at a time (``Ob = ceil(O / 4)``; padding rows have zero codes and scales) so
    that the kernel reads one sequential stream. ``codes``: int8 [Ob, ceil(I / 8), 4, 8] (inputs zero-padded),
    or uint8 [Ob, I / 32, 4, 16] for bits 4 (per 32 inputs, byte j holds input j in its low nibble and input
    j + 16 in its high one). ``scales``: fp32 [4 Ob] (bits 8) or fp16 [Ob, G, 4]; ``offsets``: fp16 [Ob, G, 4]
    for bits 4, else None. ``group_size``: inputs per scale (``I`` for int8). ``dequantize`` undoes all of it.
    """

    bits: int
    shape: tuple[int, int]
    group_size: int
    symmetric: bool
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """The kernel trusts these shapes blindly (it reads raw pointers), so they are checked once, here."""
        expected = _layout(self.bits, self.shape, self.group_size)
        tensors = {"codes": self.codes, "scales": self.scales, "offsets": self.offsets}
        got = {name: None if t is None else (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        if got != expected or not all(t is None or (t.is_contiguous() and t.is_cpu) for t in tensors.values()):
            raise ValueError(f"QuantizedWeight tensors do not match a {self.bits}-bit {self.shape} weight "
                             f"(group {self.group_size}): expected contiguous CPU {expected}, got {got}. Build it "
                             f"with quantize_int8 / quantize_int4.")

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors (what a call reads)."""
        tensors = (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def format(self) -> str:
        """``"int8"``, ``"int4-g64"`` or ``"int4-g32-sym"``: a label for reports."""
        if self.bits == 8:
            return "int8"
        return f"int4-g{self.group_size}" + ("-sym" if self.symmetric else "")


def _layout(bits: int, shape: tuple[int, int], group_size: int) -> dict:
    """name -> (shape, dtype) of the packed tensors of a ``bits``-bit weight of ``shape`` (see QuantizedWeight)."""
    out_features, in_features = shape
    blocks = -(-out_features // ROW_BLOCK)
    if bits == 8:
        chunks = -(-in_features // 8)
        return {"codes": ((blocks, chunks, ROW_BLOCK, 8), torch.int8), "scales": ((blocks * ROW_BLOCK,), torch.float32),
                "offsets": None}
    if bits != 4 or group_size <= 0 or group_size % INT4_BLOCK or in_features % group_size:
        return {"bits": bits, "group_size": group_size}  # matches nothing: refused
    groups = ((blocks, in_features // group_size, ROW_BLOCK), torch.float16)
    return {"codes": ((blocks, in_features // INT4_BLOCK, ROW_BLOCK, INT4_BLOCK // 2), torch.uint8),
            "scales": groups, "offsets": groups}


# --- quantize / dequantize (the reference) ---------------------------------------------------------------------

def _checked_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [O, I] as detached fp32 on CPU, or a ValueError naming what is wrong."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = f"{type(weight).__name__} {getattr(weight, 'dtype', '')} {tuple(getattr(weight, 'shape', ()))}"
        raise ValueError(f"weight must be a 2-D floating tensor [out_features, in_features]; got {got}.")
    if weight.device.type != "cpu":
        raise ValueError(f"weight is on {weight.device}; these kernels are for CPU: pass weight.cpu().")
    weight = weight.detach().float()
    if not torch.isfinite(weight).all():
        raise ValueError("weight has inf or nan entries; they cannot be quantized.")
    return weight


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one fp32 scale per output row: ``weight`` [O, I] -> codes int8 [O, I], scales [O]."""
    weight = _checked_weight(weight)
    scales = weight.abs().amax(dim=1) / 127  # [O]; an all-zero row keeps scale 0 and codes 0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(weight / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, tuple(weight.shape), weight.shape[1], True, _interleave(codes, 8),
                           _pad_rows(scales).contiguous())


def _pad_rows(tensor: torch.Tensor) -> torch.Tensor:
    """[O, ...] -> [4 Ob, ...] with zero rows appended."""
    missing = -tensor.shape[0] % ROW_BLOCK
    return torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])]) if missing else tensor


def _interleave(codes: torch.Tensor, chunk: int) -> torch.Tensor:
    """codes [O, C] -> [Ob, ceil(C / chunk), 4, chunk]: rows and columns zero-padded, 4 rows per block."""
    codes = _pad_rows(codes)
    codes = torch.cat([codes, codes.new_zeros(codes.shape[0], -codes.shape[1] % chunk)], dim=1)
    return codes.reshape(-1, ROW_BLOCK, codes.shape[1] // chunk, chunk).transpose(1, 2).contiguous()


def _deinterleave(codes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of ``_interleave``: [Ob, C', 4, chunk] -> [O, C] for ``shape`` (O, C)."""
    rows = codes.transpose(1, 2).reshape(codes.shape[0] * ROW_BLOCK, -1)
    return rows[: shape[0], : shape[1]]


def _fp16_toward(values: torch.Tensor, direction: float) -> torch.Tensor:
    """``values`` (fp32) rounded to fp16 toward +inf (``direction`` inf) or -inf."""
    half = values.half()
    past = half.float() < values if direction > 0 else half.float() > values
    return torch.where(past, torch.nextafter(half, torch.full_like(half, direction)), half)


def _int4_params(groups: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups`` [O, G, group] -> fp16 scales and offsets [O, G] whose 16 levels cover each group."""
    if symmetric:
        scales = _fp16_toward(groups.abs().amax(dim=-1) / 7.5, float("inf"))
        return scales, scales * -8  # exact in fp16: a power-of-two multiple
    offsets = _fp16_toward(groups.amin(dim=-1), float("-inf"))
    scales = _fp16_toward((groups.amax(dim=-1) - offsets.float()) / 15, float("inf"))
    return scales, offsets


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [O, I] in 0..15 -> [Ob, I/32, 4, 16]: per 32 inputs, input j low nibble, j + 16 high."""
    blocks = codes.reshape(codes.shape[0], -1, 2, INT4_BLOCK // 2)  # [O, I/32, 2, 16]
    return _interleave((blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1), INT4_BLOCK // 2)


def _unpack_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[Ob, I/32, 4, 16] -> codes uint8 [O, I] (the inverse of ``_pack_int4``)."""
    rows = _deinterleave(packed, (shape[0], shape[1] // 2))
    blocks = rows.reshape(shape[0], -1, INT4_BLOCK // 2)  # [O, I/32, 16]
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(shape)


def _interleave_groups(params: torch.Tensor) -> torch.Tensor:
    """fp16 [O, G] -> [Ob, G, 4] (zero rows appended)."""
    padded = _pad_rows(params)
    return padded.reshape(-1, ROW_BLOCK, padded.shape[1]).transpose(1, 2).contiguous()


def _deinterleave_groups(params: torch.Tensor, rows: int) -> torch.Tensor:
    """[Ob, G, 4] -> [O, G]."""
    return params.transpose(1, 2).reshape(-1, params.shape[1])[:rows]


def quantize_int4(weight: torch.Tensor, group_size: int = 32, symmetric: bool = False) -> QuantizedWeight:
    """int4 codes with an fp16 scale and offset per ``group_size`` inputs of each output row.

    ``group_size`` must be a multiple of 32 that divides ``I`` (the kernel unpacks 32 inputs at a time). The
    default, 32 asymmetric, measured the most accurate on the bundled model (docs/quantized_weights.md); 64 reads
    11% fewer bytes.
    """
    weight = _checked_weight(weight)
    out_features, in_features = weight.shape
    if group_size <= 0 or group_size % INT4_BLOCK or in_features % group_size:
        raise ValueError(f"int4 needs group_size a positive multiple of {INT4_BLOCK} that divides in_features; got "
                         f"group_size={group_size}, in_features={in_features}. Pick another group_size (32, 64, "
                         f"128) or use quantize_int8, which takes any in_features.")
    if weight.abs().max() > FP16_MAX / 16:
        raise ValueError(f"weight magnitudes up to {float(weight.abs().max()):.3g} overflow int4's fp16 scales "
                         f"(limit {FP16_MAX / 16:g}); use quantize_int8.")
    groups = weight.reshape(out_features, -1, group_size)  # [O, G, group]
    scales, offsets = _int4_params(groups, symmetric)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).float()
    codes = torch.round((groups - offsets.float()[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(4, (out_features, in_features), group_size, symmetric,
                           _pack_int4(codes.reshape(out_features, in_features)), _interleave_groups(scales),
                           _interleave_groups(offsets))


def dequantize(qweight: QuantizedWeight) -> torch.Tensor:
    """The plain reference: the fp32 weight [O, I] that ``qlinear`` multiplies by."""
    out_features, in_features = qweight.shape
    if qweight.bits == 8:
        return _deinterleave(qweight.codes, qweight.shape).float() * qweight.scales[:out_features, None]
    codes = _unpack_int4(qweight.codes, qweight.shape).float().reshape(out_features, -1, qweight.group_size)
    scales = _deinterleave_groups(qweight.scales, out_features).float()  # [O, G]
    offsets = _deinterleave_groups(qweight.offsets, out_features).float()
    weight = codes * scales[..., None] + offsets[..., None]  # [O, G, group]
    return weight.reshape(out_features, in_features)


# --- the kernel ----------------------------------------------------------------------------------------------------

@functools.cache
def _kernels() -> ctypes.CDLL:
    from hf_kvspec.models import cache_dir

    return _declare(shared_library("qgemv", cache_dir()))


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument types of ``qgemv.c``'s entry points on ``library`` (pointers and int64 sizes)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.qk_int8_gemm.argtypes = [pointer, size, size, pointer, pointer, pointer, size, pointer]
    library.qk_int4_gemm.argtypes = [pointer, size, size, pointer, pointer, pointer, size, pointer, size, pointer]
    library.qk_int8_gemm.restype = library.qk_int4_gemm.restype = ctypes.c_int
    return library


def available() -> bool:
    """True when the C kernel is built (or can be built now) and loads on this machine."""
    try:
        _kernels()
    except KernelBuildError:
        return False
    return True


def _check_call(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """Raise a ValueError naming the fix unless the call is well-formed (one combined test first: it runs per call)."""
    out_features, in_features = qweight.shape
    if (type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu and x.dim() == 2
            and x.shape[1] == in_features and x.is_contiguous()
            and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu and bias.shape == (out_features,)
                                  and bias.is_contiguous()))
            and not _needs_grad(x, bias)):
        return
    if _needs_grad(x, bias):
        raise ValueError("qlinear has no backward, but x or bias requires grad with grad mode on: call it under "
                         "torch.no_grad() / torch.inference_mode(), or use F.linear(x, dequantize(qweight), bias).")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        got = f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}"
        raise ValueError(f"x must be an fp32 CPU tensor [rows, {in_features}] (flatten leading dims with "
                         f"x.reshape(-1, {in_features}), cast with .float()); got {got}.")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight takes {in_features}.")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous: pass x.contiguous().")
    raise ValueError(f"bias must be a contiguous fp32 CPU tensor [{out_features}]; got {bias.dtype} "
                     f"{tuple(bias.shape)} (pass bias.float().contiguous()).")


def _needs_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def qlinear(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [R, I] fp32 contiguous -> [R, O] fp32 = ``F.linear(x, dequantize(qweight), bias)`` up to rounding.

    No autograd: refused when ``x`` or ``bias`` requires grad with grad mode on. Raises ``KernelBuildError`` when
    the kernel cannot be built.
    """
    _check_call(x, qweight, bias)
    return _launch(_kernels(), x, qweight, bias)


def _launch(library: ctypes.CDLL, x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None
            ) -> torch.Tensor:
    """Run ``library``'s kernel on checked arguments: x [R, I] -> [R, O]."""
    rows, (out_features, in_features) = x.shape[0], qweight.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return out
    bias_ptr = None if bias is None else bias.data_ptr()
    if qweight.bits == 8:
        status = library.qk_int8_gemm(x.data_ptr(), rows, in_features, qweight.codes.data_ptr(),
                                      qweight.scales.data_ptr(), bias_ptr, out_features, out.data_ptr())
    else:
        status = library.qk_int4_gemm(x.data_ptr(), rows, in_features, qweight.codes.data_ptr(),
                                      qweight.scales.data_ptr(), qweight.offsets.data_ptr(), qweight.group_size,
                                      bias_ptr, out_features, out.data_ptr())
    if status != 0:
        raise MemoryError(f"qlinear could not allocate its {in_features * 16} B scratch")
    return out
