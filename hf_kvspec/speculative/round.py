"""One speculative round's decisions, the same for ``generate``'s loop (``loop.py``) and the serving engine
(``serving/engine.py``)::

    plan    = plan_round(proposal)                         chain or tree (``rounds.py``): the verify forward's inputs
    logits  = <the caller's verify forward>                 the loop's padded batch, or the engine's packed rows
    verdict = accept(plan, processor, history, logits)      scores along each node's own path, the verifier's
                                                            decision, the tokens each row emits, what it keeps
    keep_columns(cache, start, verdict.kept[:, :1 + k])      the cache keeps each row's root and accepted path (k:
                                                            the longest kept path; an engine row its own k)

Boundary: everything in a round that decides; the callers run the forwards and commit (the loop into its buffer
and history, with stop checks per position; the engine into its requests, with stop checks per token). A drafter's
proposal is capped by ``rounds.cap_proposal`` on both sides before it is planned.

Shapes: ``A`` rows, ``N`` drafts (nodes), ``D`` deepest path, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvspec.cache.contract import keep_positions
from hf_kvspec.speculative.positions import History, PositionwiseProcessor
from hf_kvspec.speculative.rounds import AcceptanceRule, ChainRound, TreeRound
from hf_kvspec.speculative.tree import keep_indices
from hf_kvspec.speculative.verify import VerifyResult


@dataclass(frozen=True)
class RoundVerdict:
    """What one verify forward decided for its rows."""

    result: VerifyResult  # the verifier's: num_accepted [A], accepted_nodes [A, D], next_tokens [A]
    scores: torch.Tensor  # [A, 1 + N, V] processed float32 scores: row 0 after the root, row n + 1 after node n
    emitted: torch.Tensor  # [A, D + 1] each row's accepted drafts, then its next token (repeated past its count)
    score_rows: torch.Tensor  # [A, D + 1] the score row that scored emitted token j (0, then node + 1)
    kept: torch.Tensor  # [A, 1 + D] new columns that stay: the root (0), then the path (a shorter row repeats)

    @property
    def counts(self) -> torch.Tensor:
        """[A] tokens each row emits: its accepted drafts and the next token."""
        return self.result.num_accepted + 1


def accept(plan: ChainRound | TreeRound, processor: PositionwiseProcessor, history: History, logits: torch.Tensor,
           do_sample: bool, rule: AcceptanceRule | None = None,
           generator: torch.Generator | None = None) -> RoundVerdict:
    """Verify ``plan``'s drafts against the verify forward's ``logits`` [A, 1 + N, V]: each node's scores processed
    after its own path (``history`` and ``processor``: the rows as plain ``generate`` sees them), then greedy or
    speculative sampling (``generator``: a request's own) or a drafter's own ``rule``."""
    scores = plan.scores(processor, history, logits)
    result = plan.verify(scores, do_sample, rule, generator)
    drafts = plan.proposal.tokens.to(result.next_tokens.device)
    emitted = torch.cat([result.accepted_tokens(drafts), result.next_tokens[:, None]], dim=1)
    emitted.scatter_(1, result.num_accepted[:, None], result.next_tokens[:, None])  # [A, D + 1]
    nodes = result.accepted_nodes  # [A, D], -1 past each row's count (D = 0 in a round that drafted nothing)
    score_rows = torch.cat([nodes.new_zeros(nodes.shape[0], 1), torch.where(nodes >= 0, nodes + 1, 0)], dim=1)
    return RoundVerdict(result, scores, emitted, score_rows, keep_indices(nodes))


def keep_columns(cache, start: int, kept: torch.Tensor, *, new: int | None = None, tree: bool = False,
                 seq_id: int | None = None, sliding: bool = False) -> None:
    """The one way a round's cache keeps its verified columns: of the ``new`` columns written from ``start`` on,
    those in ``kept`` ``[A, 1 + k]`` (ascending; a row that kept fewer repeats its last index, the caller masks
    that hole) move to ``start, start + 1, ...`` and the rest go.

        an engine sequence (``seq_id``, A = 1)   ``RaggedPagedCache.keep_new_tokens`` (a prefix only truncates)
        a chain, any other cache                 crop to ``start + 1 + k``; ``sliding`` layers that record their past
                                                 are cropped even when nothing was rejected (back to the window)
        a tree, any other cache                  ``keep_positions`` (cache contract C4)
    """
    if seq_id is not None:
        cache.keep_new_tokens(seq_id, start, kept[0].tolist())
    elif tree:
        keep_positions(cache, start, kept)
    elif new is None:
        raise TypeError("keep_columns() of a chain needs new= (the columns the verify forward wrote)")
    elif new > kept.shape[1] or sliding:
        cache.crop(kept.shape[1] - new)
