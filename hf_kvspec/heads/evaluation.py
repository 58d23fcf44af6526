"""Held-out evaluation of a trained head on the target's own greedy answers (full vocabulary, exact argmax).

Boundary: (head, target, conversations) in, ``AcceptanceTally`` out. Conversations come from ``distill.py``.

Shapes: K draft depth, T positions, H hidden, F feature width, V vocabulary.
"""

from __future__ import annotations

import torch

from hf_kvspec.heads.acceptance import AcceptanceTally
from hf_kvspec.heads.distill import Conversation
from hf_kvspec.heads.features import right_padded, target_features


@torch.no_grad()
def draft_tokens(head, features: torch.Tensor, input_ids: torch.Tensor, depth: int, start: int = 0) -> torch.Tensor:
    """Greedy drafts [K, T] for one sequence: row t, draft k is the head's token for position t+k+2.

    features [1, T, F] raw target features; input_ids [1, T]. Medusa: every head on f_t. EAGLE: ``depth`` unrolled
    steps where step k consumes x_{t+k+1} (the token a correct chain would have drafted). Rows before ``start`` are
    not projected onto the vocabulary (the LM head is most of the cost) and hold -1.
    """
    drafts = torch.full((depth, input_ids.shape[1]), -1, dtype=torch.long, device=input_ids.device)
    if hasattr(head, "heads"):  # MedusaHeads
        logits = head(features[:, start:].to(head.dtype)).logits[:depth, 0]                   # [K, T - start, V]
        drafts[:, start:] = logits.argmax(-1)
        return drafts
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)                     # [1, T] x_{t+1}
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    steps = head.unrolled(next_ids, features.to(head.dtype), valid, depth)
    for k, hidden in enumerate(steps):
        drafts[k, start:] = head.logits(hidden[:, start:])[0].argmax(-1)
    return drafts


def _medusa_feature_layers(head) -> list[int]:
    return [-1] if hasattr(head, "heads") else list(head.config.feature_layers)


@torch.no_grad()
def evaluate_head(head, target, conversations: list[Conversation], depth: int | None = None) -> AcceptanceTally:
    """Per-head top-1 and chain tau over each conversation's response rows (see ``acceptance.py``)."""
    depth = depth or getattr(head.config, "num_heads", 4)
    tally = AcceptanceTally()
    device = next(target.parameters()).device
    for conv in conversations:
        if len(conv.response_ids) < 2:
            continue
        ids, valid = right_padded([conv.input_ids])
        features, target_tokens = target_features(target, ids.to(device), valid.to(device),
                                                  _medusa_feature_layers(head))
        drafts = draft_tokens(head, features, ids.to(device), depth, conv.prompt_length - 1)  # [K, T]
        size = ids.shape[1]
        correct = torch.zeros_like(drafts, dtype=torch.bool)
        for k in range(depth):
            correct[k, : size - k - 1] = drafts[k, : size - k - 1] == target_tokens[0, k + 1:]
        tally.add(correct.cpu(), start=conv.prompt_length - 1, end=size - 2)
    return tally
