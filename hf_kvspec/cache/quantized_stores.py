"""The quantized part of one cache layer: append-only storage of flushed tokens for KIVI, int8 and fp8.

Boundary: holds codes and scales for the tokens a ``QuantizedKVLayer`` has flushed out of its full-precision
window; knows nothing about sinks, windows or transformers. Tokens are only ever *appended* (each flush
quantizes new tokens and concatenates their codes; old codes are never touched), truncated (``crop``) or
re-indexed along the batch (beam search).

Two ways to read a store: ``dequantize_into`` (the reference: full-precision keys/values for any attention) and
the fused pair ``key_scores`` / ``weighted_values`` (``hf_kvspec.stored_kv.CodeStore``) read by
``hf_kvspec.attention.quantized``, which fold the scales into the (few) query rows and attention weights instead
of applying them to the (many) stored elements.

Shape legend: ``B`` batch, ``H`` kv heads, ``S`` stored tokens, ``D`` head dim, ``G`` group size,
``M`` query rows per kv head (query heads per kv head × new tokens).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from hf_kvspec.cache import quant_ops as ops
from hf_kvspec.cache.contract import gather_segment

TensorMap = Callable[[torch.Tensor], torch.Tensor]


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def _gather_tokens(states: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """states [B, H, n, D] (codes of any dtype, or scales [B, H, n, 1]), indices [B, k] -> [B, H, k, D]. fp8 codes
    are gathered as their bytes (torch has no fp8 gather on CPU); the bits are unchanged."""
    if states.element_size() == 1 and states.dtype.is_floating_point:
        return gather_segment(states.view(torch.uint8), indices).view(states.dtype)
    return gather_segment(states, indices)


class Workspace:
    """One reusable float buffer that fused reads unpack codes into, shared by every layer of a cache.

    Layers run one after another and each use ends inside one attention call (scores and outputs are fresh
    tensors), so one buffer serves them all; it is transient working memory like SDPA's, not cache storage,
    and ``nbytes()`` does not count it. Reallocated with 25% headroom, so a growing store rarely resizes it.
    """

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            self._buffer = buffer = torch.empty(numel + numel // 4, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


class QuantizedStore(ABC):
    """Append-only quantized token storage of one layer (keys and values)."""

    granularity: int = 1  # tokens per flush unit: appends and truncations are multiples of it

    def __init__(self):
        self.length = 0  # S: tokens stored

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
    def key_scores(self, query: torch.Tensor, workspace: Workspace) -> torch.Tensor:
        """query [B, H, M, D] -> ``q · k`` for every stored token [B, H, M, S], from the codes (no dequantized K)."""

    @abstractmethod
    def weighted_values(self, probs: torch.Tensor, workspace: Workspace) -> torch.Tensor:
        """Attention weights of the stored tokens [B, H, M, S] -> ``Σ_s probs_s · v_s`` [B, H, M, D], from the codes."""

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

    def key_scores(self, query, workspace):
        # For token t of group n: q·k_t = Σ_d (q_d s_{n,d}) c_{t,d} + Σ_d q_d z_{n,d}. The per-channel scale is
        # folded into the query (M·D products per group instead of G·D) and the zero adds one offset per group.
        q, dtype = self.keys, query.dtype
        batch, heads, groups, _, dim = q.codes.shape
        codes = workspace.take((batch, heads, groups, self.granularity, dim), dtype, query.device)
        ops.unpack_codes_into(codes, q.codes, self.bits, dim=3)  # [B, H, N, G, D] raw codes 0..2^b-1
        folded = query.unsqueeze(2) * q.scale.to(dtype)  # [B, H, N, M, D]
        scores = torch.matmul(folded, codes.transpose(-1, -2))  # "bhnmd,bhngd->bhnmg": [B, H, N, M, G]
        offsets = torch.matmul(query, q.zero.squeeze(3).to(dtype).transpose(-1, -2))  # "bhmd,bhnd->bhmn"
        scores += offsets.transpose(2, 3).unsqueeze(-1)
        return scores.permute(0, 1, 3, 2, 4).flatten(3)  # [B, H, M, N·G], token order

    def weighted_values(self, probs, workspace):
        # Σ_t p_t (c_{t,j} s_{t,g(j)} + z_{t,g(j)}) = Σ_t (p_t s_{t,g}) c_{t,j} + Σ_t p_t z_{t,g}: the per-token
        # scale is folded into the weights (M·S·D/G products instead of S·D) and the zero into one matmul.
        q, dtype, group = self.values, probs.dtype, self.granularity
        batch, heads, tokens, packed = q.codes.shape
        dim = packed * 8 // self.bits
        codes = workspace.take((batch, heads, tokens, dim), dtype, probs.device)
        ops.unpack_codes_into(codes, q.codes, self.bits, dim=3)  # [B, H, S, D] raw codes
        weights = probs.unsqueeze(-1) * q.scale.to(dtype).unsqueeze(2)  # [B, H, M, S, D/G]
        parts = [torch.matmul(weights[..., j], codes[..., j * group:(j + 1) * group])  # "bhms,bhsc->bhmc"
                 for j in range(dim // group)]
        out = parts[0] if len(parts) == 1 else torch.stack(parts, dim=3)  # [B, H, M, (D/G,) G]
        offsets = torch.matmul(probs, q.zero.to(dtype))  # "bhms,bhsg->bhmg": [B, H, M, D/G]
        if len(parts) == 1:
            return out + offsets
        return (out + offsets.unsqueeze(-1)).flatten(3)

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
    """Stores whose tokens quantize independently (flush unit = 1 token, truncation is exact).

    A token's codes and scale depend on that token alone, so they move between positions like full-precision states
    and a window token quantized now gets the codes a flush would give it: ``keep_positions`` works at any position.
    """

    def __init__(self):
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}

    @staticmethod
    @abstractmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, H, n, D] -> (codes [B, H, n, D], scale [B, H, n, 1]), each token on its own."""

    @staticmethod
    @abstractmethod
    def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(codes [B, H, n, D], scale [B, H, n, 1]) -> values [B, H, n, D] in ``dtype``."""

    def append(self, keys, values):
        for prefix, x in (("k", keys), ("v", values)):
            codes, scale = self.quantize(x)
            self.state[f"{prefix}.codes"] = _cat(self.state.get(f"{prefix}.codes"), codes, 2)
            self.state[f"{prefix}.scale"] = _cat(self.state.get(f"{prefix}.scale"), scale, 2)
        self.length += keys.shape[2]

    def keep_positions(self, start: int, indices: torch.Tensor, window_keys: torch.Tensor,
                       window_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep-positions over the segment that begins at stored token ``start`` (< ``length``) and runs on through
        the window ``window_keys``/``window_values`` [B, H, n, D]: row b keeps segment token ``indices[b, j]``
        [B, k] at ``start + j``. Slots that stay below ``length`` keep codes (gathered; a window token quantized
        now), the rest are the new window, returned as (keys, values) [B, H, k - kept, D]."""
        shift = self.length - start  # segment tokens stored before the window's
        kept = min(shift, indices.shape[1])  # segment slots that stay in the store
        fresh = {"k": self.quantize(window_keys), "v": self.quantize(window_values)}
        old_tail = [(self.state[f"{p}.codes"][:, :, start:], self.state[f"{p}.scale"][:, :, start:]) for p in "kv"]
        for prefix, (codes, scale) in fresh.items():
            for field, new in (("codes", codes), ("scale", scale)):
                name = f"{prefix}.{field}"
                segment = torch.cat([self.state[name][:, :, start:], new], dim=2)
                self.state[name] = torch.cat([self.state[name][:, :, :start],
                                              _gather_tokens(segment, indices[:, :kept])], dim=2)
        rest = indices[:, kept:]  # window slots: window tokens, but a hole (a repeated index) may name a stored one
        if rest.numel() and bool((rest < shift).any()):
            window_keys, window_values = (torch.cat([self.dequantize_codes(*held, x.dtype), x], dim=2)
                                          for held, x in zip(old_tail, (window_keys, window_values), strict=True))
            shift = 0
        self.length = start + kept
        return _gather_tokens(window_keys, rest - shift), _gather_tokens(window_values, rest - shift)

    def geometry(self):
        kc, vc = self.state["k.codes"], self.state["v.codes"]  # [B, H, S, D]
        return kc.shape[:2] + kc.shape[-1:], vc.shape[:2] + vc.shape[-1:], kc.device

    def _slice(self, units):
        for name, tensor in self.state.items():
            self.state[name] = tensor[:, :, :units]

    def tensors(self):
        return dict(self.state)

    def _set(self, name, tensor):
        self.state[name] = tensor


