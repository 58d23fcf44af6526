"""Draft-model drafting inside the engine: a smaller causal LM drafts a chain for every drafting request of a round
at once, one packed forward per draft depth, on a paged cache of its own.

Boundary: the draft model's K/V (a ``RaggedPagedCache`` of the draft's config, one sequence per request, keyed by
request id) and the draft forwards (a ``ForwardRunner`` over the draft model: the fast forward where it applies,
ragged attention as the engine's). Which requests draft how many tokens is the engine's (``draft_budget.py``);
verifying and keeping the target's K/V is the round's (``speculation.py``). The assistant is never copied and
nothing of it is written: ``DraftModelAssistant`` lends its model and its vocabulary rules only.

A round with requests a (3 drafts; its draft cache lacks its last two tokens t, r) and b (1 draft; lacks r)::

    depth 0   packed [t_a r_a | r_b]   -> d_a0, d_b0     catch-up: the columns the draft cache lacks, root last
    depth 1   packed [d_a0]            -> d_a1
    depth 2   packed [d_a1]            -> d_a2           the last draft is never fed: the target verifies it

Each depth's forward commits its columns to the draft cache. After the verdict (``k`` drafts accepted by a request
of ``L`` tokens that drafted ``N``) the draft cache keeps what equals the committed tokens: the root and the
accepted drafts it fed, ``min(L + k, L + N - 1)`` columns; the next round's catch-up feeds the rest. A request
that sits at K = 0 for a while only falls behind: its next catch-up is longer. A request the draft cache has no
blocks for drafts nothing that round (its draft K/V is dropped and rebuilt later), which costs speed, never
exactness.

Drafts are processed as the target's scores are (the request's processors and warpers, each draft after the
ones before it) and, for a sampling request with ``sample_drafts``, drawn from that distribution with the
request's own generator and returned with it for rejection sampling; otherwise the argmax (a point mass).

Cost: one forward per depth for all requests drafting at it (the draft's weights are read once per forward); the
budget costs a request's draft by its share of the round's drafting time, as for the heads (``head_drafting.py``).

Shapes: ``n`` requests drafting at a depth, ``V`` the target's vocabulary, ``T`` packed tokens of a draft forward.
"""

from __future__ import annotations

import time

import torch

from hf_kvspec.cache.ragged import RaggedPagedCache
from hf_kvspec.speculative.drafters.base import ChainDraft, DraftProposal
from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant, check_vocabulary, to_target_vocabulary

from .drafting import Drafters
from .request import Request
from .runner import ForwardRow, ForwardRunner

MODEL_ASSISTANTS = (DraftModelAssistant,)


