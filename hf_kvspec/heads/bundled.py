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
EARLIER_HEADS = {"eagle_v2": "eagle"}  # a head the default of its kind replaced, kept loadable by name -> its kind
HEAD_NAMES = HEAD_KINDS + tuple(EARLIER_HEADS)


def bundled_heads_path(kind: str, base: str = DEFAULT_MODEL) -> Path:
    """Directory of a committed head (``config.json``, ``model.safetensors``, ``README.md``): ``kind`` is one of
    ``HEAD_KINDS`` (the default head of that kind) or an earlier head's name (``EARLIER_HEADS``, e.g. ``"eagle_v2"``)."""
    if kind not in HEAD_NAMES:
        raise ValueError(f"kind must be one of {HEAD_NAMES}, got {kind!r}.")
    path = BUNDLED_HEADS_DIR / f"{base}-{kind.replace('_', '-')}"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No bundled {kind} head for {base!r} at {path}. Train one with: accelerate launch scripts/"
            f"train_drafter.py --head {EARLIER_HEADS.get(kind, kind)} --base_model bundled:{base} --output_dir <dir>"
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
    """Load the committed ``"medusa"``, ``"eagle"`` or ``"early_exit"`` head for the bundled model, in eval mode;
    an earlier head by its name (``"eagle_v2"``: the EAGLE-1 head bundled before the EAGLE-3 head v3).

    If ``base_model`` is given, the head is attached to it (pairing checked, embedding/LM head borrowed).
    """
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from hf_kvspec.heads.modeling_exit import ExitAdapter
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    path = bundled_heads_path(kind, base)  # refuses an unknown kind, naming the known ones
    classes = {"medusa": MedusaHeads, "eagle": EagleHead, "early_exit": ExitAdapter}
    model_class = classes[EARLIER_HEADS.get(kind, kind)]
    head = model_class.from_pretrained(path, dtype=dtype).eval()
    return head.attach(base_model) if base_model is not None else head
