"""The quantized part of one cache layer: append-only storage of flushed tokens for KIVI, int8 and fp8.

Boundary: holds codes and scales for the tokens a ``QuantizedKVLayer`` has flushed out of its full-precision
window; knows nothing about sinks, windows or transformers. Tokens are only ever *appended* (each flush
quantizes new tokens and concatenates their codes; old codes are never touched), truncated (``crop``) or
re-indexed along the batch (beam search).

Shape legend: ``B`` batch, ``H`` kv heads, ``S`` stored tokens, ``D`` head dim, ``G`` group size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from hf_kvspec.cache import quant_ops as ops

TensorMap = Callable[[torch.Tensor], torch.Tensor]


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


class QuantizedStore(ABC):
    """Append-only quantized token storage of one layer (keys and values)."""

    granularity: int = 1  # tokens per flush unit: appends and truncations are multiples of it

    def __init__(self):
        self.length = 0  # S: tokens stored

    def start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Called with the layer's first states [B, H, S, D] (calibration hook; most stores ignore it)."""
        return None  # an optional hook, not an abstract method

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize and append keys/values [B, H, n, D], ``n`` a multiple of ``granularity``."""

    @abstractmethod
    def dequantize_into(self, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Write every stored token's keys/values into views [B, H, S, D] of the layer's output (no concatenation)."""

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens as (keys, values) [B, H, S, D] in ``dtype``."""
        (batch, heads, key_dim), (_, _, value_dim), device = self.geometry()
        keys = torch.empty(batch, heads, self.length, key_dim, dtype=dtype, device=device)
        values = torch.empty(batch, heads, self.length, value_dim, dtype=dtype, device=device)
        self.dequantize_into(keys, values)
        return keys, values

    @abstractmethod
    def geometry(self) -> tuple[tuple[int, int, int], tuple[int, int, int], torch.device]:
        """((B, H, D_k), (B, H, D_v), device) of the stored keys/values."""

    @abstractmethod
    def _slice(self, units: int) -> None:
        """Keep the first ``units`` flush units."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor (batch on dim 0), for byte counting and batch re-indexing."""

    @abstractmethod
    def _set(self, name: str, tensor: torch.Tensor) -> None: ...

    def truncate(self, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keep the first ``tokens`` tokens. Units cut in the middle are dropped whole; their surviving tokens
        come back dequantized as (keys, values) [B, H, n, D] for the caller's full-precision window."""
        kept_units = tokens // self.granularity
        survivors = None
        if tokens % self.granularity:
            keys, values = self.dequantize(dtype)
            start = kept_units * self.granularity
            survivors = (keys[:, :, start:tokens], values[:, :, start:tokens])
        self._slice(kept_units)
        self.length = kept_units * self.granularity
        return survivors

    def map_batch(self, fn: TensorMap) -> None:
        """Apply a batch re-indexing (index_select / repeat_interleave along dim 0) to every tensor."""
        for name, tensor in self.tensors().items():
            self._set(name, fn(tensor))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class KiviStore(QuantizedStore):
    """KIVI (arXiv:2402.02750): keys per channel in groups of ``G`` tokens, values per token in groups of ``G``
    channels; asymmetric ``bits``-bit codes packed into uint8, fp16 scale and zero per group."""

    def __init__(self, bits: int, group_size: int):
        super().__init__()
        self.bits, self.granularity = bits, group_size
        self.keys: ops.GroupCodes | None = None  # codes [B, H, S/G, G·b/8, D], scale/zero [B, H, S/G, 1, D]
        self.values: ops.GroupCodes | None = None  # codes [B, H, S, D·b/8], scale/zero [B, H, S, D/G]

    def append(self, keys, values):
        new_k = ops.quantize_keys(keys, self.bits, self.granularity)
        new_v = ops.quantize_values(values, self.bits, self.granularity)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            for old, new in ((self.keys, new_k), (self.values, new_v)):  # dim 2: groups (keys) / tokens (values)
                old.codes = torch.cat([old.codes, new.codes], dim=2)
                old.scale = torch.cat([old.scale, new.scale], dim=2)
                old.zero = torch.cat([old.zero, new.zero], dim=2)
        self.length += keys.shape[2]

    def dequantize_into(self, keys_out, values_out):
        ops.dequantize_keys(self.keys, self.bits, keys_out.dtype, out=keys_out)
        ops.dequantize_values(self.values, self.bits, values_out.dtype, out=values_out)

    def geometry(self):
        kc, vc = self.keys.codes, self.values.codes  # [B, H, N, G·b/8, D], [B, H, S, D·b/8]
        return (*kc.shape[:2], kc.shape[-1]), (*vc.shape[:2], vc.shape[-1] * 8 // self.bits), kc.device

    def _slice(self, units):
        tokens = units * self.granularity
        for q, end in ((self.keys, units), (self.values, tokens)):
            if q is not None:
                q.codes, q.scale, q.zero = q.codes[:, :, :end], q.scale[:, :, :end], q.zero[:, :, :end]

    def tensors(self):
        out = {}
        for prefix, q in (("k", self.keys), ("v", self.values)):
            if q is not None:
                out.update({f"{prefix}.codes": q.codes, f"{prefix}.scale": q.scale, f"{prefix}.zero": q.zero})
        return out

    def _set(self, name, tensor):
        prefix, field = name.split(".")
        setattr(self.keys if prefix == "k" else self.values, field, tensor)


class _PerTokenStore(QuantizedStore):
    """Stores whose tokens quantize independently (flush unit = 1 token, truncation is exact)."""

    def __init__(self):
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}

    def geometry(self):
        kc, vc = self.state["k.codes"], self.state["v.codes"]  # [B, H, S, D]
        return kc.shape[:2] + kc.shape[-1:], vc.shape[:2] + vc.shape[-1:], kc.device

    def _slice(self, units):
        for name, tensor in self.state.items():
            if not name.endswith("scale_head"):  # per-head scales have no token axis
                self.state[name] = tensor[:, :, :units]

    def tensors(self):
        return dict(self.state)

    def _set(self, name, tensor):
        self.state[name] = tensor


class Int8Store(_PerTokenStore):
    """Symmetric int8 per token and head: codes int8 [B, H, S, D], one fp16 scale [B, H, S, 1] (no zero)."""

    def append(self, keys, values):
        for prefix, x in (("k", keys), ("v", values)):
            codes, scale = ops.quantize_int8(x)
            self.state[f"{prefix}.codes"] = _cat(self.state.get(f"{prefix}.codes"), codes, 2)
            self.state[f"{prefix}.scale"] = _cat(self.state.get(f"{prefix}.scale"), scale, 2)
        self.length += keys.shape[2]

    def dequantize_into(self, keys_out, values_out):
        s = self.state
        keys_out.copy_(s["k.codes"]).mul_(s["k.scale"])  # = ops.dequantize_int8, without a temporary
        values_out.copy_(s["v.codes"]).mul_(s["v.scale"])


class Fp8Store(_PerTokenStore):
    """e4m3 codes [B, H, S, D] with one fp32 scale per (sequence, head) [B, H, 1, 1] for keys and for values,
    calibrated once on the layer's first states (the prompt) with ``FP8_HEADROOM``, then frozen so codes
    can be appended without re-quantization."""

    def start(self, keys, values):
        self.state["k.scale_head"] = ops.fp8_head_scale(keys)
        self.state["v.scale_head"] = ops.fp8_head_scale(values)

    def append(self, keys, values):
        for prefix, x in (("k", keys), ("v", values)):
            codes = ops.quantize_fp8(x, self.state[f"{prefix}.scale_head"])
            self.state[f"{prefix}.codes"] = _cat(self.state.get(f"{prefix}.codes"), codes, 2)
        self.length += keys.shape[2]

    def dequantize_into(self, keys_out, values_out):
        s = self.state
        ops.dequantize_fp8_into(keys_out, s["k.codes"], s["k.scale_head"])
        ops.dequantize_fp8_into(values_out, s["v.codes"], s["v.scale_head"])
