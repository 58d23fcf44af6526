"""Shared builders for the speculative tests: targets, drafts of known quality, prompts."""

from __future__ import annotations

import copy

import torch

from tests.tiny_models import left_padded_batch, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20]]


def perturbed_copy(model, scale: float, seed: int = 3):
    """A draft that agrees with ``model`` most of the time (partial acceptance -> rows diverge, holes appear)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return draft


def drafts_for(kind: str):
    """``{name: draft}``: always right (the target itself), always wrong (other random weights), sometimes right."""
    target = tiny_model(kind, seed=0)
    return target, {
        "right": tiny_model(kind, seed=0),
        "wrong": tiny_model(kind, seed=1),
        "partial": perturbed_copy(target, 0.003),
    }


def batch(size: int):
    """Left-padded ``(input_ids, attention_mask)`` of the first ``size`` uneven prompts."""
    return left_padded_batch(PROMPTS[:size])
