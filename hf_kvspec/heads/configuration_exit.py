"""Config of the early-exit adapter (``ExitAdapter``): which base layer it reads and how wide its MLP is.

Boundary: typed data only; ``modeling_exit.py`` builds the module, ``pairing.py`` checks the base-model record (the
fields shared with the other heads come from ``DraftHeadConfig``).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from hf_kvspec.heads.configuration import DraftHeadConfig, _is_count
from hf_kvspec.heads.pairing import require_base_model


@strict
class ExitAdapterConfig(DraftHeadConfig):
    """An exit adapter for self-speculation (Kangaroo, Liu et al. arXiv 2404.18911), base model frozen.

    Args:
        exit_layer: E, the number of base decoder layers that draft; the adapter reads their output (the input of
            layer E, ``hidden_states[E]``) and feeds the base model's final norm and LM head. 1 <= E < L: at E = L
            the full model drafts for itself (and transformers' ``hidden_states[L]`` is already normalised).
        base_num_layers: the base model's decoder depth L (checked again on attach).
        intermediate_size: width of the adapter's gated MLP.
        rms_norm_eps: epsilon of the adapter's input RMSNorm.
    """

    model_type = "hf_kvspec_exit_adapter"

    exit_layer: int = 8
    base_num_layers: int = 30
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5

    def validate_architecture(self):
        if not (_is_count(self.base_num_layers, 1) and _is_count(self.exit_layer, 1)
                and self.exit_layer < self.base_num_layers):
            raise ValueError(f"ExitAdapterConfig needs ints 1 <= exit_layer < base_num_layers, got exit_layer="
                             f"{self.exit_layer!r}, base_num_layers={self.base_num_layers!r}.")
        if not _is_count(self.intermediate_size, 1):
            raise ValueError(f"ExitAdapterConfig.intermediate_size must be a positive int, got "
                             f"{self.intermediate_size!r}.")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"ExitAdapterConfig.rms_norm_eps must be a positive float, got {self.rms_norm_eps!r}.")

    @classmethod
    def for_base_model(cls, base_model, name_or_path: str | None = None, revision: str | None = None, **kwargs):
        require_base_model(base_model, "ExitAdapterConfig.for_base_model")
        text_config = base_model.config.get_text_config()
        kwargs.setdefault("base_num_layers", text_config.num_hidden_layers)
        kwargs.setdefault("intermediate_size", text_config.intermediate_size)
        kwargs.setdefault("rms_norm_eps", getattr(text_config, "rms_norm_eps", 1e-5))
        return super().for_base_model(base_model, name_or_path, revision, **kwargs)
