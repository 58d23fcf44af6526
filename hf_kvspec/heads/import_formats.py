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
    """The head stored at ``path`` in a serving layout, as an attached ``EagleHead`` or ``MedusaHeads``, in float32
    whatever the stored dtype (as ``from_pretrained``; ``.to(dtype)`` after for another). Building it in a stored
    fp16 would round the rotary frequencies of the EAGLE layer to fp16 too, which ``.float()`` cannot undo.
    A directory that is missing, malformed, or exported for another base vocabulary raises ``HeadImportError``
    naming the file and field (before any head is built)."""
    path = Path(path)
    config = _read_config(path)
    tensors = Tensors(_read_tensors(path), path)
    name = name_or_path or (_section(config, "speculators_config", path).get("verifier", {}).get("name_or_path")
                            or config.get("base_model_name_or_path"))
    if config.get("speculators_model_type") == "eagle3":
        layer = _section(config, "transformer_layer_config", path, required=True)
        layers = config.get("eagle_aux_hidden_state_layer_ids")
        return _eagle3(tensors, "layers.0.", layer, layers, config.get("norm_before_residual", False), base_model,
                       name)
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        ids = _section(config, "eagle_config", path).get("eagle_aux_hidden_state_layer_ids")
        layers = None if ids is None else [i + 1 for i in ids]  # SGLang captures id + 1 (see export.py)
        return _eagle3(tensors, "midlayer.", config, layers, False, base_model, name)
    if config.get("model_type") == "medusa":
        return _medusa(tensors, config, base_model, name)
    raise HeadImportError(f"{path}: config.json is not a speculators EAGLE-3, LlamaForCausalLMEagle3 or vLLM Medusa "
                          "config (EAGLE-1 layouts are not read: their layer has no input norm and no final norm, "
                          "which our 'eagle1' layer keeps).")


class Tensors(dict):
    """The directory's tensors by name; a missing one raises ``HeadImportError`` naming it and the directory."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path):
        super().__init__(tensors)
        self.path = path

    def __missing__(self, name: str):
        raise HeadImportError(f"{self.path}: the weights hold no tensor {name!r}, which this layout needs "
                              f"(found {len(self)} tensors; was the export interrupted, or is it another layout?).")


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise HeadImportError(f"{path} is not a directory; pass the directory an export wrote (config.json + "
                              "model.safetensors).")
    file = path / "config.json"
    if not file.is_file():
        raise HeadImportError(f"{file} not found; pass the directory an export wrote (config.json + "
                              "model.safetensors).")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HeadImportError(f"{file} is not valid JSON ({err}); re-export the head.") from None
    if not isinstance(config, dict):
        raise HeadImportError(f"{file} holds a {type(config).__name__}, not a JSON object; re-export the head.")
    return config


def _section(config: dict, key: str, path: Path, required: bool = False) -> dict:
    """``config[key]`` as a dict (``{}`` when absent and not ``required``)."""
    value = config.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        found = "is missing" if value is None else f"is a {type(value).__name__}"
        raise HeadImportError(f"{path / 'config.json'}: {key!r} {found}; this layout needs it as a JSON object "
                              "(re-export the head).")
    return value


def _count_field(config: dict, key: str, path: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " (vLLM's Medusa has at least one block per head)" if key == "num_hidden_layers" else ""
        raise HeadImportError(f"{path / 'config.json'}: {key}={value!r} must be an int >= 1{hint}; re-export the "
                              "head.")
    return value


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors = {}
        for file in files:
            try:
                tensors.update(load_file(str(file)))
            except (SafetensorError, OSError) as err:
                raise HeadImportError(f"{file} cannot be read as safetensors ({err}); re-export the head.") from None
        return tensors
    if (path / "pytorch_model.bin").is_file():  # the EAGLE repo's releases
        try:
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises many types (pickle, zip, runtime); all mean a bad file
            raise HeadImportError(f"{path / 'pytorch_model.bin'} cannot be read ({err}).") from None
    raise HeadImportError(f"{path} has no *.safetensors or pytorch_model.bin.")


def _check_vocab(path: Path, exported: int | None, base_model) -> int:
    """Refuse a head exported for a base vocabulary other than ``base_model``'s; return the base vocabulary."""
    vocab = base_model.config.get_text_config().vocab_size
    if exported is not None and exported != vocab:
        raise HeadImportError(f"{path}: the head was exported for a base vocabulary of {exported} tokens; this base "
                              f"model has {vocab}. Import it onto the model it was trained with.")
    return vocab


