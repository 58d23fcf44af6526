"""Which base model a draft head belongs to, and the check that refuses the wrong one.

Boundary: this module describes a base (target) model by a small record (name, revision, content fingerprint,
hidden size, vocabulary size) and compares a record with a live model. It knows nothing about what the heads compute.

A head trained on one model's hidden states is meaningless on another model's, and the failure is silent (it just
never gets accepted), so pairing is checked up front. The fingerprint hashes the architecture fields and a strided
sample of the embedding, LM-head and final-norm weights rounded to bfloat16, so the same weights loaded in fp32 or
bf16 pair, while a different checkpoint of the same architecture does not. It costs milliseconds, not a full hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

_ARCH_FIELDS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size")
_SAMPLE_STRIDE = 997  # prime stride: rows/elements sampled from each fingerprinted tensor


class BaseModelMismatchError(ValueError):
    """A draft head was paired with a base model other than the one it was trained for."""


@dataclass(frozen=True)
class BaseModelRecord:
    """What a head's config remembers about its base model."""

    name_or_path: str | None
    revision: str | None
    fingerprint: str | None
    hidden_size: int
    vocab_size: int

    def to_config_kwargs(self) -> dict:
        return {"base_model_name_or_path": self.name_or_path, "base_model_revision": self.revision,
                "base_model_fingerprint": self.fingerprint, "base_hidden_size": self.hidden_size,
                "base_vocab_size": self.vocab_size}


def require_base_model(model, needed_by: str) -> None:
    """Refuse anything but a loaded model (``None``, a config, a path) before it fails deep inside."""
    if not (isinstance(model, nn.Module) and hasattr(model, "config")):
        raise TypeError(f"{needed_by} needs the loaded base model (a transformers causal LM), got "
                        f"{type(model).__name__}; pass the model itself, not its config or a path.")


def _sample(weight: torch.Tensor) -> bytes:
    flat = weight.detach().reshape(-1)[::_SAMPLE_STRIDE]
    return flat.to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()


def _fingerprinted_tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None:
        tensors.append(output.weight)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if isinstance(getattr(norm, "weight", None), torch.Tensor):
        tensors.append(norm.weight)
    return tensors


def base_model_fingerprint(model: nn.Module) -> str:
    """Short content hash of a causal LM: architecture fields + sampled embedding/LM-head/norm weights."""
    config = model.config.get_text_config()
    digest = hashlib.sha256(json.dumps({f: getattr(config, f, None) for f in _ARCH_FIELDS}, sort_keys=True).encode())
    for tensor in _fingerprinted_tensors(model):
        digest.update(_sample(tensor))
    return "sha256:" + digest.hexdigest()[:32]


def describe_base_model(model: nn.Module, name_or_path: str | None = None,
                        revision: str | None = None) -> BaseModelRecord:
    """Record for a live base model; ``name_or_path`` defaults to ``model.config.name_or_path``."""
    require_base_model(model, "describe_base_model")
    config = model.config.get_text_config()
    return BaseModelRecord(
        name_or_path=name_or_path or getattr(model.config, "name_or_path", None) or None,
        revision=revision,
        fingerprint=base_model_fingerprint(model),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
    )


def check_base_model(head_config, model: nn.Module, strict: bool = True) -> None:
    """Raise ``BaseModelMismatchError`` if ``model`` is not the base model ``head_config`` was trained for.

    Shape mismatches always raise. A fingerprint mismatch (same shapes, other weights) raises when ``strict``.
    """
    require_base_model(model, "head.attach(base_model)")
    text_config = model.config.get_text_config()
    trained_for = head_config.base_model_name_or_path or "an unnamed base model"
    for field, theirs in (("hidden_size", text_config.hidden_size), ("vocab_size", text_config.vocab_size)):
        ours = getattr(head_config, f"base_{field}")
        if ours != theirs:
            raise BaseModelMismatchError(
                f"This {head_config.model_type} head was trained for {trained_for} ({field}={ours}), but the base "
                f"model has {field}={theirs}. Load the head that was trained for this base model, or train one with "
                f"scripts/train_drafter.py --base_model <this model>."
            )
    expected = head_config.base_model_fingerprint
    if strict and expected is not None:
        found = base_model_fingerprint(model)
        if found != expected:
            raise BaseModelMismatchError(
                f"This {head_config.model_type} head was trained for {trained_for} (fingerprint {expected}), but the "
                f"base model's weights differ (fingerprint {found}). Use the matching base model, or pass "
                f"strict=False if you know the weights are equivalent (e.g. re-quantized)."
            )
