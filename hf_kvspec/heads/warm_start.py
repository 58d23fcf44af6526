"""Starting a head's training from a trained head (fine-tuning): ``train_drafter.py --init_from DIR|bundled:KIND``.

Boundary: resolving the source (a saved head directory or a bundled head), checking that it can seed the new head
(same head class, trained for this base model, same tensor names and shapes), and copying its weights. Choosing the
data, the schedule and the draft vocabulary stays with the training script.

The one allowed difference is the draft vocabulary (EAGLE-3 §3, arXiv 2503.01840): a head with ``draft_vocab_size``
set may start from a full-vocabulary head, or from one with another draft size. Its ``lm_head`` / ``d2t`` / ``t2d``
are then left for the script to choose from the training data (``trained_vocab.init_draft_vocab``: the base LM
head's rows), and every other tensor comes from the source. With the same draft size, the source's vocabulary and
projection are kept.

Changing the layout (``across_layouts=True``, CLI ``--init_across_layouts true``): an ``eagle1`` head may seed an
``eagle3`` one (or the reverse), with other ``feature_layers``. The two layouts compute the same thing only after the
attention (residual + attention output, the post-attention norm, the MLP, the final norm), so exactly those tensors
are copied (``LAYOUT_CHANGE_KEEPS``). What feeds the attention differs: eagle1 reads
``input_layernorm(fc(embed ⊕ feature))`` [B, T, H], eagle3 reads ``input_layernorm(embed) ⊕ hidden_norm(fused)``
[B, T, 2H] with fused = ``fuse(f_a ⊕ f_b ⊕ f_c)``; no copy of ``fc`` into ``fuse`` or of the H-wide q/k/v into the
2H-wide ones reproduces the source's function, so ``fuse``/``fc``, q/k/v, ``input_layernorm`` and ``hidden_norm``
start fresh (listed in ``WarmStart.left_fresh``). It is a partial warm start, hence asked for by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# Tensors that belong to a head's draft vocabulary; they may differ from the source's (see the module docstring).
DRAFT_VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d")
# Tensors an eagle1 <-> eagle3 layout change copies (name prefixes): the part of the layer after the attention.
LAYOUT_CHANGE_KEEPS = ("layer.self_attn.o_proj.", "layer.post_attention_layernorm.", "layer.mlp.", "norm.")


@dataclass
class WarmStart:
    """What ``warm_start`` did, for the log and ``training_summary.json``."""

    source: str              # as the user wrote it
    tensors_copied: int
    parameters_copied: int
    draft_vocab: str | None  # None (no draft vocabulary), "from source" or "from data"
    source_training: dict | None = None  # the source's own training, from its training_summary.json (lineage)
    layout_change: str | None = None     # e.g. "eagle1 -> eagle3" (see the module docstring), None when the same
    left_fresh: list[str] | None = None  # tensors a layout change did not copy (their fresh initialisation stays)

    @property
    def draft_vocab_from_source(self) -> bool:
        return self.draft_vocab == "from source"


def resolve_source(source: str) -> Path:
    """``bundled:KIND`` (``medusa``, ``eagle``, ``early_exit``) or a directory holding ``config.json``."""
    from hf_kvspec.heads.bundled import head_path

    path = head_path(source)
    if source.startswith("bundled:"):
        return path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--init_from {source!r}: no config.json there. Pass a directory written by "
                                "save_pretrained (e.g. a train_drafter.py --output_dir) or bundled:medusa|eagle|"
                                "early_exit.")
    return path


def warm_start(head, source: str, base_model, across_layouts: bool = False) -> WarmStart:
    """Copy the weights of the head at ``source`` into ``head`` (same class; see the module docstring).

    ``base_model`` is the frozen target: the source must have been trained for it (``attach`` checks the pairing).
    ``across_layouts``: allow an eagle1 <-> eagle3 change and copy only ``LAYOUT_CHANGE_KEEPS``.
    Raises ``ValueError`` naming every tensor or config field that differs.
    """
    path = resolve_source(source)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type != head.config.model_type:
        raise ValueError(f"--init_from {source!r} holds a {model_type} head, but this run trains a "
                         f"{head.config.model_type} head. Start from a head of the same kind (--head must match).")
    donor = type(head).from_pretrained(path, dtype=torch.float32).attach(base_model)
    layout = _layout_change(head.config, donor.config) if across_layouts else None
    if layout is None:
        _check_same_inputs(head.config, donor.config, source)
    ours, theirs = head.state_dict(), donor.state_dict()
    draft_vocab = _draft_vocab_plan(head, donor)
    if layout is not None and draft_vocab == "from source":  # a layout change copies no projection (see above)
        draft_vocab = "from data"
    skip = set(DRAFT_VOCAB_TENSORS) if draft_vocab == "from data" else set()
    if layout is not None:
        skip |= {name for name in set(ours) | set(theirs) if not name.startswith(LAYOUT_CHANGE_KEEPS)}
    _check_same_tensors(ours, theirs, skip, head.config, donor.config, source)
    copied = {name: theirs[name] for name in ours if name in theirs and name not in skip}
    head.load_state_dict(copied, strict=False)
    return WarmStart(source=source, tensors_copied=len(copied),
                     parameters_copied=sum(t.numel() for t in copied.values()), draft_vocab=draft_vocab,
                     source_training=source_training(path), layout_change=layout,
                     left_fresh=sorted(set(ours) - set(copied) - set(DRAFT_VOCAB_TENSORS)) if layout else None)


def _layout_change(config, donor_config) -> str | None:
    """``"eagle1 -> eagle3"`` (or the reverse) when the EAGLE layouts differ, else None (the plain same-layout copy)."""
    here, there = getattr(config, "architecture", None), getattr(donor_config, "architecture", None)
    if here is None or here == there:
        return None
    return f"{there} -> {here}"


def source_training(path: Path) -> dict | None:
    """What the source's ``training_summary.json`` says of its training (steps, tokens, held-out tau), if any."""
    summary_file = path / "training_summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    args, held_out = summary.get("args", {}), summary.get("held_out") or {}
    return {"steps": summary.get("stopped_at_step") or args.get("max_steps"),
            "tokens": sum(row.get("tokens", 0) for row in summary.get("data", [])),
            "held_out_tau": held_out.get("tau"), "initialised_from": summary.get("initialised_from")}


