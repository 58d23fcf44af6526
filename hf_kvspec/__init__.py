"""hf_kvspec: paged and quantized KV caches, GQA/MLA attention patches and exact speculative decoding
for Hugging Face transformers, through its public extension points.

Importing the package has no side effects and imports nothing heavy: public names resolve lazily on
first access. Registration with transformers is explicit: call ``hf_kvspec.register()``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (resolved on first attribute access, PEP 562)
_EXPORTS: dict[str, str] = {
    # foundation
    "load_bundled_model": "hf_kvspec.models",
    "BundledModelNotInstalledError": "hf_kvspec.models",
    "kv_cache_bytes": "hf_kvspec.memory",
    "register": "hf_kvspec.registry",
    "unregister": "hf_kvspec.registry",
    # draft heads
    "MedusaHeads": "hf_kvspec.heads.modeling_medusa",
    "MedusaConfig": "hf_kvspec.heads.configuration",
    "EagleHead": "hf_kvspec.heads.modeling_eagle",
    "EagleDrafter": "hf_kvspec.heads.modeling_eagle",  # deprecated name of EagleHead
    "EagleConfig": "hf_kvspec.heads.configuration",
    "ExitAdapter": "hf_kvspec.heads.modeling_exit",
    "ExitAdapterConfig": "hf_kvspec.heads.configuration_exit",
    "BaseModelMismatchError": "hf_kvspec.heads.pairing",
    "load_bundled_heads": "hf_kvspec.heads.bundled",
    # evaluate metric modules (draft acceptance, cache fidelity)
    "load_metric": "hf_kvspec.metrics",
    # paged KV cache
    "PagedCache": "hf_kvspec.cache.paged",
    "BlockPool": "hf_kvspec.cache.block_pool",
    "OutOfBlocksError": "hf_kvspec.cache.block_pool",
    # quantized KV cache
    "QuantizedKVCache": "hf_kvspec.cache.quantized",
    "enable_quantized_attention": "hf_kvspec.attention.quantized",
    # attention patches
    "enable_gqa": "hf_kvspec.attention.gqa",
    "enable_mla_absorb": "hf_kvspec.attention.mla",
    "AttentionPatch": "hf_kvspec.attention.patch",
    "UnsupportedMLAError": "hf_kvspec.attention.mla_weights",
    # CPU decode kernels
    "DecodeKernels": "hf_kvspec.kernels.linear",
    "decode_kernels": "hf_kvspec.kernels.linear",
    "release_decode_kernels": "hf_kvspec.kernels.linear",
    # the fast forward
    "choose_forward": "hf_kvspec.forward.runner",
    "FastForward": "hf_kvspec.forward.runner",
    "release_packed_weights": "hf_kvspec.forward.runner",
    # speculative decoding
    "speculative_generate": "hf_kvspec.speculative.loop",
    "SpeculativeGenerateOutput": "hf_kvspec.speculative.output",
    "enable": "hf_kvspec.speculative.enable",
    "disable": "hf_kvspec.speculative.enable",
    "Assistant": "hf_kvspec.speculative.drafters.base",
    "Drafter": "hf_kvspec.speculative.drafters.base",  # deprecated name of Assistant
    "DraftContext": "hf_kvspec.speculative.drafters.base",
    "DraftProposal": "hf_kvspec.speculative.drafters.base",
    "RoundOutcome": "hf_kvspec.speculative.drafters.base",
    "DraftModelAssistant": "hf_kvspec.speculative.drafters.draft_model",
    "NgramAssistant": "hf_kvspec.speculative.drafters.ngram",
    "SuffixAssistant": "hf_kvspec.speculative.drafters.suffix",
    "SuffixPool": "hf_kvspec.speculative.suffix_pool",
    "QuantizedSelfAssistant": "hf_kvspec.speculative.drafters.quantized_self",
    "LookaheadAssistant": "hf_kvspec.speculative.drafters.lookahead",
    "MedusaAssistant": "hf_kvspec.speculative.drafters.medusa",
    "EagleAssistant": "hf_kvspec.speculative.drafters.eagle",
    "EarlyExitAssistant": "hf_kvspec.speculative.drafters.early_exit",
    "LayerSkipAssistant": "hf_kvspec.speculative.drafters.layer_skip",
    "SparseKVAssistant": "hf_kvspec.speculative.drafters.sparse_kv",
    "StreamingView": "hf_kvspec.cache.views",
    "AcceptanceStats": "hf_kvspec.speculative.stats",
    "truncated_draft": "hf_kvspec.speculative.drafters.truncated",
    "make_assistant": "hf_kvspec.speculative.assistants",
    # continuous batching
    "Engine": "hf_kvspec.serving.engine",
    "RequestTooLongError": "hf_kvspec.serving.request",
    "RequestFailedError": "hf_kvspec.serving.request",
    "TokenLogprob": "hf_kvspec.serving.logprobs",
    "GrammarLogitsProcessor": "hf_kvspec.grammar",
    "SchedulingPolicy": "hf_kvspec.serving.scheduler",
}

_DEPRECATED = {"Drafter", "EagleDrafter"}  # importable for old code, left out of ``import *``
__all__ = [*sorted(set(_EXPORTS) - _DEPRECATED), "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_kvspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__():
    return __all__
