"""Speculative rows of the serving engine: one request's newest token and its drafts, verified in the round's
packed forward beside everyone else's rows, then accepted and rolled back for that request alone.

Boundary: one request's verify row in the packed forward — its ``ForwardRow`` (tree positions and mask among the
new tokens). Everything else of the round is the speculative package's one implementation, the same the
``generate`` loop runs: ``rounds.plan_round`` decides chain or tree; ``round.accept`` processes each node's scores
after its own path, accepts (greedy, or speculative sampling with the request's own generator) and says which
columns stay; ``round.keep_columns`` keeps them (``RoundDrafts.keep`` at the commit). Who drafts is
``round_drafts.py``'s; committing and stopping are the engine's.

A verify row of request r (tokens ``t_0 .. t_{L-1}``, the cache holding the first ``L - 1``)::

    token_ids  [t_{L-1} | d_0 .. d_{N-1}]      the root (newest token), then the drafts in node order
    positions  [L - 1   | L - 1 + depth(n)]    a chain: L - 1 .. L - 1 + N
    mask       among the new tokens: a node sees the root, its ancestors and itself (None for a chain: causal)
    logits     at every new token: row 0 scores the root's children, row n + 1 the children of node n

Acceptance (``Leviathan et al. 2211.17192``; trees as in SpecInfer ``2305.09781``): greedy keeps the deepest path
equal to the target's argmax; sampling runs speculative sampling with the request's own generator, point-mass
drafts when the drafter returns no probabilities. Either way the row emits ``accepted + 1`` tokens, exactly the
target's (greedy) or distributed as the target's (sampling). Roll back: the root and the accepted path stay
(``round.keep_columns`` -> ``RaggedPagedCache.keep_new_tokens``: a chain, or a path that is a prefix of the node
order, only truncates).

Shapes: ``N`` drafts · ``V`` vocabulary · ``F`` feature width · ``k`` accepted drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.positions import History, PositionwiseProcessor
from hf_kvspec.speculative.round import accept
from hf_kvspec.speculative.rounds import plan_round

from .logprobs import TokenLogprob, token_logprobs
from .request import Request
from .runner import ForwardRow
from .sampling import warpers


def request_processor(request: Request) -> PositionwiseProcessor:
    """The request's logits processors, then (sampling) its warpers: ``softmax`` of the processed scores is the
    distribution its plain decode step samples from (``sampling.py``)."""
    return PositionwiseProcessor([*request.settings.logits_processor, *warpers(request.settings)])


@dataclass(frozen=True)
class Verdict:
    """What a verify row keeps."""

    tokens: list[int]  # accepted drafts, then the next token (the request's new output, before stop checks)
    num_accepted: int  # k
    num_draft: int  # N
    kept: torch.Tensor | None  # [1, 1 + k] new-token offsets that stay: the root (0), the path; None: a plain row
    accepted_nodes: torch.Tensor  # [1, k] node index of each accepted draft, in path order
    logprobs: tuple[TokenLogprob, ...] = ()  # per token, when the request asked for them (``logprobs.py``)


class VerifyRow:
    """One request's root and drafts (``proposal`` ``[1, N]``, ``N`` may be 0) in the round's packed forward."""

    def __init__(self, request: Request, proposal: DraftProposal):
        self.request, self.proposal = request, proposal
        self.round = plan_round(proposal)  # ChainRound or TreeRound: scores and the tree tensors
        self.num_draft = proposal.tokens.shape[1]
        self.processor = request_processor(request)

    def forward_row(self) -> ForwardRow:
        """The packed row: root + drafts, tree positions and mask, logits at every new token."""
        request, count = self.request, self.num_draft + 1
        start = request.num_computed
        tokens = [request.tokens[-1], *self.proposal.tokens[0].tolist()]
        positions, mask = None, None  # a chain: consecutive positions, causal
        if self.round.is_tree:
            tree = self.round.tree
            root = torch.tensor([start], device=tree.tokens.device)
            positions = tree.position_ids(root)[0].tolist()
            mask = tree.attention_mask(tree.tokens.new_ones(1, 0))[0, 0]  # [1 + N, 1 + N] bool
        return ForwardRow(request.request_id, tokens, start, positions, mask, tuple(range(count)))

    def accept(self, logits: torch.Tensor) -> Verdict:
        """Verify the drafts against the row's logits ``[1 + N, V]`` (``round.accept``, the loop's own, with the
        request's generator)."""
        request = self.request
        history = History(torch.tensor([request.tokens], device=logits.device), request.num_tokens + self.num_draft + 1,
                          0)
        verdict = accept(self.round, self.processor, history, logits[None], request.settings.do_sample,
                         generator=request.generator)
        count = int(verdict.counts[0])
        tokens = verdict.emitted[0, :count].tolist()
        kept = verdict.kept[:, :count]  # [1, 1 + k] the root and the accepted path
        return Verdict(tokens, count - 1, self.num_draft, kept, verdict.result.accepted_nodes[:, :count - 1],
                       self._logprobs(verdict.scores[0], verdict.score_rows[0, :count], tokens))

    def _logprobs(self, scores: torch.Tensor, rows: torch.Tensor, tokens: list[int]) -> tuple[TokenLogprob, ...]:
        """The emitted tokens' log-probabilities: ``scores`` ``[1 + N, V]``, ``rows`` ``[k + 1]`` the score row of
        each emitted token (``RoundVerdict.score_rows``)."""
        top = self.request.settings.logprobs
        if top is None:
            return ()
        return token_logprobs(scores.index_select(0, rows.to(scores.device)), tokens, top)