class Int8Store(_PerTokenStore):
    """Symmetric int8 per token and head: codes int8 [B, H, S, D], one fp16 scale [B, H, S, 1] (no zero)."""

    quantize = staticmethod(ops.quantize_int8)
    dequantize_codes = staticmethod(ops.dequantize_int8)

    def dequantize_into(self, keys_out, values_out):
        s = self.state
        keys_out.copy_(s["k.codes"]).mul_(s["k.scale"])  # = ops.dequantize_int8, without a temporary
        values_out.copy_(s["v.codes"]).mul_(s["v.scale"])

    def key_scores(self, query, workspace):
        # q·k_t = s_t Σ_d q_d c_{t,d}: the per-token scale multiplies the M·S scores, not the S·D codes
        codes, scale = self.state["k.codes"], self.state["k.scale"]  # [B, H, S, D] int8, [B, H, S, 1]
        raw = workspace.take(codes.shape, query.dtype, query.device).copy_(codes)
        return torch.matmul(query, raw.transpose(-1, -2)) * scale.to(query.dtype).transpose(-1, -2)

    def weighted_values(self, probs, workspace):
        codes, scale = self.state["v.codes"], self.state["v.scale"]
        raw = workspace.take(codes.shape, probs.dtype, probs.device).copy_(codes)
        return torch.matmul(probs * scale.to(probs.dtype).transpose(-1, -2), raw)  # scale folded into the weights


