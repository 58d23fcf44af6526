"""Which rows of a batch are still in the model's batch: finished rows leave it, the rest of the loop stays full-size.

Boundary: index bookkeeping between the *full* batch (``History``, logits processors, stopping criteria, output:
always all ``B`` rows, in the caller's order) and the *active* batch (``TokenBuffer``, the target's cache, the
drafter's state: only the ``A`` rows still generating). No model calls.

Why: ``generate`` keeps every row in every forward until the last row ends, so a row that hit EOS early still costs
a full share of each forward (with K + 1 tokens per row per verify forward, that is K + 1 wasted tokens per round).
When the loop owns the cache (``generate`` created it; a caller's cache is never shrunk) it drops finished rows
from the model-facing state instead (``Cache.batch_select_indices``), as continuous-batching servers do.

Logits processors and stopping criteria may keep per-row state or pass row indices to callbacks
(``PrefixConstrainedLogitsProcessor``), so they always see the full batch: the active rows' logits and drafts are
scattered back into full-size tensors (finished rows get zeros, and their results are discarded).

Shapes: ``B`` rows of the call, ``A`` active rows, ``T`` positions, ``V`` vocabulary, ``S`` history capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvspec.speculative.drafters.base import DraftContext, DraftProposal
from hf_kvspec.speculative.positions import History, PositionwiseProcessor


@dataclass
class RoundContext(DraftContext):
    """The loop's ``DraftContext``, plus the deepest path worth drafting this round: ``max_depth`` drafts and the
    next token fill the tokens left to generate. Tree drafters read it to keep their width near the end
    (``getattr(ctx, "max_depth", None)``, absent in hand-built contexts); the loop cuts deeper proposals."""

    max_depth: int | None = None


class ActiveRows:
    """The active rows ``index`` [A] (ascending indices into the full batch of ``batch`` rows)."""

    def __init__(self, batch: int, device: torch.device):
        self.batch = batch
        self.index = torch.arange(batch, device=device)  # [A]

    @property
    def complete(self) -> bool:
        """Whether every row of the call is still active (the full and active batches coincide)."""
        return self.index.shape[0] == self.batch

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """``[B, ...]`` -> ``[A, ...]``."""
        return full if self.complete else full[self.index]

    def expand(self, active: torch.Tensor | None, fill: int = 0) -> torch.Tensor | None:
        """``[A, ...]`` -> ``[B, ...]``, ``fill`` in the rows that left."""
        if active is None or self.complete:
            return active
        full = active.new_full((self.batch, *active.shape[1:]), fill)
        full[self.index] = active
        return full

    def take_all(self, *full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``take`` of each ``[B, ...]`` tensor."""
        return tuple(self.take(tensor) for tensor in full)

    def full_proposal(self, proposal: DraftProposal) -> DraftProposal:
        """A drafter's ``[A, N]`` proposal as ``[B, N]``: rows that left get token 0, zero probabilities and, in a
        per-row tree, ``-1`` parents (children of the root: a valid tree whose results are discarded)."""
        parents = proposal.parents
        if parents is not None and parents.dim() == 2:
            parents = self.expand(parents, fill=-1)
        return DraftProposal(self.expand(proposal.tokens), self.expand(proposal.probs), parents,
                             proposal.draft_forwards)

    def draft_context(self, buffer, history: History, processor: PositionwiseProcessor, alive: torch.Tensor,
                      num_draft: int, do_sample: bool, max_depth: int | None = None,
                      target_cache=None) -> RoundContext:
        """What the drafter sees: the active rows of ``history``, ``alive`` and the processors (``buffer`` and
        ``target_cache``, passed to self-drafters only, are already active-only)."""
        return RoundContext(buffer, self.history(history), num_draft, do_sample, self.take(alive),
                            self.processor(processor, history), target_cache=target_cache, max_depth=max_depth)

    def leave(self, alive: torch.Tensor, buffer, cache, drafter) -> int:
        """Take the active rows that are no longer ``alive`` [B] out of the model-facing state (buffer, cache,
        drafter); returns how many left."""
        still = self.take(alive)  # [A]
        if bool(still.all()):
            return 0
        local = self.drop(still)
        buffer.select_rows(local)
        local = local.cpu()  # a CPU index selects on any device (offloaded or split caches)
        cache.batch_select_indices(local)
        drafter.select_rows(local)
        return int((~still).sum())

    def drop(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep the active rows where ``keep`` [A] is true; returns their positions [A'] among the old active rows
        (what ``Cache.batch_select_indices`` and the drafter's ``select_rows`` take)."""
        local = keep.nonzero().reshape(-1)
        self.index = self.index[local]
        return local

    def history(self, history: History) -> History:
        """A copy of ``history`` restricted to the active rows (for drafters; the loop keeps the full one)."""
        return history if self.complete else history.select_rows(self.index)

    def processor(self, processor: PositionwiseProcessor, history: History):
        """``processor`` for active-row tensors: same call signature, evaluated on the full batch with ``history``."""
        if self.complete or not processor:  # no processor reads the history: the active rows alone will do
            return processor
        return _ActiveProcessor(processor, history, self)


class _ActiveProcessor:
    """A ``PositionwiseProcessor`` called with ``[A, ...]`` tensors; runs on all ``B`` rows, returns ``[A, T, V]``."""

    def __init__(self, processor: PositionwiseProcessor, history: History, rows: ActiveRows):
        self.inner, self.full_history, self.rows = processor, history, rows

    def __bool__(self) -> bool:
        return bool(self.inner)

    def __call__(self, history, draft_tokens: torch.Tensor, logits: torch.Tensor, start: int = 0) -> torch.Tensor:
        # ``history`` is the active view the drafter holds; the processors need the full one
        scores = self.inner(self.full_history, self.rows.expand(draft_tokens), self.rows.expand(logits), start)
        return self.rows.take(scores)
