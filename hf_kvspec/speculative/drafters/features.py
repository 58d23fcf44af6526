"""Feature-level drafters (Medusa, EAGLE) and their target: attaching a head to the target it reads, and the
prefill's features handed to a drafter.

Boundary: pairing a head with its target and starting a feature drafter's call. Which target modules produce
the features and capturing them during the model's own forward is ``hf_kvspec.forward.capture`` (re-exported
here: ``feature_module``, ``FeatureCapture``); the fast forward returns the same features itself.
"""

from __future__ import annotations

from torch import nn

from hf_kvspec.forward.capture import FeatureCapture, feature_module

__all__ = ["FeatureCapture", "begin_with_features", "ensure_attached", "feature_module"]


def ensure_attached(head: nn.Module, target: nn.Module) -> None:
    """Attach a draft head to ``target`` unless it already borrows this target's embedding and LM head; the pairing
    check runs on attach (``BaseModelMismatchError`` for another base model). A head on another device or in
    another dtype than the target's LM head is moved to it (heads are small; mixed dtypes fail in the matmuls)."""
    borrowed = getattr(head, "_borrowed", None)
    if (borrowed is None or borrowed.lm_head is not target.get_output_embeddings()
            or borrowed.embed_tokens is not target.get_input_embeddings()):
        head.attach(target)
    weight = target.get_output_embeddings().weight
    own = next(head.parameters(), None)
    if own is not None and (own.device != weight.device or own.dtype != weight.dtype):
        head.to(device=weight.device, dtype=weight.dtype)


def begin_with_features(assistant, head: nn.Module, target: nn.Module, target_hidden) -> None:
    """The start of a call for an assistant that drafts from the target's features: the loop passed the prefill's
    features, and ``head`` is attached to ``target`` (``ensure_attached``)."""
    if target_hidden is None:
        raise ValueError(f"{type(assistant).__name__} drafts from the target's features; run it through "
                         "hf_kvspec.speculative_generate, which passes them (wants_hidden_states).")
    ensure_attached(head, target)
