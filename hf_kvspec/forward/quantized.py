"""Quantized projections for the fast forward: the program's linear calls on weight-only int8 / int4 copies.

Boundary: a ``packed.Projection`` over ``hf_kvspec.kernels.quantized`` (the kernels, their packing and their
reference); knows nothing about which model or drafter uses it. Lossy by construction: only a drafter reads
these copies (``QuantizedSelfAssistant``), and the fp32 target verifies what it drafts, so output stays exact.

Shapes: ``R`` rows, ``I``/``O`` in/out features.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_kvspec.kernels import quantized as kernels


class QuantizedLinear:
    """``x`` [R, I] -> [R, O] through a quantized copy of ``W`` [O, I] (``bits`` 8: per-row scales; 4: groups)."""

    def __init__(self, weight: kernels.QuantizedWeight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.qlinear(x.contiguous(), self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    @classmethod
    def of(cls, *linears: nn.Linear, bits: int) -> QuantizedLinear:
        """One projection whose outputs are those of ``linears`` side by side, quantized to ``bits``."""
        if not kernels.available():
            raise RuntimeError("the quantized kernels are not available on this machine (they are compiled once "
                               "with the system C compiler: install gcc, or use an fp32 drafter)")
        with torch.no_grad(), torch.inference_mode(False):
            weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)  # [O, I]
            packed = kernels.quantize_int8(weight) if bits == 8 else kernels.quantize_int4(weight)
            biases = [linear.bias for linear in linears]
            if all(bias is None for bias in biases):
                return cls(packed)
            bias = torch.cat([b.detach() if b is not None else linear.weight.new_zeros(linear.out_features)
                              for b, linear in zip(biases, linears)])
            return cls(packed, bias)
