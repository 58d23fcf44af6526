"""Former home of the fused quantized attention, now ``hf_kvspec.attention.quantized``; this module only re-exports.

Boundary: names only. ``hf_kvspec.enable_quantized_attention`` still resolves here, as do callers that import
``ATTN_NAME`` from this path; new code imports ``hf_kvspec.attention.quantized``.
"""

from __future__ import annotations

from hf_kvspec.attention.quantized import ATTN_NAME, enable_quantized_attention

__all__ = ["ATTN_NAME", "enable_quantized_attention"]
