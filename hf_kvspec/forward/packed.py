"""Packed weights of a Llama-family decoder: the fused, transposed copies the fast forward reads.

Boundary: says whether a model fits the fast forward (``unsupported_reason``), builds copies of its weights and
holds them; never changes the model (its parameters, modules and state dict stay as they are). The math that
reads the copies is ``program.py``.

Why copies: on a CPU a decode step is bound by reading weights. torch's stock ``F.linear(x, W)`` for a few rows
calls a GEMM on the transposed view of ``W`` [O, I], which reads it in its slowest order; ``x @ W_t`` on a
contiguous ``W_t`` [I, O] reads it once, in order (docs/fast_forward.md has the per-op profile). Fusing the
query/key/value projections into one ``[E, (Hq + 2 Hkv) D]`` matrix and gate/up into one ``[E, 2 F]`` halves the
calls per layer. A projection's outputs are computed by the same dot products as the model's own, in another
summation order: results differ from the reference by fp32 rounding only.

Memory: one copy of every linear weight (about the model's size), plus a second, oneDNN-blocked one once calls
of several rows run (speculative verify forwards, batches, prefills: oneDNN reads a blocked weight once for all
rows where MKL's GEMM on the transposed copy slows down past one row), within a memory budget
(``BLOCKED_MEMORY_FRACTION``); ``PackedModel.bytes_held()`` says what is held. The norms' weights are shared with
the model (not copied). Copies go stale when a weight changes; ``PackedModel.current`` says so
(checked once per ``generate`` call, not per step) and the owner repacks.

Shapes: ``E`` hidden size, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim, ``F`` MLP width, ``V`` vocabulary,
``R`` rows (tokens) of a linear call, ``I``/``O`` in/out features.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

#: ``model_type``s whose decoder layer is exactly: RMSNorm -> q/k/v (optional bias) -> rotary -> attention -> o ->
#: residual -> RMSNorm -> SiLU(gate) * up -> down -> residual, with no other per-layer state
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class PackedLinear:
    """``x`` [R, I] -> [R, O] = ``x @ W.T + bias`` over copies of ``W`` [O, I] in the layout each row count reads
    fastest: one row (a decode step) reads a transposed copy ``weight_t`` [I, O] in order; several rows (a verify
    forward, a prefill) read a oneDNN-blocked copy, made at the first such call (``hf_kvspec.kernels.ops``) when
    the memory budget allows it, else the transposed copy. Thread-safe: the blocked copy is made once."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight_t, self.bias = weight_t, bias
        self.blocked: torch.Tensor | None = None  # oneDNN's layout of the weight, for calls of several rows
        self._lock = threading.Lock()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1 and (self.blocked is not None or self._make_blocked()):
            from hf_kvspec.kernels.ops import run

            return run("onednn", x, self.blocked, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def _make_blocked(self) -> bool:
        from hf_kvspec.kernels.ops import make_copy, onednn_available

        with self._lock:
            if self.blocked is None and onednn_available() and _room_for(self.weight_t):
                self.blocked = make_copy("onednn", self.weight_t.t())
        return self.blocked is not None

    @property
    def nbytes(self) -> int:
        tensors = (self.weight_t, self.bias, self.blocked)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @classmethod
    def of(cls, *linears: nn.Linear) -> PackedLinear:
        """One linear whose outputs are those of ``linears`` side by side (their weights stacked along O)."""
        weight, bias = _stacked(linears)  # [O, I], [O] | None
        with torch.no_grad(), torch.inference_mode(False):
            return cls(weight.t().contiguous(), bias)  # [I, O]


class PanelLinear:
    """``x`` [R, I] -> [R, O] through ``hf_kvspec.kernels.fp32``: one copy of ``W`` in 16-row panels that its C
    kernel streams once for every row count (1 row as fast as the transposed copy, 2-16 rows little slower), so
    a verify forward costs about a decode step and the model needs one copy, not two. Used whenever the kernel
    builds (it needs a C compiler, once per machine); ``PackedLinear`` otherwise."""

    def __init__(self, weight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from hf_kvspec.kernels.fp32 import fp32_linear

        return fp32_linear(x.contiguous(), self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    @classmethod
    def of(cls, *linears: nn.Linear) -> PanelLinear:
        """One projection whose outputs are those of ``linears`` side by side."""
        from hf_kvspec.kernels.fp32 import pack_fp32

        weight, bias = _stacked(linears)
        return cls(pack_fp32(weight), bias)


def fp32_projection(*linears: nn.Linear) -> Projection:
    """The fp32 projection the fast forward packs: ``PanelLinear`` where its kernel builds, else ``PackedLinear``."""
    from hf_kvspec.kernels import fp32

    return (PanelLinear if fp32.available() else PackedLinear).of(*linears)


def _stacked(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights stacked along O [sum O, I] and their biases (zeros for a missing one; None if none)."""
    with torch.no_grad(), torch.inference_mode(False):
        weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
        if all(linear.bias is None for linear in linears):
            return weight, None
        bias = torch.cat([linear.bias.detach() if linear.bias is not None
                          else linear.weight.new_zeros(linear.out_features) for linear in linears])
        return weight, bias.contiguous()


#: the blocked copies (for calls of several rows) may take at most this fraction of the memory available
BLOCKED_MEMORY_FRACTION = 0.25


def _room_for(weight: torch.Tensor) -> bool:
    from hf_kvspec.kernels.copies import available_bytes

    return weight.numel() * weight.element_size() <= BLOCKED_MEMORY_FRACTION * available_bytes()


class Projection(Protocol):
    """What the program calls for a linear layer (``PackedLinear`` or a quantized one): [R, I] -> [R, O]."""

    nbytes: int  # bytes of the copies it holds now

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


#: how a packed copy of some linears is made: fp32 ``PackedLinear.of`` by default; a quantized drafter passes
#: its own maker and gets the same program over other weights
LinearMaker = Callable[..., Projection]


@dataclass(frozen=True)
class PackedLayer:
    """One decoder layer's copies; the norm weights [E] are the model's own tensors."""

    input_norm: torch.Tensor
    qkv: Projection  # [R, E] -> [R, (Hq + 2 Hkv) D]
    o: Projection  # [R, Hq D] -> [R, E]
    post_norm: torch.Tensor
    gate_up: Projection  # [R, E] -> [R, 2 F]
    down: Projection  # [R, F] -> [R, E]


@dataclass(frozen=True)
class Dims:
    hidden: int  # E
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    mlp: int  # F
    eps: float  # RMSNorm epsilon
    scaling: float  # attention scale


@dataclass
class PackedModel:
    """Everything ``program.forward`` reads: the model's embedding and rotary modules (called, never changed), the
    layers' copies, the final norm's weight, the LM head's copy and the dimensions."""

    embed: nn.Module
    layers: list[PackedLayer]
    norm: torch.Tensor
    lm_head: Projection  # [R, E] -> [R, V]
    rotary: nn.Module
    dims: Dims
    stamps: tuple  # (Parameter, data_ptr, version) of every weight the copies were made from

    def linears(self) -> list[Projection]:
        return [f for layer in self.layers for f in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def bytes_held(self) -> int:
        """Bytes of every copy held now (the blocked copies count once they are made)."""
        return sum(f.nbytes for f in self.linears())

    def current(self, model: nn.Module) -> bool:
        """True while every source weight is the same tensor, memory and in-place version as when packed."""
        return all(_stamp(p) == stamp for p, stamp in zip(_linear_weights(model), self.stamps))


def pack(model: nn.Module, make_linear: LinearMaker = fp32_projection) -> PackedModel:
    """Copies of ``model``'s linear weights in the layout ``program.forward`` reads (``make_linear`` builds each:
    fp32 transposed by default). Call ``unsupported_reason`` first."""
    decoder, config = model.get_decoder(), model.config
    layers = [_pack_layer(layer, make_linear) for layer in decoder.layers]
    lm_head = make_linear(model.get_output_embeddings())
    attn = decoder.layers[0].self_attn
    dims = Dims(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                head_dim=attn.head_dim, mlp=config.intermediate_size,
                eps=float(decoder.layers[0].input_layernorm.variance_epsilon), scaling=float(attn.scaling))
    stamps = tuple(_stamp(p) for p in _linear_weights(model))
    return PackedModel(decoder.embed_tokens, layers, decoder.norm.weight, lm_head, decoder.rotary_emb, dims, stamps)


def _pack_layer(layer: nn.Module, make_linear: LinearMaker) -> PackedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    return PackedLayer(input_norm=layer.input_layernorm.weight,
                       qkv=make_linear(attn.q_proj, attn.k_proj, attn.v_proj), o=make_linear(attn.o_proj),
                       post_norm=layer.post_attention_layernorm.weight,
                       gate_up=make_linear(mlp.gate_proj, mlp.up_proj), down=make_linear(mlp.down_proj))


def _linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)]


def _stamp(weight: torch.Tensor) -> tuple:
    version = None if weight.is_inference() else weight._version
    return id(weight), weight.data_ptr(), version


# ------------------------------------------------------------------------------------------------ fitness
def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on the fast forward (None when it can): the architecture, dtype and device it
    needs, in words a user can act on."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES} (decoders with the Llama layer "
                "structure); other models run the reference forward")
    weight = next(model.parameters(), None)
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return "the fast forward runs fp32 weights on CPU; other dtypes and devices run the reference forward"
    return _config_reason(config) or _structure_reason(model)


def _config_reason(config) -> str | None:
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the fast forward computes SiLU-gated MLPs)"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if windowed or any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention layers (the fast forward attends to every cached token)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def _structure_reason(model: nn.Module) -> str | None:
    try:
        decoder = model.get_decoder()
        layers, _ = decoder.layers, (decoder.norm.weight, decoder.rotary_emb, decoder.embed_tokens.weight)
        head = model.get_output_embeddings()
    except AttributeError as err:
        return f"the decoder lacks a part the fast forward reads ({err})"
    if type(head) is not nn.Linear:
        return f"the LM head is a {type(head).__name__}, not an nn.Linear"
    for index, layer in enumerate(layers):
        reason = _layer_reason(layer)
        if reason is not None:
            return f"decoder layer {index}: {reason}"
    return None


def _layer_reason(layer: nn.Module) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [(mlp, n) for n in
                                                                             ("gate_proj", "up_proj", "down_proj")]
    if any(type(getattr(part, name, None)) is not nn.Linear for part, name in names):
        return "its projections are not plain nn.Linear modules (quantized, adapted or hooked layers)"
    if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm")):
        return "query/key norms"
    if any("forward" in vars(m) for m in layer.modules()):
        return "a module has an instance-level forward (e.g. accelerate hooks)"
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if any(not hasattr(norm, "variance_epsilon") for norm in norms):
        return "its norms are not RMSNorms"
    return None
