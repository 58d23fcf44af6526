"""Export a trained head in the layouts serving engines load: vLLM ``speculators`` (EAGLE-3), SGLang (EAGLE-3) and
vLLM's Medusa model.

Boundary: renames and re-packs a head's tensors and writes a ``config.json`` + ``model.safetensors`` directory; no
training, no drafting. Reading those layouts back is ``import_formats.py``. Names checked against the projects'
sources (2025): ``speculators`` ``Eagle3SpeculatorConfig`` / ``Eagle3DraftModel`` (``fc``, ``layers.0.*`` with
``hidden_norm``, ``norm``, ``lm_head``, ``d2t``, ``t2d``); SGLang ``LlamaForCausalLMEagle3`` (the same tensors under
``midlayer.*``; ``fc`` is fixed at 3 target layers); vLLM ``Medusa`` (``blocks.{k}.layers.{j}``, ``lm_heads.{k}``,
config ``model_type="medusa"``).

Feature-layer indices. Ours index the base model's ``hidden_states`` tuple (0 = embeddings, i = output of decoder
layer i-1). vLLM and ``speculators`` capture the residual stream *entering* layer k for
``eagle_aux_hidden_state_layer_ids`` k: the same index. SGLang captures ``k + 1`` for an explicit id k
(``set_eagle3_layers_to_capture``), so its ids are ours minus one. Neither engine can hand over the embeddings
(index 0) or the final normalised state (index L or -1), so such heads are refused.

What cannot be expressed is refused with ``HeadExportError`` naming the difference: our ``"eagle1"`` layer (fc with
bias, a stock layer *with* its input norm, a final norm) is not vLLM's/SGLang's EAGLE-1 layout (fc without bias, no
input norm on layer 0, no final norm), nor EAGLE-3's; Medusa has no SGLang or ``speculators`` model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMATS = ("speculators", "sglang", "vllm-medusa")
SPECULATORS_VERSION = "0.9.0"  # the release whose config classes the tests validate against


class HeadExportError(ValueError):
    """The head cannot be expressed in the requested serving layout; the message says what differs."""


# ---------------------------------------------------------------------------------------------- entry point
def export_head(head, fmt: str, out_dir: str | Path, base_model=None, speculative_tokens: int = 5) -> Path:
    """Write ``head`` (an ``EagleHead`` / ``MedusaHeads``, or a directory one loads from) in layout ``fmt``.

    ``base_model`` supplies the LM head a head borrows (the serving layouts store their own); without it the
    head must already be attached. Returns ``out_dir``.
    """
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    if fmt not in FORMATS:
        raise HeadExportError(f"format must be one of {FORMATS}, got {fmt!r}.")
    if isinstance(head, (str, Path)):
        head = _load_head(Path(head))
    if base_model is not None:
        head.attach(base_model)
    out = Path(out_dir)
    if isinstance(head, MedusaHeads):
        if fmt != "vllm-medusa":
            raise HeadExportError(f"a Medusa head has no {fmt} layout ({fmt} serves EAGLE heads only); use "
                                  "--format vllm-medusa.")
        config, tensors = medusa_to_vllm(head)
    elif isinstance(head, EagleHead):
        config, tensors = eagle_export(head, fmt, speculative_tokens)
    else:
        raise HeadExportError(f"export_head takes an EagleHead or MedusaHeads, got {type(head).__name__}.")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _load_head(path: Path):
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    classes = {"hf_kvspec_eagle": EagleHead, "hf_kvspec_medusa": MedusaHeads}
    if model_type not in classes:
        raise HeadExportError(f"{path} holds no hf_kvspec head (model_type={model_type!r}); train one with "
                              "scripts/train_drafter.py.")
    return classes[model_type].from_pretrained(path).eval()


def _borrowed_lm_head(head, fmt: str) -> torch.Tensor:
    if not head.is_attached:
        raise HeadExportError(f"the {fmt} layout stores the LM head this head borrows; pass base_model= (CLI: "
                              f"--base_model {head.config.base_model_name_or_path or '<path>'}).")
    return head.borrowed().lm_head.weight


# ---------------------------------------------------------------------------------------------- EAGLE-3
def eagle_export(head, fmt: str, speculative_tokens: int = 5) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, tensors) of an ``architecture="eagle3"`` head in the ``speculators`` or SGLang layout."""
    config = head.config
    refusal = eagle_refusal(config, fmt)
    if refusal:
        raise HeadExportError(refusal)
    depth = config.base_config["num_hidden_layers"]
    layers = [i % (depth + 1) for i in config.feature_layers]  # negative indices -> 0..L
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    tensors = {"fc.weight": head.fuse.weight, "norm.weight": head.norm.weight,
               prefix + "hidden_norm.weight": head.hidden_norm.weight}
    tensors.update({prefix + name: value for name, value in head.layer.state_dict().items()})
    tensors["lm_head.weight"] = head.lm_head.weight if head.lm_head is not None else _borrowed_lm_head(head, fmt)
    if head.has_draft_vocab:
        tensors.update(d2t=head.d2t, t2d=head.t2d)
    draft_vocab = config.draft_vocab_size or config.base_vocab_size
    layer_fields = _layer_config_dict(config)
    if fmt == "sglang":
        return {**layer_fields, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
                                 "use_aux_hidden_state": True}}, tensors
    return speculators_config(config, layer_fields, layers, draft_vocab, speculative_tokens), tensors


