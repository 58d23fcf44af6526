"""Held-out evaluation of an exit adapter on the target's own greedy answers (full vocabulary, exact argmax).

Boundary: (adapter, target, conversations) in, the ``draft_acceptance`` metric's result out, as
``evaluation.evaluate_head`` does for Medusa / EAGLE; the metric owns the counts and the chain walk.

Why teacher forcing is exact here: an early-exit draft at depth k reads the prefix plus drafts 1..k-1; a chain only
uses it when those drafts were right, i.e. equal to the target's tokens, so it is the adapter's prediction at row
t + k of the target's own text. One forward per answer therefore scores every depth.

Shapes: K draft depth, T positions, n response tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from hf_kvspec.heads.distill import Conversation
from hf_kvspec.heads.features import right_padded, target_features


@torch.no_grad()
def exit_drafts(adapter, target, conv: Conversation, depth: int) -> dict:
    """One metric example: ``predictions`` [K][n] (depth-k draft after step t guesses step t + k + 1: the adapter's
    argmax at row start + t + k + 1) and ``references`` [n] (the target's greedy tokens, row start + t)."""
    device = next(target.parameters()).device
    ids, valid = right_padded([conv.input_ids])
    states, target_tokens = target_features(target, ids.to(device), valid.to(device), [adapter.config.exit_layer])
    start = conv.prompt_length - 1                                      # the row predicting the first response token
    guesses = adapter.logits(states[:, start:].to(adapter.dtype))[0].argmax(-1)          # [n + 1] rows start..T-1
    references = target_tokens[0, start:-1]                                               # [n]
    n = references.shape[0]
    predictions = torch.full((depth, n), -1, dtype=torch.long, device=device)
    for k in range(depth):
        if k + 1 < n:
            predictions[k, :n - k - 1] = guesses[k + 1:n]
    return {"predictions": predictions.tolist(), "references": references.tolist()}


@torch.no_grad()
def evaluate_exit_adapter(adapter, target, conversations: list[Conversation], depth: int = 4) -> dict:
    """``draft_acceptance`` (chain) over each response: per-depth top-1, chain tau at ``depth`` drafts, counts."""
    from hf_kvspec.metrics import load_metric

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"evaluate_exit_adapter: depth must be a positive int (drafts per round), got {depth!r}.")
    scored = [conv for conv in conversations if len(conv.response_ids) >= 2]
    if not scored:
        raise ValueError(f"None of the {len(conversations)} conversations has a response of 2 or more tokens; give "
                         "prompts with longer answers (or a larger max_new_tokens).")
    metric = load_metric("draft_acceptance", keep_in_memory=True)
    for conv in scored:
        metric.add(**exit_drafts(adapter, target, conv, depth))
    return metric.compute()
