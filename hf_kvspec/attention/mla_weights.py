"""What MLA absorption needs from one DeepSeek-style attention module, prepared once per patch.

Boundary: inspects a transformers MLA attention module (which classes qualify, how they apply RoPE),
splits its up-projection ``kv_b_proj`` into the key and value halves, and holds the cost model that
picks absorbed vs decompressed attention per call. It runs no attention itself (``mla.py`` does).

Shape legend: ``H`` heads, ``C`` latent rank (``kv_lora_rank``, d_c), ``R`` RoPE dim (``qk_rope_head_dim``,
d_r), ``N`` no-RoPE query/key dim (``qk_nope_head_dim``), ``V`` value head dim, ``T`` new tokens,
``S`` cached tokens (including the new ones).

``kv_b_proj.weight`` is ``[H·(N+V), C]``; viewed as ``[H, N+V, C]`` its first ``N`` rows per head are
``W_UK`` and the last ``V`` are ``W_UV`` (DeepSeek-V2, arXiv 2405.04434, eq. 10-11). The split is a pair
of views: no copy of the weights, and an in-place weight update is seen at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from hf_kvspec import _compat

Strategy = Literal["auto", "absorb", "decompress"]
STRATEGIES = ("auto", "absorb", "decompress")

# attention class -> how its forward applies RoPE. Only classes whose forward is, line for line, DeepSeek's
# (checked against the transformers 5.24 sources) are listed; derivatives with extra gates, NoPE keys, query
# scaling or indexers (Kimi-Linear, Bailing, Mistral-4, dots3) are not the same attention.
SUPPORTED_ATTENTION: dict[str, str] = {
    "DeepseekV2Attention": "complex",  # freqs_cis multiplied as complex numbers (apply_rotary_emb)
    "DeepseekV3Attention": "cos_sin",  # cos/sin, interleaved pairs when config.rope_interleave
    "Glm4MoeLiteAttention": "cos_sin",
    "YoutuAttention": "cos_sin",
}


class UnsupportedMLAError(ValueError):
    """The model has no attention module that MLA absorption supports."""


@dataclass(frozen=True)
class MLADims:
    heads: int  # H
    latent: int  # C = d_c
    rope: int  # R = d_r
    nope: int  # N
    value: int  # V

    def absorb_is_cheaper(self, q_len: int, kv_len: int) -> bool:
        """Multiply-adds per sequence and layer, absorbed vs decompressed (vLLM/SGLang make the same choice).

        absorbed:     T·H·N·C (fold W_UK into q) + T·S·H·(C+R) (scores) + T·S·H·C (values) + T·H·C·V (W_UV)
        decompressed: S·C·H·(N+V) (expand every cached token) + T·S·H·(N+R) + T·S·H·V
        The W_UK/W_UV terms cancel when T = S, so an empty cache always decompresses; absorbing wins when
        ``T·S·(2C-N-V) <= (S-T)·C·(N+V)``, i.e. ``1/T - 1/S >= (2C-N-V) / (C·(N+V))``: with DeepSeek-V3's
        sizes up to T ≈ 170 new tokens on a long cache (decode, draft verification, small prefill chunks).
        """
        h, c, r, n, v = self.heads, self.latent, self.rope, self.nope, self.value
        absorbed = q_len * h * n * c + q_len * kv_len * h * (2 * c + r) + q_len * h * c * v
        decompressed = kv_len * c * h * (n + v) + q_len * kv_len * h * (n + r + v)
        return absorbed <= decompressed


@dataclass
class MLALayerPlan:
    """Everything the absorbed forward of one layer needs, built once by ``plan_layer``."""

    dims: MLADims
    w_uk: torch.Tensor  # [H, N, C] view of kv_b_proj.weight
    w_uv: torch.Tensor  # [H, V, C] view of kv_b_proj.weight
    rope: Callable  # (q_rot [B,H,T,R], k_rot [B,1,T,R], position_embeddings) -> rotated pair
    strategy: Strategy

    def use_absorbed(self, q_len: int, kv_len: int) -> bool:
        if self.strategy == "auto":
            return self.dims.absorb_is_cheaper(q_len, kv_len)
        return self.strategy == "absorb"

    def refresh(self, module: torch.nn.Module) -> None:
        """Re-split when ``kv_b_proj.weight`` was moved or cast (``model.to(...)`` swaps the storage)."""
        weight = module.kv_b_proj.weight
        if self.w_uk.data_ptr() != weight.data_ptr() or self.w_uk.dtype != weight.dtype:
            self.w_uk, self.w_uv = split_kv_b(weight, self.dims)


def supported_style(module: torch.nn.Module) -> tuple[str, type] | None:
    """``(rope style, matched class)`` for a supported MLA module (or subclass keeping its forward), else None."""
    for cls in type(module).__mro__:
        style = SUPPORTED_ATTENTION.get(cls.__name__)
        if style is not None and type(module).forward is cls.forward:
            return style, cls
    return None


def plan_layer(module: torch.nn.Module, strategy: Strategy) -> MLALayerPlan:
    style, cls = supported_style(module)
    dims = _dims(module)
    w_uk, w_uv = split_kv_b(module.kv_b_proj.weight, dims)
    return MLALayerPlan(dims, w_uk, w_uv, _rope_function(module, style, cls), strategy)


def split_kv_b(weight: torch.Tensor, dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H·(N+V), C]`` -> ``W_UK [H, N, C]``, ``W_UV [H, V, C]`` (views)."""
    per_head = weight.view(dims.heads, dims.nope + dims.value, dims.latent)
    return per_head[:, : dims.nope], per_head[:, dims.nope :]


def _dims(module: torch.nn.Module) -> MLADims:
    config = module.config
    missing = [f for f in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
               if not getattr(config, f, None)]
    if missing:
        raise UnsupportedMLAError(f"MLA absorption needs positive {missing} in the config of layer "
                                  f"{getattr(module, 'layer_idx', '?')}.")
    dims = MLADims(module.num_heads, config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim,
                   config.v_head_dim)
    expected = (dims.heads * (dims.nope + dims.value), dims.latent)
    if tuple(module.kv_b_proj.weight.shape) != expected:
        raise UnsupportedMLAError(f"kv_b_proj.weight has shape {tuple(module.kv_b_proj.weight.shape)}, expected "
                                  f"{expected} = (heads·(qk_nope_head_dim+v_head_dim), kv_lora_rank).")
    return dims


def _rope_function(module: torch.nn.Module, style: str, cls: type) -> Callable:
    """The RoPE helper of the module's own modeling file, so rotations match it bit for bit."""
    if style == "complex":
        apply_complex = _compat.modeling_function(cls, "apply_rotary_emb")
        return lambda q, k, freqs_cis: apply_complex(q, k, freqs_cis.to(q.device))
    interleave = getattr(module.config, "rope_interleave", False)
    apply = _compat.modeling_function(cls, "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb")
    return lambda q, k, cos_sin: apply(q, k, *cos_sin)
