"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the context's last n-gram.

Boundary: reads each row's token history (prompt + generated); no model, no cache, no state between rounds.
Drafts are deterministic, so they are verified as point masses: exact under greedy and under sampling.

Follows prompt lookup decoding (Saxena 2023; Spec-Bench "PLD"), with one deviation from transformers'
``PromptLookupCandidateGenerator``: among several matches of the n-gram this takes the *most recent* one, not the
first, because summaries and code edits copy the passage being worked on, which is usually the nearest.

Shapes: ``B`` rows, ``L`` history length, ``K`` draft tokens.
"""

from __future__ import annotations

import torch

from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal


def lookup_continuation(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int) -> torch.Tensor:
    """Up to ``count`` tokens that followed the latest earlier occurrence of ``sequence``'s last n-gram.

    ``sequence`` [L]; longer n-grams are tried first (more specific); returns an empty tensor when none matches.
    """
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = sequence.unfold(0, n, 1)[:-1]  # [L - n, n] every n-gram except the tail itself
        hits = (windows == sequence[-n:]).all(dim=-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return sequence[start: start + count]
    return sequence[:0]


class NgramAssistant(Assistant):
    """``NgramAssistant(max_ngram=3, num_draft_tokens=8)``: model-free drafting from the context.

    ``num_draft_tokens="auto"`` adapts K to the measured acceptance and verify cost (draft cost is ~0).
    """

    def __init__(self, max_ngram: int = 3, num_draft_tokens: int | str = 8, min_ngram: int = 1,
                 max_draft_tokens: int = 16):
        super().__init__(num_draft_tokens, max_draft_tokens)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (min_ngram, max_ngram)) \
                or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.first_real = None

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        # left padding of each row (history starts with the padded prompt); pads must not match n-grams
        self.first_real = (buffer.mask.cumsum(dim=1) == 0).sum(dim=1).tolist()

    def release(self, rows: list[int]) -> None:
        index = self.staying(rows)
        self.first_real = [self.first_real[i] for i in index.tolist()]

    def lookup(self, sequence: torch.Tensor, count: int) -> torch.Tensor:
        """Up to ``count`` drafts ``[n]`` for one sequence ``[L]`` of real tokens (its newest last), with this
        assistant's n-gram sizes (``lookup_continuation``)."""
        return lookup_continuation(sequence, self.max_ngram, self.min_ngram, count)

    def propose(self, ctx: DraftContext) -> DraftProposal:
        ids, lengths = ctx.history.ids, ctx.history.lengths.tolist()
        rows = []
        for row, (first, length) in enumerate(zip(self.first_real, lengths)):
            found = self.lookup(ids[row, first:length], ctx.num_draft_tokens) if bool(ctx.alive[row]) else ids[row, :0]
            rows.append(found)
        width = max(r.shape[0] for r in rows)
        tokens = ids.new_zeros(len(rows), width)
        for row, found in enumerate(rows):
            # a row without a match gets filler: verification stays exact, only that row's drafts are wasted
            tokens[row] = torch.cat([found, ids[row, lengths[row] - 1].expand(width - found.shape[0])])
        return DraftProposal(tokens)
