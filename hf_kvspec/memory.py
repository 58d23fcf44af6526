"""KV-cache byte arithmetic for any transformers config (MHA / GQA / MQA / MLA, any dtype or bit width).

Boundary: pure arithmetic on a config; no tensors are allocated. Caches in this package report their
actual storage with ``nbytes()``, and the tests check those against the formulas here, to the byte.

Formulas (per token, per layer; ``E`` = cached elements):
    dense attention:  E = 2 · H_kv · D            (K and V; MHA H_kv = H, MQA 1, GQA G)
    MLA (DeepSeek):   E = d_c + d_r               (latent + shared RoPE key; no factor 2)
    full precision:   bytes = E · dtype_bytes
    group-quantized:  bits  = E · (b + 2·16/G)    (b code bits; fp16 scale + fp16 zero per group of G)

Token accounting:
    sliding-window layers keep ``min(S, window - 1)`` tokens: transformers' ``DynamicSlidingWindowLayer``
    stores ``window - 1`` tokens because the next query token completes the window. Quantized storage is
    ``QuantizedKVCache``'s: it refuses explicit sliding/chunked ``layer_types`` and, for a config that only sets
    ``sliding_window`` (Mistral), keeps every token (the mask applies the window), so the arithmetic does too.
    Quantized storage (KIVI-style) keeps the newest tokens in a full-precision residual window of at most
    ``R`` tokens and flushes whole groups of ``G`` from its old end (see ``quantized_token_split``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4, 8)
_SCALE_ZERO_BITS = 2 * 16  # one fp16 scale and one fp16 zero point per group


@dataclass(frozen=True)
class LayerKV:
    """What one attention layer caches per token."""

    elements_per_token: int  # E: cached elements per token (K and V together)
    window: int | None  # sliding window in tokens, or None for full attention


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def is_mla(config) -> bool:
    """DeepSeek-V2/V3-style multi-head latent attention (caches ``c_kv`` + ``k_rope``)."""
    config = _text_config(config)
    return getattr(config, "kv_lora_rank", None) is not None and getattr(config, "qk_rope_head_dim", None) is not None


def head_dim(config) -> int:
    config = _text_config(config)
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    """Key/value heads: ``num_key_value_heads``, or ``num_attention_heads`` (MHA) when it is unset (None)."""
    config = _text_config(config)
    heads = getattr(config, "num_key_value_heads", None)
    return int(config.num_attention_heads) if heads is None else int(heads)


_DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
                "bf16": "bfloat16", "bfloat16": "bfloat16", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


def resolve_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from itself or a name (``"fp16"``, ``"float16"``, ``"bf16"``, ``"fp32"``, ``"fp8"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return getattr(torch, _DTYPE_NAMES[dtype.lower().removeprefix("torch.")])
    if isinstance(dtype, str):
        raise ValueError(f"dtype={dtype!r} is unknown; use a torch.dtype or one of {sorted(_DTYPE_NAMES)}.")
    raise TypeError(f"dtype must be a torch.dtype or a name such as 'fp16'; got {type(dtype).__name__}.")


def resolve_config(config):
    """The config of ``config``: a transformers config, a model (its ``.config``) or a preset name."""
    if isinstance(config, str):
        from hf_kvspec.presets import load_config

        return load_config(config)
    if not hasattr(config, "num_hidden_layers") and hasattr(getattr(config, "config", None), "num_hidden_layers"):
        config = config.config  # a model
    if not hasattr(_text_config(config), "num_hidden_layers"):
        raise TypeError(f"expected a transformers config, a model or a preset name; got {type(config).__name__}. "
                        "Pass model.config, AutoConfig.from_pretrained(<model id>) or a name from "
                        "hf_kvspec.presets.PRESETS.")
    _check_heads(_text_config(config))
    return config


def _check_heads(config) -> None:
    """Refuse head counts no attention layer (and so no cache) accepts."""
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if kv_heads is None or is_mla(config):
        return
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ValueError(f"num_key_value_heads={kv_heads!r} must be a positive integer (1 for MQA, "
                         f"num_attention_heads={heads} for MHA), or None to mean MHA.")
    if isinstance(heads, int) and heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; every "
                         "key/value head must serve a whole group of query heads.")


def _token_count(name: str, value) -> int:
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer number of tokens/sequences, got {value!r}; "
                        f"pass e.g. {name}=int(...)") from None
    if count < 0:
        raise ValueError(f"{name}={count} must be non-negative.")
    return count


def _check_groups(config, bits: int, group_size: int, residual_length: int) -> None:
    """Refuse what ``QuantizedKVCache(method='kivi')`` refuses for this config: non-full layers, non-dividing
    groups (value groups run along ``head_dim``)."""
    config = _text_config(config)
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if unsupported:
        raise ValueError(f"QuantizedKVCache supports full-attention layers only; this model has {unsupported}. "
                         "Use bits=None (full precision) for this config.")
    if is_mla(config):
        return
    dim = head_dim(config)
    if dim % group_size:
        step = 8 // math.gcd(8, bits)
        fits = [g for g in range(step, dim + 1, step) if dim % g == 0 and residual_length % g == 0]
        raise ValueError(f"KIVI value groups run along head_dim={dim}, so group_size={group_size} must divide it. "
                         f"Group sizes that work with bits={bits} and residual_length={residual_length}: "
                         f"{', '.join(map(str, fits)) or 'none'}.")


def layer_kv_specs(config) -> list[LayerKV]:
    """Per-layer cache shape of a config, following its ``layer_types`` when present."""
    config = _text_config(config)
    if is_mla(config):
        per_token = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    else:
        per_token = 2 * num_kv_heads(config) * head_dim(config)
    num_layers = int(config.num_hidden_layers)
    specs = []
    for kind in _layer_types(config)[:num_layers]:
        if kind in ("moe", "mlp", "dummy"):  # layers without attention cache nothing
            specs.append(LayerKV(0, None))
        elif kind in ("sliding_attention", "hybrid_sliding", "reference_sliding_attention"):
            specs.append(LayerKV(per_token, int(config.sliding_window)))
        elif kind == "chunked_attention":
            specs.append(LayerKV(per_token, int(config.attention_chunk_size)))
        else:
            specs.append(LayerKV(per_token, None))
    return specs


def _layer_types(config) -> list[str]:
    """Explicit ``layer_types``, else inferred the way transformers' ``DynamicCache`` infers them."""
    explicit = getattr(config, "layer_types", None)
    if explicit:
        return list(explicit)
    if getattr(config, "sliding_window", None) is not None:
        kind = "sliding_attention"
    elif getattr(config, "attention_chunk_size", None) is not None:
        kind = "chunked_attention"
    else:
        kind = "full_attention"
    return [kind] * int(config.num_hidden_layers)


