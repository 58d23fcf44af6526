"""Running a chosen subset of the target's decoder layers over chosen columns of its own cache.

Boundary: the tensor plumbing of self-speculation: embed ids, build the explicit 4D mask and the rotary
embeddings for a block of new columns, call decoder layers ``i in layers`` one by one (each writes its own cache
layer, cache contract C2: per-layer lengths), and map hidden states to logits with the final norm and the shared LM
head. Knows nothing about drafting or acceptance; never changes the model (no attributes set, no modules swapped):
it calls the model's own modules with explicit inputs, so an exception leaves the model as it was.

Where the pieces live per architecture (``model.model.layers`` ...) is ``_compat.decoder_stack``'s business.

Why explicit 4D masks: after an early-exit draft, layers 0..E-1 hold more columns than layers E..L-1, so one 2D
mask cannot describe every layer; each call builds the mask for its own layers from the 2D key mask (left padding
and the loop's holes) over exactly the columns those layers hold after the call.

Shapes: ``B`` rows, ``T`` new columns, ``S`` key columns of the called layers after the call (cached + T), ``H``
hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_kvspec import _compat
from hf_kvspec.masking import additive_mask, pad_keys


def causal_key_mask(key_mask: torch.Tensor, new: int) -> torch.Tensor:
    """Bool mask ``[B, 1, T, S]`` (True = attend) for ``T = new`` queries at the last ``T`` of ``S`` columns: query
    t sees column c when ``key_mask[b, c]`` is 1 and ``c <= S - T + t``. key_mask [B, S] 0/1."""
    width = key_mask.shape[1]
    columns = torch.arange(width, device=key_mask.device)  # [S]
    query_columns = torch.arange(width - new, width, device=key_mask.device)  # [T]
    visible = (columns[None, :] <= query_columns[:, None])[None] & key_mask[:, None, :].bool()  # [B, T, S]
    return visible[:, None]


class PartialForward:
    """The target's decoder as separately callable pieces (embed, any layers, head)."""

    def __init__(self, model):
        self.model = model
        self.embed_tokens, self.layers, self.rotary_emb, self.norm = _compat.decoder_stack(model)
        self.lm_head = model.get_output_embeddings()
        self.num_layers = len(self.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> input hidden states [B, T, H] (these architectures apply no embedding scale)."""
        return self.embed_tokens(ids)

    def run(self, hidden: torch.Tensor, layers: Sequence[int], key_mask: torch.Tensor | None,
            position_ids: torch.Tensor, cache) -> torch.Tensor:
        """Hidden states [B, T, H] after decoder ``layers`` (ascending), each appending its K/V for the T columns
        to its own cache layer. Every called layer must hold the same ``S - T`` columns before the call;
        key_mask [B, S] (None = all real); position_ids [B, T]."""
        if not layers:
            return hidden
        new = hidden.shape[1]
        held = int(cache.get_seq_length(layers[0]))
        for i in layers[1:]:
            if int(cache.get_seq_length(i)) != held:
                raise RuntimeError(f"layers {layers[0]} and {i} hold {held} and {int(cache.get_seq_length(i))} "
                                   f"columns; one call runs layers of equal length (crop them first)")
        if key_mask is None:
            key_mask = torch.ones(hidden.shape[0], held + new, dtype=torch.long, device=hidden.device)
        if key_mask.shape[1] != held + new:
            raise RuntimeError(f"key mask covers {key_mask.shape[1]} columns, layers hold {held} + {new} new")
        keep = pad_keys(causal_key_mask(key_mask, new), cache.get_mask_sizes(new, layers[0])[0])  # [B, 1, T, >= S]
        mask = additive_mask(keep, hidden.dtype)
        rotary = self.rotary_emb(hidden, position_ids=position_ids)  # (cos, sin) [B, T, D]
        for i in layers:
            hidden = self.layers[i](hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                                    use_cache=True, position_embeddings=rotary)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, T, H] (before the final norm) -> logits [B, T, V] through the shared head."""
        return self.lm_head(self.norm(hidden))
