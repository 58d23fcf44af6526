"""An fp32 linear layer for CPU decoding that reads its weight once for every row count: ``x [R, I] -> [R, O]``.

Boundary: pure functions on tensors. ``pack_fp32`` lays a weight [O, I] out for the C kernel of ``fgemm.c``
(built at first use by ``build.py``); ``fp32_linear`` multiplies fp32 activations by it; ``unpack`` is the plain
reference, and ``F.linear(x, unpack(w), bias)`` is what ``fp32_linear`` computes up to fp32 rounding
(tests/kernels/test_fp32_kernel.py compares them). Nothing here touches an ``nn.Module``; the fast forward's
``PackedLinear`` decides when to call it.

Why: a decode step (1 row) and a speculative verify forward (a few rows) are both bound by reading the weights.
torch's few-row GEMMs re-read the weight per row or per pair of rows; this kernel streams each block of 16 output
rows once and accumulates every activation row against it while it sits in cache, so 2..16 rows cost little more
than one, and one packed copy serves every row count (no separate transposed and blocked copies). Prefills (tens
to hundreds of rows) run the same kernel: it stays faster than torch's GEMM on the transposed weight there too
(scripts/benchmark.py fgemm). With ``threads`` > 1 the panels are split among OpenMP threads; every output is
computed by one thread in the same order, so results do not depend on the thread count.

Layout: ``panels`` fp32 [P, I, 16] with ``P = ceil(O / 16)``: ``panels[p, i, j] = W[16 p + j, i]``, rows past O
zero. Shapes: ``R`` activation rows, ``I`` in features, ``O`` out features, ``P`` panels.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from hf_kvspec.kernels.build import KernelBuildError, shared_library

__all__ = ["Fp32Weight", "KernelBuildError", "available", "fp32_linear", "pack_fp32", "reference_linear",
           "unpack"]

PANEL = 16  # output rows per panel (the kernel's tile width: two 8-float vectors)


@dataclass(frozen=True, eq=False)
class Fp32Weight:
    """A weight [O, I] packed for ``fp32_linear``: ``panels`` [ceil(O / 16), I, 16] (see the module docstring)."""

    shape: tuple[int, int]
    panels: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copy (what a call reads)."""
        return self.panels.numel() * self.panels.element_size()


def pack_fp32(weight: torch.Tensor) -> Fp32Weight:
    """``weight`` [O, I] (any float dtype, CPU) -> its fp32 panels; a fresh tensor, never a view of ``weight``."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = f"{type(weight).__name__} {getattr(weight, 'dtype', '')} {tuple(getattr(weight, 'shape', ()))}"
        raise ValueError(f"weight must be a 2-D floating tensor [out_features, in_features]; got {got}.")
    if weight.device.type != "cpu":
        raise ValueError(f"weight is on {weight.device}; this kernel is for CPU: pass weight.cpu().")
    out_features, in_features = weight.shape
    with torch.no_grad(), torch.inference_mode(False):
        padded = weight.detach().float()
        missing = -out_features % PANEL
        if missing:
            padded = torch.cat([padded, padded.new_zeros(missing, in_features)])
        panels = padded.reshape(padded.shape[0] // PANEL, PANEL, in_features).transpose(1, 2).contiguous()
    return Fp32Weight((out_features, in_features), panels)


def unpack(weight: Fp32Weight) -> torch.Tensor:
    """The plain reference: the weight [O, I] that ``fp32_linear`` multiplies by."""
    out_features, in_features = weight.shape
    panels = weight.panels  # [P, I, 16]
    return panels.transpose(1, 2).reshape(panels.shape[0] * PANEL, in_features)[:out_features]


def reference_linear(x: torch.Tensor, weight: Fp32Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the unpacked weight: what ``fp32_linear`` computes, in torch's summation order."""
    return torch.nn.functional.linear(x, unpack(weight), bias)


# --- the kernel ----------------------------------------------------------------------------------------------------

@functools.cache
def _kernels() -> ctypes.CDLL:
    from hf_kvspec.models import cache_dir

    return _declare(shared_library("fgemm", cache_dir()))


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument types of ``fgemm.c``'s entry point on ``library`` (pointers and int64 sizes)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.fk_gemm.argtypes = [pointer, size, size, pointer, pointer, size, pointer, ctypes.c_int]
    library.fk_gemm.restype = library.fk_openmp.restype = ctypes.c_int
    return library


def available() -> bool:
    """True when the C kernel is built (or can be built now) and loads on this machine."""
    try:
        _kernels()
    except KernelBuildError:
        return False
    return True


def _check_call(x: torch.Tensor, weight: Fp32Weight, bias: torch.Tensor | None) -> None:
    """Raise a ValueError naming the fix unless the call is well-formed (one combined test first: it runs per call)."""
    if not isinstance(weight, Fp32Weight):
        raise ValueError(f"weight must be an Fp32Weight from pack_fp32; got {type(weight).__name__}.")
    out_features, in_features = weight.shape
    if (type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu and x.dim() == 2
            and x.shape[1] == in_features and x.is_contiguous()
            and (bias is None or (type(bias) is torch.Tensor and bias.dtype is torch.float32 and bias.is_cpu
                                  and bias.shape == (out_features,) and bias.is_contiguous()))):
        return
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        got = f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}"
        raise ValueError(f"x must be an fp32 CPU tensor [rows, {in_features}] (flatten leading dims with "
                         f"x.reshape(-1, {in_features}), cast with .float()); got {got}.")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight takes {in_features}.")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous: pass x.contiguous().")
    got = f"{type(bias).__name__} {getattr(bias, 'dtype', '')} {tuple(getattr(bias, 'shape', ()))}"
    raise ValueError(f"bias must be a contiguous fp32 CPU tensor [{out_features}]; got {got} (pass "
                     f"bias.float().contiguous()).")


def fp32_linear(x: torch.Tensor, weight: Fp32Weight, bias: torch.Tensor | None = None,
                threads: int | None = None) -> torch.Tensor:
    """``x`` [R, I] fp32 contiguous -> [R, O] fp32 = ``F.linear(x, unpack(weight), bias)`` up to fp32 rounding.

    ``threads``: OpenMP threads for the call (default ``torch.get_num_threads()``); the result is the same for any
    count. No autograd (the output does not require grad). Raises ``KernelBuildError`` when the kernel cannot be
    built.
    """
    _check_call(x, weight, bias)
    return _launch(_kernels(), x, weight, bias, torch.get_num_threads() if threads is None else threads)


def _launch(library: ctypes.CDLL, x: torch.Tensor, weight: Fp32Weight, bias: torch.Tensor | None,
            threads: int = 1) -> torch.Tensor:
    """Run ``library``'s kernel on checked arguments: x [R, I] -> [R, O]."""
    rows, (out_features, in_features) = x.shape[0], weight.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0 or out_features == 0:
        return out
    bias_ptr = None if bias is None else bias.data_ptr()
    library.fk_gemm(x.data_ptr(), rows, in_features, weight.panels.data_ptr(), bias_ptr, out_features,
                    out.data_ptr(), threads)
    return out