def stored_tokens(seq_len: int, window: int | None) -> int:
    """Tokens a layer holds after ``seq_len`` tokens (sliding layers keep ``window - 1``)."""
    return seq_len if window is None else min(seq_len, window - 1)


def check_quant_params(bits: int, group_size: int, residual_length: int = 0) -> None:
    """Raise ``ValueError`` naming the fix for unsupported quantization settings."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {SUPPORTED_BITS}.")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % (8 // math.gcd(8, bits)):
        raise ValueError(f"group_size={group_size} must be a positive integer multiple of {8 // math.gcd(8, bits)}.")
    if residual_length < 0 or residual_length % group_size:
        raise ValueError(
            f"residual_length={residual_length} must be a non-negative multiple of group_size={group_size} "
            "(the window flushes whole groups)."
        )


def quantized_token_split(seq_len: int, group_size: int, residual_length: int) -> tuple[int, int]:
    """``(quantized, residual)`` token counts for a KIVI-style cache holding ``seq_len`` tokens.

    The residual window holds at most ``residual_length`` tokens; whenever it would overflow, its oldest
    full group of ``group_size`` tokens is quantized. So the quantized count is the smallest multiple of
    ``group_size`` that leaves at most ``residual_length`` tokens in the window. With
    ``residual_length == 0`` every complete group is quantized and the remainder stays in full precision.
    """
    if residual_length == 0:
        quantized = (seq_len // group_size) * group_size
    else:
        overflow = max(0, seq_len - residual_length)
        quantized = math.ceil(overflow / group_size) * group_size
    return quantized, seq_len - quantized


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _quantized_bits(elements: int, bits: int, group_size: int) -> int:
    return elements * bits + (elements // group_size) * _SCALE_ZERO_BITS


def kv_cache_bytes(
    config,
    seq_len: int,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    bits: int | None = None,
    group_size: int = 64,
    residual_length: int = 0,
    *,
    scale_layout: str = "group",
) -> int:
    """Bytes of KV cache for ``batch_size`` sequences of ``seq_len`` tokens under ``config``.

    Args:
        config: any transformers config (text config is taken from multimodal configs).
        seq_len: tokens per sequence.
        batch_size: number of sequences.
        dtype: storage dtype of full-precision entries (and of the residual window when quantized).
        bits: code bits for group-quantized storage (2, 4 or 8), or ``None`` for full precision.
        group_size: elements per quantization group (one fp16 scale + one fp16 zero each).
        residual_length: newest tokens kept in ``dtype`` (a multiple of ``group_size`` for ``"group"``).
        scale_layout: where quantization scales live (``bits`` given):
            ``"group"``  fp16 scale + fp16 zero per group of ``group_size`` elements (KIVI; the default);
            ``"token"``  symmetric, one fp16 scale per token and K/V row, no zero (int8 per token);
                         tokens leave the residual window one at a time;
            ``"head"``   one fp32 scale per sequence and K/V row, set once (a per-head-scaled 8-bit layout);
                         tokens leave the residual window one at a time.
            A K/V row is one kv head of K or of V (``2 · H_kv`` rows per token; 2 for MLA).
    """
    config, dtype = resolve_config(config), resolve_dtype(dtype)
    seq_len, batch_size = _token_count("seq_len", seq_len), _token_count("batch_size", batch_size)
    if bits is None and scale_layout != "group":
        raise ValueError(f"scale_layout={scale_layout!r} describes quantized storage; pass bits=8 with it, or drop it.")
    if bits is not None and scale_layout != "group":
        return _per_row_scaled_bytes(config, seq_len, dtype, bits, residual_length, scale_layout) * batch_size
    if bits is not None:
        check_quant_params(bits, group_size, residual_length)
        _check_groups(config, bits, group_size, residual_length)
    elem_bytes = dtype_bytes(dtype)
    total = 0
    for layer in layer_kv_specs(config):
        tokens = stored_tokens(seq_len, layer.window if bits is None else None)
        if bits is None:
            total += tokens * layer.elements_per_token * elem_bytes
            continue
        quantized, residual = quantized_token_split(tokens, group_size, residual_length)
        total += _quantized_bits(quantized * layer.elements_per_token, bits, group_size) // 8
        total += residual * layer.elements_per_token * elem_bytes
    return total * batch_size


_ROW_SCALE_BYTES = {"token": 2, "head": 4}  # fp16 per-token scale; fp32 per-head scale


def _per_row_scaled_bytes(config, seq_len: int, dtype: torch.dtype, bits: int, residual_length: int,
                          layout: str) -> int:
    """One sequence under ``scale_layout="token"`` or ``"head"`` (see ``kv_cache_bytes``)."""
    if layout not in _ROW_SCALE_BYTES:
        raise ValueError(f"scale_layout={layout!r} is unknown; use 'group', 'token' or 'head'.")
    if bits != 8 or residual_length < 0:
        raise ValueError(f"scale_layout={layout!r} stores 8-bit codes with residual_length >= 0; "
                         f"got bits={bits}, residual_length={residual_length}.")
    _check_groups(config, bits, 1, 0)  # no groups: only the layer types can be refused
    rows = 2 if is_mla(config) else 2 * num_kv_heads(config)
    total = 0
    for layer in layer_kv_specs(config):
        tokens = stored_tokens(seq_len, None)  # QuantizedKVCache keeps every token (see the module docstring)
        quantized, residual = quantized_token_split(tokens, 1, residual_length)
        total += quantized * layer.elements_per_token + residual * layer.elements_per_token * dtype_bytes(dtype)
        scaled_tokens = quantized if layout == "token" else min(tokens, 1)  # per-head: one scale set per row
        total += scaled_tokens * rows * _ROW_SCALE_BYTES[layout]
    return total


def kv_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Full-precision bytes per token across all layers (ignoring sliding-window caps)."""
    config, dtype = resolve_config(config), resolve_dtype(dtype)
    return sum(layer.elements_per_token for layer in layer_kv_specs(config)) * dtype_bytes(dtype)