def eagle_refusal(config, fmt: str) -> str | None:
    """Why ``config`` has no ``fmt`` layout, or None."""
    if fmt == "vllm-medusa":
        return "an EAGLE head has no vLLM Medusa layout; use --format speculators or sglang."
    if config.architecture != "eagle3":
        return ("this head uses our 'eagle1' layer: fc(embed ⊕ feature) with a bias, a stock decoder layer that "
                "keeps its input_layernorm, and a final norm before the LM head. vLLM's and SGLang's EAGLE-1 layout "
                "has fc without bias, no input norm on layer 0 and no final norm; their EAGLE-3 layout needs "
                "attention over norm(embed) ⊕ hidden_norm(fused). Retrain with --architecture eagle3 to export.")
    depth = config.base_config["num_hidden_layers"]
    layers = [i % (depth + 1) for i in config.feature_layers]
    if not all(1 <= i < depth for i in layers):
        return (f"feature_layers {config.feature_layers} include the embeddings (0) or the final normalised "
                f"state ({depth} / -1), which vLLM and SGLang cannot capture; use layers in 1..{depth - 1}.")
    if len(layers) < 2:
        return "EAGLE-3 layouts fuse several target layers through fc; this head reads one. Use 3 feature layers."
    model_type = config.base_config.get("model_type")
    if fmt == "sglang":
        if len(layers) != 3:
            return f"SGLang's LlamaForCausalLMEagle3 fuses exactly 3 target layers (fc is 3H wide); this head has {len(layers)}."
        if config.norm_before_residual:
            return "SGLang's EAGLE-3 layer keeps the un-normalised residual; this head has norm_before_residual=True."
        if model_type != "llama":
            return f"SGLang's LlamaForCausalLMEagle3 builds a Llama layer; this head's layer is {model_type!r}."
    elif model_type not in ("llama", "qwen3"):
        return f"speculators builds EAGLE-3 layers for llama and qwen3; this head's layer is {model_type!r}."
    return None


def _layer_config_dict(config) -> dict:
    fields = {k: v for k, v in config.base_config.items() if k not in ("architectures", "auto_map")}
    fields["num_hidden_layers"] = 1
    if isinstance(fields.get("layer_types"), list):
        fields["layer_types"] = fields["layer_types"][:1]
    return fields


def speculators_config(config, layer_fields: dict, layers: list[int], draft_vocab: int,
                       speculative_tokens: int) -> dict:
    """``Eagle3SpeculatorConfig`` as JSON (field names as in speculators' ``config.py`` / ``eagle3/config.py``)."""
    verifier = config.base_model_name_or_path
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(config.base_config.get("architectures")
                                                                         or [])},
        },
        "transformer_layer_config": layer_fields,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": bool(config.norm_before_residual),
        "target_hidden_size": config.base_hidden_size,
        "eagle_aux_hidden_state_layer_ids": layers,
    }


# ---------------------------------------------------------------------------------------------- Medusa
def medusa_to_vllm(heads) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) in vLLM's Medusa layout: ``blocks.{k}.layers.{j}.{weight,bias}``, ``lm_heads.{k}.weight``
    (one shared ``lm_heads.0`` with ``original_lm_head`` when the heads borrow the base LM head)."""
    config = heads.config
    tensors = {}
    for k, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            tensors[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            tensors[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
        if not config.share_lm_head:
            tensors[f"lm_heads.{k}.weight"] = head.lm_head.weight
    if config.share_lm_head:
        tensors["lm_heads.0.weight"] = _borrowed_lm_head(heads, "vllm-medusa")
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.base_hidden_size,
            "vocab_size": config.base_vocab_size, "truncated_vocab_size": config.base_vocab_size,
            "num_heads": config.num_heads, "num_hidden_layers": config.num_layers, "medusa_fc_bias": True,
            "original_lm_head": bool(config.share_lm_head), "max_paths": 64, "topk": 10,
            "base_model_name_or_path": config.base_model_name_or_path}, tensors
