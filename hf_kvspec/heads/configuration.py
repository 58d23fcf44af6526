"""Configs of the draft heads (``PreTrainedConfig`` dataclasses), each recording the base model it was trained for.

Boundary: typed data only; the modeling files build modules from these, ``pairing.py`` checks the base-model record.
"""

from __future__ import annotations

import json

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from hf_kvspec.heads.pairing import BaseModelRecord, describe_base_model, require_base_model


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # a bool is an int to Python, not a count to us


def _is_count(value, minimum: int) -> bool:
    return _is_int(value) and value >= minimum


_UNSAVED_BASE_FIELDS = ("architectures", "transformers_version", "auto_map", "dtype", "torch_dtype", "id2label",
                        "label2id")


@strict
class DraftHeadConfig(PreTrainedConfig):
    """Fields shared by every head: the base-model record (see ``hf_kvspec.heads.pairing``)."""

    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    base_model_fingerprint: str | None = None
    base_hidden_size: int = 576
    base_vocab_size: int = 49152
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False  # heads hold no embedding; the base model's is used at run time

    def validate_base_model_record(self):
        """The head's sizes are its base model's: refuse zero/negative ones and the plain names that would be ignored."""
        name = type(self).__name__
        for plain in ("hidden_size", "vocab_size"):
            if getattr(self, plain, None) is not None:
                raise ValueError(f"{name} has no {plain}: a head's width is its base model's, base_{plain}. Pass "
                                 f"base_{plain}=..., or build the config with {name}.for_base_model(model).")
        for field in ("base_hidden_size", "base_vocab_size"):
            if not _is_count(getattr(self, field), 1):
                raise ValueError(f"{name} needs a positive int {field}, got {field}={getattr(self, field)!r}; "
                                 f"{name}.for_base_model(model) fills it from the base model.")

    @property
    def base_model_record(self) -> BaseModelRecord:
        return BaseModelRecord(self.base_model_name_or_path, self.base_model_revision, self.base_model_fingerprint,
                               self.base_hidden_size, self.base_vocab_size)

    @classmethod
    def for_base_model(cls, base_model, name_or_path: str | None = None, revision: str | None = None, **kwargs):
        """A config whose base-model record describes ``base_model`` (a loaded causal LM)."""
        require_base_model(base_model, f"{cls.__name__}.for_base_model")
        record = describe_base_model(base_model, name_or_path, revision)
        return cls(**record.to_config_kwargs(), **kwargs)


def _validate_draft_vocab_size(config) -> None:
    size = config.draft_vocab_size
    if size is not None and not (_is_int(size) and 1 <= size <= config.base_vocab_size):
        raise ValueError(f"{type(config).__name__}.draft_vocab_size must be None (full vocabulary) or an int in "
                         f"1..base_vocab_size={config.base_vocab_size}, got {size!r}.")


@strict
class MedusaConfig(DraftHeadConfig):
    """Medusa-1 heads (Cai et al., arXiv 2401.10774): head k predicts token t+k+1 from the last hidden state at t.

    Args:
        num_heads: number of heads K (draft depth).
        num_layers: residual SiLU blocks per head (at least 1); each block is its own module.
        share_lm_head: project with the base model's (frozen) LM head instead of storing one ``[V, H]`` matrix per head.
    """

    model_type = "hf_kvspec_medusa"

    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True

    def validate_architecture(self):
        for field in ("num_heads", "num_layers"):  # a Medusa head is at least one residual block (2401.10774)
            value = getattr(self, field)
            if not _is_count(value, 1):
                raise ValueError(f"MedusaConfig {field}={value!r}: needs an int, at least 1.")


@strict
class EagleConfig(DraftHeadConfig):
    """EAGLE drafter (Li et al., arXiv 2401.15077; EAGLE-3 feature fusion, arXiv 2503.01840).

    One decoder layer of the base architecture runs over ``fc(concat(embed(token), feature))``; the embedding and
    LM head are the base model's.

    Args:
        base_config: the base model's config as a dict (``config.to_dict()``); the drafter's decoder layer is built
            from it with the base architecture's own decoder-layer class.
        feature_layers: indices into the base model's ``hidden_states`` tuple (0 = embeddings, -1 = final,
            normalised). One entry = EAGLE-1 feature; several = EAGLE-3 fusion through a linear ``fuse`` layer.
        architecture: ``"eagle1"`` (``fc`` over embedding ⊕ fused feature, then a stock decoder layer) or
            ``"eagle3"`` (the EAGLE-3 paper's layer: attention reads ``norm(embedding) ⊕ hidden_norm(fused)``, 2H
            wide, the residual is the fused hidden; the layout vLLM ``speculators`` and SGLang serve).
        norm_before_residual: ``"eagle3"`` only: the residual is the *normalised* fused hidden (a speculators option).
        draft_vocab_size: ``None`` borrows the base LM head; N trains the head's own ``[N, H]`` projection over N
            target tokens, mapped back by the ``d2t`` buffer (EAGLE-3 draft vocabulary, arXiv 2503.01840 §3).
    """

    model_type = "hf_kvspec_eagle"

    base_config: dict | None = None
    feature_layers: list[int] | None = None
    rms_norm_eps: float = 1e-5
    architecture: str = "eagle1"
    norm_before_residual: bool = False
    draft_vocab_size: int | None = None

    def __post_init__(self, **kwargs):
        if self.feature_layers is None:
            self.feature_layers = [-1]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        layers = self.feature_layers
        if not isinstance(layers, list) or not layers or not all(map(_is_int, layers)):
            raise ValueError(f"EagleConfig.feature_layers must be a list naming at least one base-model layer, e.g. "
                             f"[-1], got {layers!r}.")
        depth = (self.base_config or {}).get("num_hidden_layers")
        if isinstance(depth, int) and not all(-(depth + 1) <= i <= depth for i in layers):
            raise ValueError(f"EagleConfig.feature_layers={layers} index the base model's hidden_states tuple "
                             f"({depth + 1} entries: embeddings, then {depth} layers): use indices in "
                             f"{-(depth + 1)}..{depth}.")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"EagleConfig.rms_norm_eps must be a positive float, got {self.rms_norm_eps!r}.")
        if self.architecture not in ("eagle1", "eagle3"):
            raise ValueError(f"EagleConfig.architecture must be 'eagle1' or 'eagle3', got {self.architecture!r}.")
        if self.norm_before_residual and self.architecture != "eagle3":
            raise ValueError("EagleConfig.norm_before_residual belongs to the 'eagle3' layer; set "
                             "architecture='eagle3' or drop it.")
        _validate_draft_vocab_size(self)

    @classmethod
    def for_base_model(cls, base_model, name_or_path: str | None = None, revision: str | None = None, **kwargs):
        require_base_model(base_model, "EagleConfig.for_base_model")
        text_config = base_model.config.get_text_config()
        base = {k: v for k, v in text_config.to_dict().items() if not k.startswith("_") and k not in _UNSAVED_BASE_FIELDS}
        base = json.loads(json.dumps(base))  # exactly what config.json will hold, so a reload compares equal
        kwargs.setdefault("rms_norm_eps", getattr(text_config, "rms_norm_eps", 1e-5))
        return super().for_base_model(base_model, name_or_path, revision, base_config=base, **kwargs)

    @property
    def num_feature_layers(self) -> int:
        return len(self.feature_layers)
