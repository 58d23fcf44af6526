"""Explicit, idempotent, reversible registration of hf_kvspec's extensions with transformers.

Boundary: the one place that decides *which* extensions ``hf_kvspec.register()`` installs. Each
feature module owns a ``register_*`` / ``unregister_*`` pair; this module only calls them in order.
Nothing is registered at import time.
"""

from __future__ import annotations

import importlib

# (module, register function, unregister function), in registration order
_REGISTRARS: list[tuple[str, str, str]] = [
    ("hf_kvspec.heads.registration", "register_heads", "unregister_heads"),
    ("hf_kvspec.attention.paged", "register_paged_attention", "unregister_paged_attention"),
    ("hf_kvspec.attention.gqa", "register_gqa", "unregister_gqa"),
    ("hf_kvspec.attention.quantized", "register_quantized_attention", "unregister_quantized_attention"),
]


def _call(module: str, function: str) -> None:
    getattr(importlib.import_module(module), function)()


def register() -> None:
    """Register every extension (attention functions + masks, AutoConfig/AutoModel heads). Idempotent."""
    for module, register_fn, _ in _REGISTRARS:
        _call(module, register_fn)


def unregister() -> None:
    """Undo ``register()``; safe to call when nothing is registered. A model still switched to one of the attention
    implementations by an active ``enable_*`` handle is switched back first (its handle removed, with a warning), so
    no model is left running a name that is gone."""
    from hf_kvspec.attention.patch import restore_switched_models

    restore_switched_models("hf_kvspec.unregister()")
    for module, _, unregister_fn in reversed(_REGISTRARS):
        _call(module, unregister_fn)
