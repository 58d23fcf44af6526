"""Load heads trained elsewhere into our classes: vLLM ``speculators`` EAGLE-3, SGLang / the EAGLE repo's EAGLE-3
layout (``LlamaForCausalLMEagle3``, ``midlayer.*``; SpecForge writes it too) and vLLM's Medusa layout.

Boundary: reads a directory (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``) and returns an
attached ``EagleHead`` / ``MedusaHeads``; the inverse of ``export.py``, whose docstring explains the names and
the feature-layer index conventions. Drafting with the result is ``generate(assistant=...)`` as for our own heads.

A head is rebuilt from the *base model's* config (its layer class and sizes), with the serving config's layer
fields laid over it, so a checkpoint whose shapes disagree with the base model fails loudly at ``load_state_dict``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_kvspec.heads.export import HeadExportError


class HeadImportError(HeadExportError):
    """The directory holds no layout we read, or its tensors disagree with its config."""


def import_head(path: str | Path, base_model, name_or_path: str | None = None):
    """The head stored at ``path`` in a serving layout, as an attached ``EagleHead`` or ``MedusaHeads``."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = _read_tensors(path)
    name = name_or_path or (config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
                            or config.get("base_model_name_or_path"))
    if config.get("speculators_model_type") == "eagle3":
        layer = config["transformer_layer_config"]
        layers = config.get("eagle_aux_hidden_state_layer_ids")
        return _eagle3(tensors, "layers.0.", layer, layers, config.get("norm_before_residual", False), base_model,
                       name)
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = None if ids is None else [i + 1 for i in ids]  # SGLang captures id + 1 (see export.py)
        return _eagle3(tensors, "midlayer.", config, layers, False, base_model, name)
    if config.get("model_type") == "medusa":
        return _medusa(tensors, config, base_model, name)
    raise HeadImportError(f"{path}: config.json is not a speculators EAGLE-3, LlamaForCausalLMEagle3 or vLLM Medusa "
                          "config (EAGLE-1 layouts are not read: their layer has no input norm and no final norm, "
                          "which our 'eagle1' layer keeps).")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    if (path / "pytorch_model.bin").is_file():  # the EAGLE repo's releases
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise HeadImportError(f"{path} has no *.safetensors or pytorch_model.bin.")


def _default_layers(base_model) -> list[int]:
    depth = base_model.config.get_text_config().num_hidden_layers
    return [2, depth // 2, depth - 3]  # what vLLM, SGLang and the EAGLE repo capture when the config names none


def _eagle3(tensors, prefix, layer_fields, layers, norm_before_residual, base_model, name):
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.modeling_eagle import EagleHead

    base_lm_head = base_model.get_output_embeddings().weight
    lm_head = tensors["lm_head.weight"]
    own_head = "d2t" in tensors or not (lm_head.shape == base_lm_head.shape and torch.equal(
        lm_head.to(base_lm_head.dtype), base_lm_head.detach().cpu()))
    config = EagleConfig.for_base_model(base_model, name, feature_layers=list(layers or _default_layers(base_model)),
                                        architecture="eagle3", norm_before_residual=bool(norm_before_residual),
                                        draft_vocab_size=lm_head.shape[0] if own_head else None)
    skip = {"architectures", "auto_map", "num_hidden_layers", "layer_types", "model_type", "eagle_config",
            "draft_vocab_size", "vocab_size", "torch_dtype", "dtype", "transformers_version"}
    config.base_config.update({k: v for k, v in layer_fields.items() if k in config.base_config and k not in skip})
    state = {"fuse.weight": tensors["fc.weight"], "norm.weight": tensors["norm.weight"]}
    for key, value in tensors.items():
        if key.startswith(prefix):
            inner = key[len(prefix):]
            state["hidden_norm.weight" if inner == "hidden_norm.weight" else "layer." + inner] = value
    if own_head:
        state["lm_head.weight"] = lm_head
        vocab = lm_head.shape[0]
        state["d2t"] = tensors.get("d2t", torch.zeros(vocab, dtype=torch.long))
        state["t2d"] = tensors.get("t2d", torch.ones(config.base_vocab_size, dtype=torch.bool))
    head = EagleHead(config).to(lm_head.dtype)
    _load(head, state)
    return head.eval().attach(base_model, strict=False)


def _medusa(tensors, config, base_model, name):
    from hf_kvspec.heads.configuration import MedusaConfig
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    num_heads, num_layers = config["num_heads"], config["num_hidden_layers"]
    base_lm_head = base_model.get_output_embeddings().weight.detach().cpu()
    shared = config.get("original_lm_head", False)
    heads_w = [tensors["lm_heads.0.weight" if shared else f"lm_heads.{k}.weight"] for k in range(num_heads)]
    borrow = shared and heads_w[0].shape == base_lm_head.shape and torch.equal(heads_w[0].to(base_lm_head.dtype),
                                                                               base_lm_head)
    head = MedusaHeads(MedusaConfig.for_base_model(base_model, name, num_heads=num_heads, num_layers=num_layers,
                                                   share_lm_head=borrow)).to(heads_w[0].dtype)
    state = {}
    for k in range(num_heads):
        for j in range(num_layers):
            weight = tensors[f"blocks.{k}.layers.{j}.weight"]
            state[f"heads.{k}.blocks.{j}.linear.weight"] = weight
            state[f"heads.{k}.blocks.{j}.linear.bias"] = tensors.get(f"blocks.{k}.layers.{j}.bias",
                                                                     torch.zeros(weight.shape[0], dtype=weight.dtype))
        if not borrow:
            state[f"heads.{k}.lm_head.weight"] = heads_w[k]
    _load(head, state)
    return head.eval().attach(base_model, strict=False)


def _load(head, state: dict[str, torch.Tensor]) -> None:
    expected = head.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    bad = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or extra or bad:
        raise HeadImportError(f"tensors disagree with the rebuilt {type(head).__name__}: missing {missing}, "
                              f"unexpected {extra}, shape mismatches {sorted(bad)} (is the base model the head's?).")
    head.load_state_dict(state, strict=True)