def draft_cache_blocks(target_cache: RaggedPagedCache) -> int:
    """Blocks of the draft cache: the target cache's, plus an eighth for the drafts each request feeds past its
    committed tokens (the draft cache holds at most ``L + N - 1`` tokens of a request the target holds ``L - 1``
    of, and shares no prefixes)."""
    total = target_cache.num_total_blocks()
    return total + max(total // 8, 4)


class ModelDrafters(Drafters):
    """The engine's drafter for a ``DraftModelAssistant``: the draft model's K/V per request in a paged cache of its
    own, one packed draft forward per depth for the round's drafting requests (module docstring).

    Args:
        assistant: the ``DraftModelAssistant`` (its model drafts; its ``fast_forward`` and ``sample_drafts`` apply).
        target: the engine's model.
        target_cache: the engine's ``RaggedPagedCache`` (the draft cache's block size and count follow it).
        num_draft_tokens: drafts per request per round at most (default the assistant's own size).
        pad_token_id: the target's pad id.
    """

    runs_target = False  # the draft forwards run on the draft cache with the engine's ragged attention

    def __init__(self, assistant: DraftModelAssistant, target, target_cache: RaggedPagedCache,
                 num_draft_tokens: int | None, pad_token_id: int):
        super().__init__(assistant, target, num_draft_tokens, pad_token_id)
        draft = assistant.model
        self.target_vocab = check_vocabulary(draft, target)
        self.cache = RaggedPagedCache(draft.config, draft_cache_blocks(target_cache), target_cache.block_size,
                                      enable_prefix_caching=False, dtype=draft.dtype)
        self.runner = ForwardRunner(draft, self.cache, fast_forward=assistant.fast_forward)

    # ---- per-request state: the request's sequence in the draft cache ------------------------------------
    def _begin(self, request: Request, features) -> int:
        self.cache.add_sequence(request.request_id, ())
        return request.request_id

    def _end(self, state: int) -> None:
        self.cache.release(state)

    def observe(self, request: Request, kept_width: int, *verdict) -> None:
        """The target now holds ``kept_width`` tokens of ``request``: the draft cache keeps at most those (nothing to
        do for a request whose draft K/V was dropped this round for want of room)."""
        if request.request_id in self.states and self.cache.length(request.request_id) > kept_width:
            self.cache.truncate(request.request_id, kept_width)

    def telemetry(self) -> dict:
        """The draft cache's blocks in use and in all."""
        total = self.cache.num_total_blocks()
        return {"draft_cache": {"used_blocks": total - self.cache.num_free_blocks(), "total_blocks": total}}

    # ---- drafting -----------------------------------------------------------------------------------------
    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s chain ``[1, N]`` (N <= count), drafted together, one packed forward per depth;
        ``record(count, seconds)`` gets each drafting request's share of the time. If a forward
        raises, the drafting requests' draft K/V are dropped before the error propagates."""
        drafting = self._room([(request, min(count, self.max_depth(request))) for request, count in entries])
        try:
            chains = self._draft(drafting, record)
        except BaseException:
            for request, _ in drafting:
                self.drop(request)
            raise
        empty = DraftProposal(torch.zeros(1, 0, dtype=torch.long))
        return [chains.get(request.request_id, empty) for request, _ in entries]

    def _room(self, entries: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The entries that draft: a positive count and room in the draft cache for their catch-up and drafts; a
        request left without room loses its draft K/V (begun again at its next plain row)."""
        free, drafting = self.cache.num_free_blocks(), []
        for request, count in entries:
            if count <= 0:
                continue
            self._settle(request)
            needed = self.cache.blocks_to_grow(request.request_id, len(request.tokens) + count - 1)
            if needed <= free:
                free -= needed
                drafting.append((request, count))
            elif self.cache.length(request.request_id) > 0:
                before = self.cache.num_free_blocks()
                self.drop(request)  # frees its blocks for the others; restarted from its tokens later
                free += self.cache.num_free_blocks() - before
        return drafting

    def _settle(self, request: Request) -> None:
        """Hold at most the request's committed columns (all its tokens but the newest): a round that drafted
        and then failed, or whose drafts were all dropped before verifying, leaves draft columns behind."""
        committed = len(request.tokens) - 1
        if self.cache.length(request.request_id) > committed:
            self.cache.truncate(request.request_id, committed)

    def _draft(self, drafting: list[tuple[Request, int]], record) -> dict[int, DraftProposal]:
        """The chains of ``drafting``, depth by depth (module docstring's picture); ``record(count, seconds)`` gets
        each request's share of the drafting time (a long catch-up, a request's first, is no draft's cost)."""
        chains = {request.request_id: self._chain(request, count) for request, count in drafting}
        fed = {request.request_id: request.tokens[self.cache.length(request.request_id):] for request, _ in drafting}
        seconds = 0.0
        for depth in range(max((count for _, count in drafting), default=0)):
            started = time.perf_counter()
            active = [request for request, count in drafting if count > depth]
            rows = [(request.request_id, fed[request.request_id]) for request in active]
            for request, row_logits in zip(active, self._forward(rows)):  # [n, V]
                token = chains[request.request_id].next(row_logits[None, None].to(self.target.device))  # [1]
                fed[request.request_id] = [int(token[0])]
            if depth or sum(len(tokens) for _, tokens in rows) <= 2 * len(rows):
                seconds += time.perf_counter() - started
        for _, count in drafting if record is not None else ():
            record(count, seconds / len(drafting))
        return {request_id: chain.proposal() for request_id, chain in chains.items()}

    def _chain(self, request: Request, count: int) -> ChainDraft:
        """``request``'s chain (``ChainDraft``, as ``DraftModelAssistant`` drafts in ``generate``): each draft
        processed after the request's tokens and the drafts before it, sampled with the request's generator when
        it samples and the assistant samples drafts, else the argmax."""
        ctx = self._context(request, count)
        return ChainDraft(ctx, ctx.buffer.tokens[:, :0], sample=self.assistant.sample_drafts,
                          generator=request.generator)

    def _forward(self, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One committed draft forward: each ``(request id, tokens)`` fed after what the draft cache holds of it ->
        the draft's logits after each row's last token, over the target's vocabulary ``[n, V]``."""
        forward_rows = []
        for seq_id, tokens in rows:
            start = self.cache.length(seq_id)
            ids = self.assistant.draft_ids(torch.tensor(tokens, dtype=torch.long), self.target_vocab).tolist()
            self.cache.reserve(seq_id, start + len(ids))
            forward_rows.append(ForwardRow(seq_id, ids, start, logits_at=(len(ids) - 1,)))
        ok = False
        try:
            logits = self.runner.forward(forward_rows)  # [n, V_draft]
            ok = True
        finally:
            self.cache.end_forward(ok=ok)
        return to_target_vocabulary(logits, self.target_vocab)

