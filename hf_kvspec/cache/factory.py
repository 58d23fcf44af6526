"""Build a cache from a short name (the CLI's ``--cache`` choices).

Boundary: maps names to cache constructors; knows nothing about generation. Each cache family adds
its names to ``CACHE_CHOICES`` and a branch to ``make_cache``.
"""

from __future__ import annotations

CACHE_CHOICES: tuple[str, ...] = ("dynamic", "paged", "kivi4", "kivi2", "int8", "fp8")

# quantized names -> QuantizedKVCache settings (KIVI-2 uses the paper's group 32; residual 128 for both)
_QUANTIZED: dict[str, dict] = {
    "kivi4": dict(method="kivi", bits=4, group_size=64, residual_length=128),
    "kivi2": dict(method="kivi", bits=2, group_size=32, residual_length=128),
    "int8": dict(method="int8"),
    "fp8": dict(method="fp8"),
}


def make_cache(name: str, config, max_tokens: int | None = None, batch_size: int = 1):
    """A fresh, empty cache called ``name`` for a model with ``config``.

    ``max_tokens`` (prompt + new tokens per row) sizes the page pool of ``"paged"`` to the request: one block
    table of ``ceil(max_tokens / block_size)`` blocks per row plus one spare block. Without it the pool takes
    ``PagedCache``'s default budget (a quarter of the free memory), which suits a server, not one CLI call.
    """
    if name == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=config)
    if name == "paged":
        from hf_kvspec.cache.paged import DEFAULT_BLOCK_SIZE, PagedCache

        if max_tokens is None:
            return PagedCache(config)
        if max_tokens < 1 or batch_size < 1:
            raise ValueError(f"max_tokens ({max_tokens}) and batch_size ({batch_size}) must be positive.")
        return PagedCache(config, num_blocks=batch_size * -(-max_tokens // DEFAULT_BLOCK_SIZE) + 1)
    if name in _QUANTIZED:
        from hf_kvspec.cache.quantized import QuantizedKVCache

        return QuantizedKVCache(config, **_QUANTIZED[name])
    raise ValueError(f"Unknown cache {name!r}; choose one of {', '.join(CACHE_CHOICES)}.")


def enable_cache_attention(name: str, model):
    """Switch ``model`` to the attention that reads cache ``name`` natively, if there is one.

    Quantized caches get ``kvspec_quant`` (scores and outputs from the stored codes, no dequantized history).
    Call it before ``make_cache``: a cache pairs with the attention the model runs when it is built.
    Returns the patch (``.remove()`` restores the previous attention) or None when the cache needs no switch.
    """
    if name in _QUANTIZED:
        from hf_kvspec.attention.quantized import enable_quantized_attention

        return enable_quantized_attention(model)
    if name not in CACHE_CHOICES:
        raise ValueError(f"Unknown cache {name!r}; choose one of {', '.join(CACHE_CHOICES)}.")
    return None


def cache_nbytes(cache) -> int:
    """Bytes a cache actually stores: its own ``nbytes()`` when it has one, else the sum over its tensors."""
    own = getattr(cache, "nbytes", None)
    if callable(own):
        return int(own())
    total = 0
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and hasattr(tensor, "nbytes"):
                total += tensor.nbytes
    return total
