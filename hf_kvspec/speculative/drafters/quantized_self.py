"""Self-drafting from a quantized copy of the target: the target's own weights in int8 or int4 draft a chain,
the fp32 target verifies it.

Boundary: a ``DraftModelAssistant`` whose draft forward is the fast forward (``hf_kvspec.forward``) over a
weight-only quantized copy of the target's linear layers (``forward/quantized.py``), on a draft cache of its own;
the target itself is never changed. Everything about drafting a chain, its cache and rollback is
``DraftModelAssistant``'s.

Why: a CPU decode step is bound by reading weights, so a copy with a quarter (int8) or an eighth (int4) of the
bytes drafts a token in a fraction of a target step, and a copy of the target agrees with it far more often than
a smaller model would (what llama.cpp users set up by hand with a quantized GGUF of the same model as ``-md``).
Output is exactly the fp32 target's: drafts are verified (greedy: identical; sampling: the target's distribution).
Memory: the quantized copy (``nbytes``; about 1/4 or 1/8 of the fp32 linear weights, plus scales), reported in
``output.acceptance.drafter``.
"""

from __future__ import annotations

from hf_kvspec.forward.packed import unsupported_reason
from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant

BITS = {"int8": 8, "int4": 4}


class QuantizedSelfAssistant(DraftModelAssistant):
    """``QuantizedSelfAssistant(target, weights="int8", num_draft_tokens=4)``: the target drafts for itself from a
    weight-only quantized copy of its linear layers (``"int8"`` or ``"int4"``); needs an fp32 Llama-family target
    on CPU (the fast forward's models)."""

    def __init__(self, target, weights: str = "int8", num_draft_tokens: int | str = 4, max_draft_tokens: int = 16,
                 sample_drafts: bool = True):
        if weights not in BITS:
            raise ValueError(f"weights must be one of {tuple(BITS)}, got {weights!r}")
        reason = unsupported_reason(target) if hasattr(target, "config") else None
        if reason is not None:
            raise ValueError(f"QuantizedSelfAssistant drafts with the fast forward, which does not apply to this "
                             f"target: {reason}. Use another assistant (e.g. 'ngram').")
        training = getattr(target, "training", False)
        super().__init__(target, num_draft_tokens, max_draft_tokens, sample_drafts, fast_forward=True,
                         draft_weights=weights)
        target.train(training)  # DraftModelAssistant puts its draft model in eval mode; the target stays as it was
        self.weights = weights

    def check_target(self, target, cache) -> None:
        if target is not self.model:
            raise ValueError("QuantizedSelfAssistant drafts from a copy of the target it was built with; build "
                             "one per target: QuantizedSelfAssistant(model) for model.generate(...).")

    def kernel_modules(self) -> tuple:
        return ()  # it reads its own quantized copy, never the target's linear layers
