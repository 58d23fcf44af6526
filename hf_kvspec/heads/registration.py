"""Registering the head configs/models with ``AutoConfig`` / ``AutoModel`` (called by ``hf_kvspec.register()``).

Boundary: only the Auto-class mappings; nothing is registered at import time. ``unregister_heads`` removes exactly
what ``register_heads`` added (through ``hf_kvspec._compat``, since transformers has no public unregister).
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel

from hf_kvspec import _compat
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.configuration_exit import ExitAdapterConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_exit import ExitAdapter
from hf_kvspec.heads.modeling_medusa import MedusaHeads

HEAD_CLASSES = ((MedusaConfig, MedusaHeads), (EagleConfig, EagleHead), (ExitAdapterConfig, ExitAdapter))


def register_heads() -> None:
    """Make ``AutoConfig``/``AutoModel.from_pretrained`` resolve saved heads. Idempotent."""
    for config_class, model_class in HEAD_CLASSES:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)


def unregister_heads() -> None:
    """Remove the heads from the Auto mappings; safe when not registered."""
    for config_class, _ in HEAD_CLASSES:
        _compat.unregister_auto_model(AutoModel, config_class)
        _compat.unregister_auto_config(config_class.model_type)