def _default_layers(base_model) -> list[int]:
    depth = base_model.config.get_text_config().num_hidden_layers
    return [2, depth // 2, depth - 3]  # what vLLM, SGLang and the EAGLE repo capture when the config names none


def _eagle3(tensors, prefix, layer_fields, layers, norm_before_residual, base_model, name):
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.modeling_eagle import EagleHead

    exported = len(tensors["t2d"]) if "t2d" in tensors else layer_fields.get("vocab_size")
    _check_vocab(tensors.path, exported, base_model)
    base_lm_head = base_model.get_output_embeddings().weight
    lm_head = tensors["lm_head.weight"]
    own_head = "d2t" in tensors or not (lm_head.shape == base_lm_head.shape and torch.equal(
        lm_head.to(base_lm_head.dtype), base_lm_head.detach().cpu()))
    if own_head:
        _check_draft_vocab(tensors, lm_head.shape[0], base_lm_head.shape[0])
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
    head = EagleHead(config)  # float32; load_state_dict casts the stored weights
    _load(head, state)
    return head.eval().attach(base_model, strict=False)


def _medusa(tensors, config, base_model, name):
    from hf_kvspec.heads.configuration import MedusaConfig
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    num_heads, num_layers = (_count_field(config, key, tensors.path) for key in ("num_heads", "num_hidden_layers"))
    shared = config.get("original_lm_head", False)
    heads_w = [tensors["lm_heads.0.weight" if shared else f"lm_heads.{k}.weight"] for k in range(num_heads)]
    _check_vocab(tensors.path, config.get("vocab_size", heads_w[0].shape[0]), base_model)
    unused = sorted(k for k in tensors if k.startswith("blocks.") and not _medusa_block(k, num_heads, num_layers))
    if unused:
        raise HeadImportError(f"{tensors.path}: tensors {unused[:4]} lie beyond num_heads={num_heads} / "
                              f"num_hidden_layers={num_layers} of config.json; fix those fields (re-export).")
    base_lm_head = base_model.get_output_embeddings().weight.detach().cpu()
    borrow = shared and heads_w[0].shape == base_lm_head.shape and torch.equal(heads_w[0].to(base_lm_head.dtype),
                                                                               base_lm_head)
    head = MedusaHeads(MedusaConfig.for_base_model(base_model, name, num_heads=num_heads, num_layers=num_layers,
                                                   share_lm_head=borrow))  # float32, as the EAGLE head
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


def _medusa_block(name: str, num_heads: int, num_layers: int) -> bool:
    """Whether ``blocks.{k}.layers.{j}.*`` names a block inside ``num_heads`` x ``num_layers``."""
    parts = name.split(".")
    return (len(parts) == 5 and parts[2] == "layers" and parts[1].isdigit() and parts[3].isdigit()
            and int(parts[1]) < num_heads and int(parts[3]) < num_layers)


def _check_draft_vocab(tensors: Tensors, rows: int, vocab: int) -> None:
    """An own LM head of ``rows`` outputs: with ``d2t``/``t2d`` they must describe the same ``rows`` target ids;
    without them it must cover the whole base vocabulary."""
    if "d2t" not in tensors:
        if rows != vocab:
            raise HeadImportError(f"{tensors.path}: lm_head.weight has {rows} rows but no d2t/t2d map them to the "
                                  f"base vocabulary of {vocab}; export the head with its draft vocabulary.")
        return
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    ids = torch.arange(len(d2t)) + d2t.long()
    if len(d2t) != rows or t2d.dtype != torch.bool or not torch.equal(ids, torch.nonzero(t2d).flatten()):
        raise HeadImportError(f"{tensors.path}: d2t ({len(d2t)} entries), t2d ({int(t2d.sum())} of {len(t2d)} set) "
                              f"and lm_head.weight ({rows} rows) disagree: d2t[i] + i must list, in order, the "
                              "target ids t2d marks. Re-export the head.")


def _load(head, state: dict[str, torch.Tensor]) -> None:
    expected = head.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    bad = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or extra or bad:
        raise HeadImportError(f"tensors disagree with the rebuilt {type(head).__name__}: missing {missing}, "
                              f"unexpected {extra}, shape mismatches {sorted(bad)} (is the base model the head's?).")
    head.load_state_dict(state, strict=True)
