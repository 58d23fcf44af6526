"""Who runs a model's forward in a decode loop: the reference (the model's own forward) or the fast forward.

Boundary: one object per model and call, chosen once (``choose_forward``) and passed to whoever needs a forward
(``speculative_generate``'s prefill and verify forwards, plain decoding through the same loop, a draft model, a
quantized drafter, the engine's packed forward through ``FastForward.run`` with its own attention); the model
itself is never changed. Packing is ``packed.py``, the math ``program.py``, attention over
the cache ``attend.py``.

    forward = choose_forward(model, fast=None)   # None: fast where it applies and pays, True: fast or an error
    logits, features, cache = forward(inputs, cache, feature_layers)

``inputs`` are the model kwargs the loop builds (``input_ids``, ``position_ids``, ``attention_mask``,
``logits_to_keep``). The fast forward applies to fp32 Llama-family decoders on CPU (``packed.unsupported_reason``)
with a ``DynamicCache`` (or none yet); a call with another cache runs the reference. Its packed weights (about
the model's size) are built at the first need per model, kept while the weights are unchanged, and reported
with the time packing took (``report``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_kvspec.forward import program
from hf_kvspec.forward.attend import CacheAttention
from hf_kvspec.forward.capture import FeatureCapture
from hf_kvspec.forward.packed import PackedModel, fp32_projection, pack, unsupported_reason

#: under ``fast=None`` smaller models keep the reference: their steps are bound by per-op overhead, not weight
#: reads, and tiny test models keep the reference's exact rounding (the same threshold as the decode kernels)
MIN_LINEAR_ELEMENTS = 1 << 16
#: the packed copies may take at most this fraction of the memory available when they are built
MEMORY_FRACTION = 0.5

_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {weight format: PackedModel}
_LOCK = threading.Lock()


class EagerForward:
    """The reference: ``model(**inputs)`` on the cache, features captured with hooks (``FeatureCapture``)."""

    name = "eager"

    def __init__(self, model: nn.Module):
        self.model = model

    @staticmethod
    def supports(cache) -> bool:
        return True

    def __call__(self, inputs: dict, cache, feature_layers: Sequence[int] | None = None):
        """-> (logits [B, K, V], features [B, T, C] | None, the cache the forward used)."""
        if feature_layers is None:
            out, features = self.model(**inputs, cache=cache, use_cache=True), None
        else:
            with FeatureCapture(self.model, feature_layers) as capture:
                out = self.model(**inputs, cache=cache, use_cache=True)
            features = capture.features()
        return out.logits, features, out.cache if cache is None else cache

    def report(self) -> dict:
        return {"forward": self.name}


class FastForward:
    """The fast forward (``program.forward``) over the model's packed weights; same call as ``EagerForward``.

    ``weights``: ``"fp32"`` (the model's values: same results up to rounding) or a lossy quantized copy
    (``"int8"``, ``"int4"``: ``quantized.py``), which only a drafter uses (the target verifies its guesses)."""

    name = "fast"

    def __init__(self, model: nn.Module, weights: str = "fp32"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fast_forward=True does not apply to this model: {reason}. Use fast_forward=None "
                             "(fast where it applies) or False (the reference).")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {tuple(WEIGHT_FORMATS)}, got {weights!r}")
        self.model, self.weights = model, weights
        self.packed, self.pack_s = packed_weights(model, weights)

    @staticmethod
    def supports(cache) -> bool:
        """A ``DynamicCache`` of full-attention layers, or no cache yet (the first forward makes one)."""
        return cache is None or (type(cache) is DynamicCache
                                 and all(type(layer) is DynamicLayer for layer in cache.layers))

    def __call__(self, inputs: dict, cache, feature_layers: Sequence[int] | None = None):
        """-> (logits [B, K, V], features [B, T, C] | None, the cache)."""
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        input_ids = inputs["input_ids"]  # [B, T]
        positions = inputs.get("position_ids")
        if positions is None:
            start = cache.get_seq_length()
            positions = torch.arange(start, start + input_ids.shape[1]).expand(input_ids.shape[0], -1)
        # inference mode skips autograd's view and version bookkeeping (measured: ~2-4 ms of a ~28 ms step under
        # no_grad); the cache's buffers become inference tensors, which later forwards read and our appends write
        # inside inference mode again; the results handed back are ordinary tensors (cloned)
        with torch.inference_mode():
            attend = CacheAttention(cache, inputs.get("attention_mask"), input_ids.shape[1], self.packed.dims.scaling)
            logits, features = self.run(input_ids, positions, attend, inputs.get("logits_to_keep") or 0,
                                        feature_layers)
        return logits.clone(), None if features is None else features.clone(), cache

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: program.Attend,
            logits_to_keep: int | torch.Tensor = 0, feature_layers: Sequence[int] | None = None):
        """The program with a caller's attention (the engine's over its paged cache): ``program.forward``."""
        return program.forward(self.packed, input_ids, position_ids, attend, logits_to_keep, feature_layers)

    @property
    def scaling(self) -> float:
        return self.packed.dims.scaling

    def report(self) -> dict:
        return {"forward": self.name, "weights": self.weights, "packed_bytes": self.packed.bytes_held(),
                "pack_s": self.pack_s}


def choose_forward(model: nn.Module, fast: bool | None = None) -> EagerForward | FastForward:
    """``fast=None``: the fast forward where it applies and pays (``fast_forward_applies``), else the reference;
    ``True``: the fast forward or a ``ValueError`` naming why not; ``False``: the reference."""
    if fast is not None and not isinstance(fast, bool):
        raise TypeError(f"fast_forward must be True, False or None (auto), got {fast!r}")
    if fast is False or (fast is None and not fast_forward_applies(model)):
        return EagerForward(model)
    return FastForward(model)


def kernels_apply(model: nn.Module) -> bool:
    """True when the decode kernels (``hf_kvspec.kernels``) can help ``model``'s few-row linear calls: fp32
    weights on CPU, not being compiled. Decided here, beside the fast forward's rule, so that a call that does not
    use the kernels never imports them."""
    weight = next(model.parameters(), None)
    return (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and not torch.compiler.is_compiling())


def fast_forward_applies(model: nn.Module) -> bool:
    """True when ``fast=None`` picks the fast forward: a supported model whose linear layers are large enough
    for weight reads to bound a step, not being compiled, with room for the packed copy."""
    if torch.compiler.is_compiling() or unsupported_reason(model) is not None:
        return False
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if max((m.weight.numel() for m in linears), default=0) < MIN_LINEAR_ELEMENTS:
        return False
    return model in _PACKED or _linear_bytes(linears) <= MEMORY_FRACTION * _available_bytes()


def packed_weights(model: nn.Module, weights: str = "fp32") -> tuple[PackedModel, float]:
    """The model's packed copy in ``weights`` format (built at the first need, rebuilt when a weight changed) and
    the seconds this call spent packing (0 when it was current)."""
    with _LOCK:
        copies = _PACKED.setdefault(model, {})
        packed = copies.get(weights)
        if packed is not None and packed.current(model):
            return packed, 0.0
        copies.pop(weights, None)  # a stale copy goes before the new one is built
        start = time.perf_counter()
        packed = copies[weights] = pack(model, WEIGHT_FORMATS[weights]())
        return packed, time.perf_counter() - start


def release_packed_weights(model: nn.Module) -> int:
    """Free the fast forward's packed copies of ``model`` (every format); returns the bytes freed."""
    with _LOCK:
        copies = _PACKED.pop(model, {})
    return sum(packed.bytes_held() for packed in copies.values())


def _fp32_maker():
    return fp32_projection


def _quantized_maker(bits: int):
    def maker():
        from hf_kvspec.forward.quantized import QuantizedLinear

        return lambda *linears: QuantizedLinear.of(*linears, bits=bits)

    return maker


#: weight format -> a function giving the ``LinearMaker`` that packs it (quantized ones import their kernels lazily)
WEIGHT_FORMATS = {"fp32": _fp32_maker, "int8": _quantized_maker(8), "int4": _quantized_maker(4)}


def _linear_bytes(linears: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in linears for p in m.parameters(recurse=False))


def _available_bytes() -> int:
    from hf_kvspec.kernels.copies import available_bytes

    return available_bytes()
