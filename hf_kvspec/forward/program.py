"""The fast forward's math: a Llama-family decoder over packed weights, in few, large torch ops.

Boundary: pure computation over a ``PackedModel`` (``packed.py``); attention and the KV cache are the ``attend``
callback's (``attend.py``: a transformers cache in ``generate``), so the same program serves every caller.

The reference is the model's own forward (transformers' ``LlamaDecoderLayer`` and friends); this program computes
the same function in the same order of operations, except that each linear call reads a packed copy (fused
q/k/v and gate/up, transposed), whose GEMM sums in another order: outputs agree with the reference to fp32
rounding (``tests/forward/test_fast_forward.py`` compares them). What it saves per one-token step on a CPU is
listed in docs/fast_forward.md: the weight reads of ``F.linear`` in its slow order, and about two thirds of the
small ops and Python a step of the stock modules runs.

Shapes: ``B`` rows, ``T`` new tokens, ``E`` hidden, ``Hq``/``Hkv`` heads, ``D`` head dim, ``F`` MLP width, ``V``
vocabulary, ``K`` logits kept per row, ``C`` feature width (``len(feature_layers) * E``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hf_kvspec.forward.packed import Dims, PackedLayer, PackedModel

#: ``attend(layer_index, q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]) -> [B, T, Hq, D]``: stores the new
#: keys/values and attends over the cached ones plus them (the output layout of transformers' attention functions)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def forward(packed: PackedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend,
            logits_to_keep: int | torch.Tensor = 0, feature_layers: Sequence[int] | None = None):
    """``input_ids``/``position_ids`` [B, T] -> (logits [B, K, V] of the last ``K = logits_to_keep`` tokens (all
    when 0) or of the columns a 1D ``logits_to_keep`` tensor lists, features [B, T, C] or None). ``feature_layers`` index hidden states as transformers'
    ``output_hidden_states`` does: 0 the embeddings, ``i`` the output of layer ``i - 1``, ``L`` / ``-1`` the final
    norm's output."""
    count = len(packed.layers)
    wanted = [i % (count + 1) for i in feature_layers] if feature_layers is not None else []
    hidden = packed.embed(input_ids)  # [B, T, E]
    cos, sin = packed.rotary(hidden, position_ids)  # [B, T, D] each
    cos, sin = cos.unsqueeze(1), signed_sin(sin.unsqueeze(1))  # [B, 1, T, D]: broadcast over heads
    states = {0: hidden} if 0 in wanted else {}
    for index, layer in enumerate(packed.layers):
        hidden = decoder_layer(layer, packed.dims, hidden, cos, sin, lambda q, k, v, i=index: attend(i, q, k, v))
        if index + 1 in wanted and index + 1 < count:
            states[index + 1] = hidden
    hidden = rms_norm(hidden, packed.norm, packed.dims.eps)
    states[count] = hidden
    kept = _kept_columns(hidden, logits_to_keep)  # [B, K, E]
    batch, keep, width = kept.shape
    logits = packed.lm_head(kept.reshape(batch * keep, width))  # [B K, V]
    logits = logits.view(batch, keep, logits.shape[-1])  # [B, K, V] (K may be 0: nothing sampled this round)
    features = torch.cat([states[i] for i in wanted], dim=-1) if wanted else None  # [B, T, C]
    return logits, features


def _kept_columns(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The columns of ``hidden`` [B, T, E] whose logits are wanted (as transformers reads ``logits_to_keep``)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep]
    tokens = hidden.shape[1]
    keep = tokens if not logits_to_keep else min(logits_to_keep, tokens)
    return hidden[:, tokens - keep:]


def decoder_layer(layer: PackedLayer, dims: Dims, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Callable) -> torch.Tensor:
    """One pre-norm decoder layer: [B, T, E] -> [B, T, E]."""
    hidden = hidden + attention_block(layer, dims, rms_norm(hidden, layer.input_norm, dims.eps), cos, sin, attend)
    return hidden + mlp_block(layer, rms_norm(hidden, layer.post_norm, dims.eps))


def attention_block(layer: PackedLayer, dims: Dims, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attend: Callable) -> torch.Tensor:
    """[B, T, E] -> [B, T, E]: fused q/k/v projection, rotary, attention (``attend``), output projection."""
    batch, tokens, width = normed.shape
    qkv = layer.qkv(normed.reshape(batch * tokens, width))  # [B T, (Hq + 2 Hkv) D]
    heads = qkv.view(batch, tokens, dims.heads + 2 * dims.kv_heads, dims.head_dim).transpose(1, 2)
    rotated = rotate(heads[:, : dims.heads + dims.kv_heads], cos, sin)  # q and k in one pass: [B, Hq + Hkv, T, D]
    q, k = rotated.split([dims.heads, dims.kv_heads], dim=1)
    out = attend(q, k, heads[:, dims.heads + dims.kv_heads:])  # [B, T, Hq, D]
    return layer.o(out.reshape(batch * tokens, dims.heads * dims.head_dim)).view(batch, tokens, -1)


def mlp_block(layer: PackedLayer, normed: torch.Tensor) -> torch.Tensor:
    """[B, T, E] -> [B, T, E]: ``down(silu(gate(x)) * up(x))`` with gate and up in one call."""
    batch, tokens, width = normed.shape
    gate, up = layer.gate_up(normed.reshape(batch * tokens, width)).chunk(2, dim=-1)  # [B T, F] each
    return layer.down(F.silu(gate) * up).view(batch, tokens, width)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` in fp32 (the only dtype the fast forward runs): ``F.rms_norm`` computes
    ``x * rsqrt(mean(x^2) + eps) * weight`` in that order, bit for bit the module's result, in fewer calls."""
    return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [..., D] with its first half negated, so that ``rotate`` needs one ``roll`` instead of two slices,
    a negation and a concatenation (negating is exact: the same values as ``rotate_half``'s)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' ``apply_rotary_pos_emb`` for one tensor: x [B, H, T, D].
    ``rotate_half(x) * sin == roll(x, D / 2) * signed_sin(sin)`` elementwise."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
