"""Suffix drafting: drafts from a pool of everything this assistant has seen, the rows' own text included.

Boundary: keeps each row's text in a ``SuffixPool`` (``speculative/suffix_pool.py``) and turns the pool's draft
trees into ``DraftProposal``s; no model, no cache. Drafts are deterministic (point masses), so greedy output is
the target's and sampled output is distributed as the target's (the loop's verification).

    assistant = SuffixAssistant()                  # one pool, kept across this assistant's calls
    model.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
    assistant.pool.save("pool.jsonl")              # and SuffixAssistant(pool=SuffixPool.from_file(...)) later

Every call's rows enter the pool as their text grows (prompt first, then each round's committed tokens) and stay
there as history when the call ends, so a later call that repeats a format, a schema or a passage drafts it
(SuffixDecoding, arXiv 2411.04975). The pool is the caller's: one tenant across this assistant's calls unless it
is given a pool shared with other callers, with ``salt`` naming this caller's tenant (``suffix_pool.py``).

Draft size: the pool proposes up to ``num_draft_tokens`` nodes, best-first by their estimated acceptance; each row
keeps the prefix that maximises expected tokens per verify cost, ``(1 + sum of probs) / c(nodes + 1)`` on the
prior cost curve of a forward against its token count (``draft_budget.prior``). Rows with nothing worth drafting
draft nothing; a batch drafts as wide as its widest row (the others get filler that verification rejects).

Shapes: ``B`` rows, ``N`` nodes.
"""

from __future__ import annotations

import itertools

import torch

from hf_kvspec.speculative.draft_budget import prior
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal
from hf_kvspec.speculative.suffix_pool import SuffixDraft, SuffixPool

_CALLS = itertools.count()


def worth_verifying(draft: SuffixDraft) -> SuffixDraft:
    """``draft``'s prefix that maximises expected tokens per verify cost (module docstring); empty if none pays."""
    best, best_gain, expected = 0, 1.0, 1.0
    for count, prob in enumerate(draft.probs, 1):
        expected += prob
        gain = expected / prior(count + 1)
        if gain > best_gain:
            best, best_gain = count, gain
    return draft.cut(best)


def proposal_of(drafts: list[SuffixDraft], fill: list[int], tree: bool) -> DraftProposal:
    """One ``DraftProposal`` [B, N] for the rows' ``drafts``: a chain when every draft is one, else per-row parents.
    Rows shorter than the widest get filler nodes (``fill[row]``, children of the root) that verification rejects
    or, at worst, accepts only when right."""
    width = max((len(d.tokens) for d in drafts), default=0)
    tokens = torch.tensor([list(d.tokens) + [fill[row]] * (width - len(d.tokens)) for row, d in enumerate(drafts)],
                          dtype=torch.long).view(len(drafts), width)
    if not tree or all(d.is_chain for d in drafts):  # shorter chains go on with filler
        return DraftProposal(tokens)
    parents = torch.tensor([list(d.parents) + [-1] * (width - len(d.tokens)) for d in drafts],
                           dtype=torch.long).view(len(drafts), width)
    return DraftProposal(tokens, None, parents)


class SuffixAssistant(Assistant):
    """``SuffixAssistant(pool=None, salt=None, num_draft_tokens=8, tree=True)``: model-free drafting from the rows'
    own text and everything earlier calls of this assistant saw (module docstring).

    Args:
        pool: the ``SuffixPool`` to draft from and add to; default a new one of this assistant's (64 MiB, one
            tenant: its calls share their text).
        salt: this caller's tenant in a pool shared with other callers (rows read and write that tenant only).
        num_draft_tokens: most nodes per row per round.
        tree: draft trees of the most frequent continuations (the target's attention must take a 4D mask, as sdpa
            and eager do); ``False``: the most frequent chain only.
        min_prob: the least estimated acceptance of a drafted node.
        spec_factor: a draft is at most ``spec_factor`` times as deep as the matched suffix is long.
    """

    def __init__(self, pool: SuffixPool | None = None, salt: str | None = None, num_draft_tokens: int = 8,
                 tree: bool = True, min_prob: float = 0.1, spec_factor: float = 1.0, max_draft_tokens: int = 16):
        if num_draft_tokens == "auto":
            raise ValueError("SuffixAssistant sizes each row's draft from the pool's own estimates; give "
                             "num_draft_tokens as the most nodes per round (an int), not 'auto'.")
        super().__init__(num_draft_tokens, max_draft_tokens)
        if pool is not None and not isinstance(pool, SuffixPool):
            raise TypeError(f"pool must be a SuffixPool, got {type(pool).__name__}.")
        if not 0.0 < min_prob <= 1.0 or spec_factor <= 0:
            raise ValueError(f"need 0 < min_prob <= 1 and spec_factor > 0, got {min_prob}, {spec_factor}.")
        self.pool = pool if pool is not None else SuffixPool(share_unsalted=True)
        self.salt, self.tree, self.min_prob, self.spec_factor = salt, bool(tree), min_prob, spec_factor
        self.proposes_trees = self.tree
        self._buffer, self._rows = None, []

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        call = next(_CALLS)
        self._buffer, self._rows = buffer, [(call, row) for row in range(buffer.tokens.shape[0])]
        self._update(torch.ones(len(self._rows), dtype=torch.bool))

    def propose(self, ctx: DraftContext) -> DraftProposal:
        depth = min(ctx.num_draft_tokens, ctx.max_depth or ctx.num_draft_tokens)
        drafts = [worth_verifying(self.pool.propose(seq, ctx.num_draft_tokens, depth, self.min_prob,
                                                    self.spec_factor)) if bool(alive) else SuffixDraft()
                  for seq, alive in zip(self._rows, ctx.alive.tolist())]
        if not self.tree:
            drafts = [draft.chain() for draft in drafts]
        fill = ctx.buffer.tokens[:, -1].tolist()
        return proposal_of(drafts, fill, self.tree)

    def observe(self, outcome) -> None:
        super().observe(outcome)
        self._update(outcome.alive.cpu())

    def release(self, rows: list[int]) -> None:
        index = self.staying(rows)
        staying = set(index.tolist())
        for row, seq in enumerate(self._rows):
            if row not in staying:
                self.pool.release(seq)
        self._rows = [self._rows[i] for i in index.tolist()]

    def end(self) -> None:
        for seq in self._rows:
            self.pool.release(seq)
        self._buffer, self._rows = None, []

    def report(self) -> dict:
        return {"suffix_pool": self.pool.stats()}

    def _update(self, alive: torch.Tensor) -> None:
        """The pool learns each live row's committed text (the buffer's real columns, holes and padding out)."""
        buffer = self._buffer
        for row, (seq, live) in enumerate(zip(self._rows, alive.tolist())):
            if live:
                self.pool.update(seq, buffer.tokens[row][buffer.mask[row].bool()].tolist(), self.salt)
