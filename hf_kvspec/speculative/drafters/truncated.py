"""A stand-in draft model: the target's first N decoder layers + its final norm + its LM head, copied.

Boundary: builds a new, independent ``PreTrainedModel`` from a target; no training. Useful until a trained
drafter exists (and as the "same draft" in comparisons with transformers' assisted generation). Expect low
acceptance on models not trained for early exit: measured on SmolLM2-135M's own greedy answers, top-1
agreement is 1.5% with 2 of 30 layers, 4% with 14, 31% with 24 and 51% with 28 (when the draft costs as much
as the target); LayerSkip (2404.16710) trains for it.
"""

from __future__ import annotations

import copy
import re

from transformers import AutoModelForCausalLM

from hf_kvspec._compat import attn_implementation

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncated_draft(model, num_layers: int):
    """A copy of ``model`` keeping decoder layers ``0 .. num_layers - 1`` (same embeddings, norm and head)."""
    total = model.config.num_hidden_layers
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total} for this {total}-layer model, got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=model.dtype,
                                             attn_implementation=attn_implementation(model.config))
    kept = {key: value for key, value in model.state_dict().items()
            if (match := _LAYER_KEY.search(key)) is None or int(match.group(1)) < num_layers}
    draft.load_state_dict(kept, strict=True)
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.to(model.device).eval()