class Fp8Store(_PerTokenStore):
    """e4m3 per token and head: codes [B, H, S, D], one fp16 scale [B, H, S, 1] mapping the token's largest
    magnitude onto e4m3's largest value. Per token (not one scale per head calibrated on the first update) so
    that a token's codes do not depend on which other tokens came in its update: speculative decoding's first
    forward carries the prompt and the first drafts, plain decoding's the prompt alone."""

    quantize = staticmethod(ops.quantize_fp8)
    dequantize_codes = staticmethod(ops.dequantize_fp8)

    def dequantize_into(self, keys_out, values_out):
        s = self.state
        ops.dequantize_fp8_into(keys_out, s["k.codes"], s["k.scale"])
        ops.dequantize_fp8_into(values_out, s["v.codes"], s["v.scale"])

    def key_scores(self, query, workspace):
        # q·k_t = s_t Σ_d q_d e_{t,d}: the per-token scale multiplies the M·S scores, not the S·D decoded codes
        codes, scale = self.state["k.codes"], self.state["k.scale"]
        raw = ops.fp8_codes_into(workspace.take(codes.shape, query.dtype, query.device), codes)
        return torch.matmul(query, raw.transpose(-1, -2)) * scale.to(query.dtype).transpose(-1, -2)

    def weighted_values(self, probs, workspace):
        codes, scale = self.state["v.codes"], self.state["v.scale"]
        raw = ops.fp8_codes_into(workspace.take(codes.shape, probs.dtype, probs.device), codes)
        return torch.matmul(probs * scale.to(probs.dtype).transpose(-1, -2), raw)  # scale folded into the weights