def _draft_vocab_plan(head, donor) -> str | None:
    if not getattr(head, "has_draft_vocab", False):
        if getattr(donor, "has_draft_vocab", False):
            raise ValueError(f"The --init_from head has a {donor.d2t.numel()}-token draft vocabulary; a full-"
                             f"vocabulary head cannot start from it. Pass --draft_vocab_size {donor.d2t.numel()} "
                             "(or any size: the vocabulary is then chosen from the data).")
        return None
    same = getattr(donor, "has_draft_vocab", False) and donor.d2t.numel() == head.d2t.numel()
    return "from source" if same else "from data"


def _check_same_inputs(config, donor_config, source: str) -> None:
    """Fields that change what a head reads without changing a shape (an exit adapter for layer 8 fits layer 16)."""
    differ = [f"{key}={getattr(donor_config, key)!r} there, {getattr(config, key)!r} here"
              for key in _INPUT_FIELDS if getattr(config, key, None) != getattr(donor_config, key, None)]
    if differ:
        raise ValueError(f"--init_from {source!r} was trained on other inputs: {'; '.join(differ)}. Pass the "
                         "source's values (e.g. --exit_layer, --feature_layers, --architecture), train from "
                         "scratch, or, for an eagle1 <-> eagle3 change, pass --init_across_layouts true (copies the "
                         "layer after its attention only).")


def _check_same_tensors(ours: dict, theirs: dict, skip: set, config, donor_config, source: str) -> None:
    missing = sorted(set(ours) - set(theirs) - skip)
    extra = sorted(set(theirs) - set(ours) - skip)
    shapes = sorted(f"{name} {tuple(theirs[name].shape)} vs {tuple(ours[name].shape)}"
                    for name in set(ours) & set(theirs) - skip if theirs[name].shape != ours[name].shape)
    if not (missing or extra or shapes):
        return
    theirs_config = donor_config.to_dict()
    fields = [f"{key}: {theirs_config.get(key)!r} there, {value!r} here" for key, value in config.to_dict().items()
              if key in _SHAPE_FIELDS and theirs_config.get(key) != value]
    problems = ([f"missing there: {', '.join(missing)}"] if missing else []) + \
               ([f"not in this head: {', '.join(extra)}"] if extra else []) + \
               ([f"shapes (there vs here): {'; '.join(shapes)}"] if shapes else [])
    raise ValueError(f"--init_from {source!r} cannot seed this head: {'. '.join(problems)}. Config fields that "
                     f"differ: {'; '.join(fields) or 'none of the shape fields'}. Build the head with the source's "
                     "settings (e.g. the same --architecture, --feature_layers, --num_heads) or train from scratch.")


# Config fields that decide what a head reads; a source must match them even where the shapes would fit.
_INPUT_FIELDS = ("architecture", "feature_layers", "exit_layer")
# Config fields that decide a head's tensor names and shapes (named in the refusal so the fix is obvious).
_SHAPE_FIELDS = ("architecture", "feature_layers", "num_heads", "num_layers", "share_lm_head", "exit_layer",
                 "intermediate_size", "draft_vocab_size", "norm_before_residual")