def sparse_view_bytes(config, batch_size: int, sink_tokens: int, window: int, num_draft_tokens: int,
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a streaming view (``SparseKVAssistant(view="streaming")``) holds while one round drafts:
    ``sink_tokens + window`` gathered columns plus ``num_draft_tokens`` scratch tokens at full precision, per row.
    It is dropped after the round, so the configuration's steady memory is the target's cache alone."""
    return kv_cache_bytes(config, sink_tokens + window + num_draft_tokens, batch_size, dtype)


def quantized_view_bytes(config, seq_len: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                         bits: int = 4, group_size: int = 64, residual_length: int = 128, sink_tokens: int = 0) -> int:
    """Bytes of the codes ``SparseKVAssistant(view="quantized")`` keeps *beside* the target's full-precision cache
    (a ``QuantizedKVCache`` shadow of the same ``seq_len`` tokens; its defaults): sinks and residual window in
    ``dtype``, the rest at ``b + 32/G`` bits per element. The configuration holds ``kv_cache_bytes(config, seq_len,
    batch_size, dtype)`` + this, i.e. ``1 + (b + 32/G) / (8 * dtype_bytes)`` of the plain cache for long contexts
    (fp32, b=4, G=64: 1.14x), whereas a plain ``QuantizedKVCache`` holds only this part: exact verification needs
    the full-precision K/V (``speculative/drafters/sparse_kv.py``)."""
    sinks = min(seq_len, sink_tokens)
    return (kv_cache_bytes(config, seq_len - sinks, batch_size, dtype, bits=bits, group_size=group_size,
                           residual_length=residual_length) + kv_cache_bytes(config, sinks, batch_size, dtype))


def parameter_bytes(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Approximate weight bytes of a model built from ``config`` (meta-device init, no allocation)."""
    from transformers import AutoModelForCausalLM

    config, dtype = resolve_config(config), resolve_dtype(dtype)
    with torch.device("meta"):  # shapes only; some modules allocate parameters with bare torch.empty
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes(dtype)


def max_batch_size(
    config,
    seq_len: int,
    budget_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    weight_bytes: int | None = None,
    **quant,
) -> int:
    """Largest batch whose KV cache fits in ``budget_bytes`` after the weights (0 when the weights alone do not fit)."""
    config, dtype = resolve_config(config), resolve_dtype(dtype)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be non-negative.")
    weights = parameter_bytes(config, dtype) if weight_bytes is None else weight_bytes
    per_seq = kv_cache_bytes(config, seq_len, 1, dtype, **quant)
    free = budget_bytes - weights
    return max(0, free // per_seq) if per_seq else 0


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """Parse ``"80GiB"``, ``"80 GB"``, ``"1.5TiB"`` or a plain integer into bytes."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = cleaned[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        value = -1.0
    if not 0 <= value < math.inf:
        raise ValueError(f"Cannot parse a byte size from {text!r}; use e.g. '80GiB', '500MB' or '1048576'.")
    return int(value)


def format_bytes(num: float) -> str:
    """Binary units, e.g. ``1.25 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")
