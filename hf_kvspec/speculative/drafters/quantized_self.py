"""Self-drafting from a quantized copy of the target: the target's own weights in int8 or int4 draft a chain on
the target's own cache, the fp32 target verifies it.

Boundary: drafts with the fast forward (``hf_kvspec.forward``) over a weight-only quantized copy of the target's
linear layers (``forward/quantized.py``), reading and extending the target's cache for the round and cropping it
back before the verify forward; the target itself (its modules, weights and mode) is never changed.

    round    the target cache holds the committed tokens but the root (the buffer's last column)
    draft    feed the root, then each draft but the last, one token per quantized forward on the target's cache:
             the draft attends to the fp32 target's keys/values of everything committed (better than its own,
             and no catch-up forward over accepted tokens), and appends its own for the K tokens it feeds
    crop     the cache back to the committed tokens; the verify forward writes the target's keys/values

Why: a CPU decode step is bound by reading weights, so a copy with a quarter (int8) or about an eighth (int4) of
the bytes drafts a token in a fraction of a target step, and a copy of the target agrees with it far more often
than a smaller model would (what llama.cpp users set up by hand with a quantized GGUF of the same model as
``-md``). Output is exactly the fp32 target's: drafts are verified (greedy: identical; sampling: the target's
distribution, drafts drawn from the copy's processed distribution). Memory: the quantized copy, reported in
``output.acceptance.drafter["packed_bytes"]`` (``report``).

Shapes: ``B`` rows, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_kvspec.cache.contract import crop_layers
from hf_kvspec.forward.packed import unsupported_reason
from hf_kvspec.speculative.drafters.base import Assistant, ChainDraft, DraftContext, DraftProposal

WEIGHTS = ("int8", "int4")


class QuantizedSelfAssistant(Assistant):
    """``QuantizedSelfAssistant(target, weights="int8", num_draft_tokens=8)``: the target drafts for itself from a
    weight-only quantized copy of its linear layers (``"int8"``: per-row scales; ``"int4"``: groups of 32); needs
    an fp32 Llama-family target on CPU with a ``DynamicCache`` (the fast forward's models and cache).
    ``sample_drafts=False`` drafts the copy's argmax when the call samples (verified as point masses)."""

    shares_target_cache = True

    def __init__(self, target, weights: str = "int8", num_draft_tokens: int | str = 8, max_draft_tokens: int = 16,
                 sample_drafts: bool = True):
        super().__init__(num_draft_tokens, max_draft_tokens)
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        if not isinstance(target, torch.nn.Module) or not hasattr(target, "config"):
            raise TypeError(f"QuantizedSelfAssistant needs the loaded target model, got {type(target).__name__}")
        reason = unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"QuantizedSelfAssistant drafts with the fast forward, which does not apply to this "
                             f"target: {reason}. Use another assistant (e.g. 'ngram').")
        from hf_kvspec.forward.runner import FastForward

        self.target, self.weights, self.sample_drafts = target, weights, sample_drafts
        # quantizing the copy takes about a second for a 135M model: done here, not inside the first generate call
        self.forward = FastForward(target, weights=weights)

    def check_target(self, target, cache) -> None:
        if target is not self.target:
            raise ValueError("QuantizedSelfAssistant drafts from a copy of the target it was built with; build "
                             "one per target: QuantizedSelfAssistant(model) for model.generate(...).")
        if cache is not None and type(cache) is not DynamicCache:
            raise ValueError(f"QuantizedSelfAssistant drafts on the target's cache with the fast forward, which "
                             f"reads a DynamicCache; got {type(cache).__name__}. Drop cache= (or pass a "
                             "DynamicCache).")

    def release(self, rows: list[int]) -> None:
        self.staying(rows)  # no per-row state survives a round: finished rows may leave

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        from hf_kvspec.forward.runner import FastForward

        self.forward = FastForward(self.target, weights=self.weights)  # the same copy, repacked if a weight changed

    def propose(self, ctx: DraftContext) -> DraftProposal:
        cache, buffer, count = ctx.target_cache, ctx.buffer, ctx.num_draft_tokens
        held = cache.get_seq_length()
        chain = ChainDraft(ctx, buffer.tokens.new_zeros(buffer.tokens.shape[0], 0), sample=self.sample_drafts)
        token = buffer.tokens[:, -1:]  # [B, 1] the root, then each draft but the last (the target verifies it)
        try:
            for step in range(count):
                inputs = dict(input_ids=token, attention_mask=buffer.attention_mask(step + 1),
                              position_ids=buffer.next_positions(step + 1)[:, -1:], logits_to_keep=1)
                logits, _, _ = self.forward(inputs, cache)  # [B, 1, V]
                token = chain.next(logits)[:, None]
        finally:
            crop_layers(cache, held)  # the target's cache as the loop left it
        return chain.proposal()

    def report(self) -> dict | None:
        return self.forward.report()
