"""The three kernels a decode-time ``nn.Linear`` call can run on (all compute ``x @ W.T + b`` in fp32).

Boundary: pure functions on tensors; the only module that touches torch's private oneDNN ops
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``). Which kernel runs is decided in
``trials.py``; the weight copies they read are kept in ``copies.py``.

    stock       ``F.linear(x, W, b)`` - the reference path, no copy
    transposed  ``addmm(b, x, W_t)`` with a contiguous copy ``W_t`` [I, O] (public ops; helps 1-row GEMV)
    onednn      oneDNN with the weight reordered once into its blocked layout (helps 2-16 rows)

The kernels differ only in summation order, i.e. by fp32 rounding. Shapes: ``R`` rows, ``I`` in, ``O`` out.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("stock", "transposed", "onednn")
_ONEDNN_ROWS_HINT = 8  # oneDNN's batch-size hint for the reorder; any row count works with the result
#: oneDNN's prepacked linear takes longer for 2 rows than for 3 on the CPU this project benchmarks on (for every
#: shape of the bundled model; docs/speculative.md, "Decode kernels"), so 2-row calls get a zero third row
_ONEDNN_PAD_ROWS = {2: 3}


def onednn_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops and they compute ``F.linear``."""
    return _onednn_self_test()


@functools.cache
def _onednn_self_test() -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        weight, x = torch.randn(24, 16), torch.randn(3, 16)
        out = run("onednn", x, make_copy("onednn", weight), None)
        return torch.allclose(out, F.linear(x, weight), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def available_kernels() -> tuple[str, ...]:
    return KERNELS if onednn_available() else tuple(k for k in KERNELS if k != "onednn")


def make_copy(kernel: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [O, I] in the layout ``kernel`` reads (None for stock), as a normal (non-inference) tensor."""
    if kernel == "stock":
        return None
    with torch.inference_mode(False), torch.no_grad():
        weight = weight.detach()
        if kernel == "transposed":
            return weight.t().contiguous()  # [I, O]
        return torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_ROWS_HINT)


def run(kernel: str, x: torch.Tensor, copy: torch.Tensor | None, bias: torch.Tensor | None,
        weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [R, I] (contiguous) -> [R, O]; ``copy`` from ``make_copy``, ``weight`` [O, I] for stock."""
    if kernel == "transposed":
        return torch.mm(x, copy) if bias is None else torch.addmm(bias, x, copy)
    if kernel == "onednn":
        rows = x.shape[0]
        if rows in _ONEDNN_PAD_ROWS:  # [R, I] -> [R', I] with zero rows; the output's extra rows are dropped
            x = torch.nn.functional.pad(x, (0, 0, 0, _ONEDNN_PAD_ROWS[rows] - rows))
        return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")[:rows]
    return F.linear(x, weight, bias)
