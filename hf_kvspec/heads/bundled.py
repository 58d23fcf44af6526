"""Trained heads for the bundled SmolLM2-135M-Instruct, shipped inside the package (``hf_kvspec/bundled_heads``).

Boundary: finds a committed head directory and loads it; training them is ``scripts/train_drafter.py`` (the exact
command is in each head's README.md model card).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_kvspec.models import DEFAULT_MODEL

BUNDLED_HEADS_DIR = Path(__file__).resolve().parent.parent / "bundled_heads"
HEAD_KINDS = ("medusa", "eagle", "early_exit")


def bundled_heads_path(kind: str, base: str = DEFAULT_MODEL) -> Path:
    """Directory of a committed head (``config.json``, ``model.safetensors``, ``README.md``)."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {HEAD_KINDS}, got {kind!r}.")
    path = BUNDLED_HEADS_DIR / f"{base}-{kind.replace('_', '-')}"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No bundled {kind} head for {base!r} at {path}. Train one with: accelerate launch "
            f"scripts/train_drafter.py --head {kind} --base_model bundled:{base} --output_dir <dir>"
        )
    return path


def head_path(spec: str) -> Path:
    """``bundled:KIND`` as the committed head's directory (an unknown kind is refused, naming the known ones); any
    other spec as a path, unchecked (callers word their own errors for it)."""
    if spec.startswith("bundled:"):
        return bundled_heads_path(spec.partition(":")[2])
    return Path(spec)


def load_bundled_heads(kind: str = "medusa", base_model=None, dtype: torch.dtype = torch.float32,
                       base: str = DEFAULT_MODEL):
    """Load the committed ``"medusa"``, ``"eagle"`` or ``"early_exit"`` head for the bundled model, in eval mode.

    If ``base_model`` is given, the head is attached to it (pairing checked, embedding/LM head borrowed).
    """
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from hf_kvspec.heads.modeling_exit import ExitAdapter
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    path = bundled_heads_path(kind, base)  # refuses an unknown kind, naming the known ones
    model_class = {"medusa": MedusaHeads, "eagle": EagleHead, "early_exit": ExitAdapter}[kind]
    head = model_class.from_pretrained(path, dtype=dtype).eval()
    return head.attach(base_model) if base_model is not None else head
