"""Held-out evaluation of a trained head on the target's own greedy answers (full vocabulary, exact argmax).

Boundary: (head, target, conversations) in, the ``draft_acceptance`` metric's result out. This module runs the models
and hands token ids to that metric (``hf_kvspec/metrics/draft_acceptance.py``), which owns every count, ratio and the
chain walk. Conversations come from ``distill.py``.

Shapes: K draft depth, T positions, H hidden, F feature width, V vocabulary.
"""

from __future__ import annotations

import torch

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
        drafts[k, start:] = head.draft_to_target(head.logits(hidden[:, start:])[0].argmax(-1))  # draft -> target ids
    return drafts


def _feature_layers(head) -> list[int]:
    return [-1] if hasattr(head, "heads") else list(head.config.feature_layers)


@torch.no_grad()
def evaluate_head(head, target, conversations: list[Conversation], depth: int | None = None, metric=None) -> dict:
    """``draft_acceptance`` over each conversation's response: per-head top-1, chain tau, counts.

    ``metric`` defaults to a fresh in-memory ``load_metric("draft_acceptance")``; pass your own (e.g. one set up for
    distributed evaluation: then processes other than 0 get None) to add these responses to it. Responses shorter
    than 2 tokens carry no draft and are skipped."""
    from hf_kvspec.metrics import load_metric

    depth = _checked_depth(head, depth)
    scored = [conv for conv in conversations if len(conv.response_ids) >= 2]
    if not scored:
        raise ValueError(f"None of the {len(conversations)} conversations has a response of 2 or more tokens, so no "
                         "draft can be scored: give prompts with longer answers (or a larger max_new_tokens).")
    metric = metric if metric is not None else load_metric("draft_acceptance", keep_in_memory=True)
    for conv in scored:
        metric.add(**response_drafts(head, target, conv, depth))
    return metric.compute()


def _checked_depth(head, depth: int | None) -> int:
    """``depth`` or the head's own (Medusa: its heads; EAGLE: 4 unrolled steps), refused when no draft exists there."""
    heads = getattr(head.config, "num_heads", None)  # None: EAGLE unrolls to any depth
    if depth is None:
        return heads or 4
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1 or (heads and depth > heads):
        most = f" (this head has {heads} heads)" if heads else ""
        raise ValueError(f"evaluate_head: depth={depth!r} must be an int in 1..{heads or 'any'}{most}; leave it None "
                         "for the head's own depth.")
    return depth


def response_drafts(head, target, conv: Conversation, depth: int) -> dict:
    """One metric example: ``predictions`` [K][n] the head's drafts after each response step, ``references`` [n] the
    target's greedy tokens at those steps (n response tokens; step t is row prompt_length - 1 + t)."""
    device = next(target.parameters()).device
    ids, valid = right_padded([conv.input_ids])
    features, target_tokens = target_features(target, ids.to(device), valid.to(device), _feature_layers(head))
    start = conv.prompt_length - 1                                   # the row that predicts the first response token
    drafts = draft_tokens(head, features, ids.to(device), depth, start)                       # [K, T]
    return {"predictions": drafts[:, start:-1].tolist(), "references": target_tokens[0, start:-1].tolist()}
