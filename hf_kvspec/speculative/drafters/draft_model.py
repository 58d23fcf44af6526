"""Drafting with a smaller causal LM that shares the target's tokenizer.

Boundary: owns the draft model's cache (a fresh ``DynamicCache`` per ``generate`` call), kept aligned column by
column with the loop's ``TokenBuffer`` (same holes, same positions) and cropped to the kept width after every
round. Calls the draft model's ``forward`` directly, never its ``generate``: one catch-up forward over the
columns it has not seen, then one single-token forward per further draft token.

Under sampling the draft token is drawn from the draft's *processed* distribution (same processors as the
target, each position with its own prefix) and that distribution is returned for rejection sampling; under
greedy decoding the draft's argmax is a point mass (no probabilities needed).

Vocabularies: the draft must share the target's tokenizer; padded embedding tables may differ in size by up to
1024 rows (a wider gap means another tokenizer and is refused in ``begin``, before any forward). Target ids the
draft cannot embed (at or past its input-embedding size) reach the draft as a substitute id (its pad id, else 0),
and ids the draft can emit but the target cannot are given probability 0. Verification stays exact: it only
needs the draft tokens and the distribution they were drawn from, both over the target's vocabulary; a
substituted id can only make the draft guess worse.

Shapes: ``B`` rows, ``W`` buffer width, ``K`` draft tokens, ``V`` target vocabulary.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_kvspec.speculative.drafters.base import Assistant, ChainDraft, DraftContext, DraftProposal, RoundOutcome
from hf_kvspec.speculative.rollback import prepare_for_rollback


class DraftModelAssistant(Assistant):
    """``DraftModelAssistant(draft_model, num_draft_tokens=4)``: chain drafts from a small same-tokenizer LM.

    ``num_draft_tokens`` is K per round, or ``"auto"`` to adapt it from measured acceptance and cost.
    ``fast_forward`` chooses the draft model's forward as ``speculative_generate``'s does the target's (None: the
    fast forward where it applies and pays). ``sample_drafts=False`` drafts the draft's argmax even when the call samples; the drafts are then verified
    as point masses (still exact; usually lower acceptance than rejection sampling against sampled drafts).
    """

    def __init__(self, draft_model, num_draft_tokens: int | str = 4, max_draft_tokens: int = 16,
                 sample_drafts: bool = True, fast_forward: bool | None = None):
        super().__init__(num_draft_tokens, max_draft_tokens)
        self.sample_drafts = sample_drafts
        self.fast_forward = fast_forward
        if not isinstance(draft_model, torch.nn.Module) or not hasattr(draft_model, "config"):
            raise TypeError(f"draft_model must be a loaded transformers causal LM, got {type(draft_model).__name__}; "
                            "load one with AutoModelForCausalLM.from_pretrained(...), or pass a spec such as "
                            "'draft:<dir>' to hf_kvspec.make_assistant.")
        if getattr(draft_model.config, "is_encoder_decoder", False):
            raise ValueError("DraftModelAssistant needs a decoder-only causal LM as draft model.")
        self.model = draft_model.eval()
        self.forward = None  # the draft model's forward for a call (hf_kvspec.forward: fast where it applies)
        self.cache = None
        self.cached = 0  # buffer columns held by the draft cache
        self.target_vocab = None
        self.embeddable = _embeddable_ids(draft_model)  # ids the draft can be fed
        pad = getattr(draft_model.config, "pad_token_id", None)
        self.substitute_id = pad if isinstance(pad, int) and 0 <= pad < self.embeddable else 0

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        self.cache = DynamicCache(config=self.model.config)
        self.sliding = prepare_for_rollback(self.cache)
        self.forward = self._draft_forward()
        self.cached = 0
        self.target_vocab = check_vocabulary(self.model, target)

    def _draft_forward(self):
        from hf_kvspec.forward.runner import choose_forward

        return choose_forward(self.model, self.fast_forward)  # the draft cache is a DynamicCache of its config

    def kernel_modules(self) -> tuple:
        return (self.model,)

    def report(self) -> dict | None:
        return None if self.forward is None else self.forward.report()

    def propose(self, ctx: DraftContext) -> DraftProposal:
        buffer, count = ctx.buffer, ctx.num_draft_tokens
        logits = self._forward(buffer.tokens[:, self.cached:], buffer.attention_mask(1),
                               buffer.positions[:, self.cached:])
        self.cached = buffer.width
        chain = ChainDraft(ctx, buffer.tokens.new_zeros(buffer.tokens.shape[0], 0), sample=self.sample_drafts)
        for step in range(count):
            token = chain.next(logits)
            if step + 1 < count:  # the last draft token is never fed: the target verifies it
                logits = self._forward(token[:, None], buffer.attention_mask(step + 2),
                                       buffer.next_positions(step + 2)[:, -1:])
                self.cached += 1
        return chain.proposal()

    def draft_ids(self, ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """Target ids [B, T] as the draft can embed them (see the module docstring)."""
        if self.embeddable >= target_vocab:
            return ids
        return ids.masked_fill(ids >= self.embeddable, self.substitute_id)

    def _forward(self, ids: torch.Tensor, attention_mask, positions: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, 1, V_target] of the last fed token."""
        inputs = dict(input_ids=self.draft_ids(ids, self.target_vocab), attention_mask=attention_mask,
                      position_ids=positions, logits_to_keep=1)
        logits, _, self.cache = self.forward(inputs, self.cache)
        return to_target_vocabulary(logits, self.target_vocab)

    def observe(self, outcome: RoundOutcome) -> None:
        super().observe(outcome)
        if self.cached > outcome.kept_width or self.sliding:
            self.cache.crop(min(outcome.kept_width - self.cached, 0))
            self.cached = min(self.cached, outcome.kept_width)

    def release(self, rows: list[int]) -> None:
        index = self.staying(rows)
        if self.cache is not None and self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(index)

    def end(self) -> None:
        self.cache = None


def check_vocabulary(draft, target) -> int:
    """The target's output vocabulary size, after refusing a draft whose vocabulary is another tokenizer's
    (padded embedding tables differ by a little, tokenizers by a lot)."""
    target_vocab = target.get_output_embeddings().out_features
    draft_vocab = draft.get_output_embeddings().out_features
    if abs(draft_vocab - target_vocab) > 1024:
        raise ValueError(f"draft vocabulary ({draft_vocab}) does not match the target's ({target_vocab}); "
                         "DraftModelAssistant needs a draft model with the same tokenizer.")
    return target_vocab


def to_target_vocabulary(logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Draft logits [..., V_draft] over the target's ``target_vocab`` ids: extra ids cut, missing ones at -inf
    (probability 0: the draft cannot produce them)."""
    vocab = logits.shape[-1]
    if vocab > target_vocab:
        return logits[..., :target_vocab]
    if vocab < target_vocab:
        return torch.nn.functional.pad(logits, (0, target_vocab - vocab), value=float("-inf"))
    return logits


def _embeddable_ids(model) -> int:
    """How many token ids ``model`` can be fed: its input embedding's rows; a model that exposes no input
    embedding (a lookup-table LM) is taken to accept every id of its config's vocabulary."""
    try:
        return model.get_input_embeddings().num_embeddings
    except (NotImplementedError, AttributeError):
        return int(model.config.vocab_size)
