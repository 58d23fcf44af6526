"""Head drafting inside the engine: EAGLE and Medusa heads draft for every drafting request of a round at once.

Boundary: each request's head state, keyed by its request id, and the round's one batched drafting call. The
drafting math is the assistant's own (``EagleAssistant.propose_each``, ``MedusaAssistant.propose_each``: the code
its ``generate`` rounds run); who drafts how many nodes is the engine's (``draft_budget.py``); verifying, keeping
and rolling back is the round's (``speculation.py``). The assistant is never copied and nothing of it is written:
the engine holds one state per request and hands the drafting call the states of the round's drafting requests.

Per request:
    EAGLE   an ``EagleRows`` of one row: the head's K/V of the request's committed columns and the target
            features it has not fed yet. A round stacks the drafting requests' states into one rectangular state
            (``eagle.stack_rows``: columns right-aligned, holes masked), runs one catch-up forward and one head
            forward per tree level for all of them, and hands each request back its new K/V columns.
    Medusa  the target's hidden state that produced the request's newest token ``[1, H]``; a round runs the heads
            once over ``[R, H]``.

Cost: one batched call for the round instead of one per request (the heads' weights are read once per forward
for all rows). The draft budget costs a request's draft by its share of the call's time (``record(count,
seconds / R)``), so that the plan sees what drafting one more request adds at the current load.

Shapes: ``R`` drafting requests, ``C`` gathered feature columns, ``F`` feature width, ``H`` hidden size.
"""

from __future__ import annotations

import time

import torch

from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.drafters.eagle import EagleAssistant
from hf_kvspec.speculative.drafters.features import ensure_attached
from hf_kvspec.speculative.drafters.medusa import MedusaAssistant
from hf_kvspec.speculative.rounds import cap_proposal

from .drafting import Drafters
from .request import Request

HEAD_ASSISTANTS = (EagleAssistant, MedusaAssistant)


class HeadDrafters(Drafters):
    """The engine's drafter for an ``EagleAssistant`` or ``MedusaAssistant``: one state per request, one batched
    drafting call per round (module docstring)."""

    runs_target = False  # the heads borrow the target's embedding and LM head only

    def _begin(self, request: Request, features: torch.Tensor):
        # features [1, C, F]: the columns the request fed so far (fewer than its tokens after a prefix-cache hit)
        if isinstance(self.assistant, EagleAssistant):
            return self.assistant.open_rows(self.target, len(request.tokens), features)
        ensure_attached(self.assistant.heads, self.target)
        return features[:, -1]  # [1, H] the hidden state that produced the newest token

    def _end(self, state) -> None:
        pass  # a state holds tensors only

    def observe(self, request: Request, kept_width: int, num_accepted: int, num_draft: int,
                path_features: torch.Tensor | None, accepted_nodes: torch.Tensor) -> None:
        """The round's verdict: ``path_features`` ``[1, 1 + k, F]`` are the root's and the accepted path's."""
        if isinstance(self.assistant, EagleAssistant):
            self.states[request.request_id].observe(kept_width, path_features)
        else:
            self.states[request.request_id] = path_features[:, num_accepted]

    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s proposal ``[1, N]`` (N <= count), drafted in one batched call; ``record(count,
        seconds)`` gets each drafting request's share of its time. If the call raises, the drafting requests'
        states are dropped before the error propagates (the call may have fed some of them)."""
        drafting = [(request, count) for request, count in entries if count > 0]
        proposals = {}
        if drafting:
            started = time.perf_counter()
            try:
                made = self._propose(drafting)
            except BaseException:
                for request, _ in drafting:
                    self.drop(request)
                raise
            share = (time.perf_counter() - started) / len(drafting)
            for (request, count), proposal in zip(drafting, made):
                proposals[request.request_id] = cap_proposal(proposal, self.max_depth(request), max_nodes=count)
                if record is not None:
                    record(count, share)
        empty = DraftProposal(torch.zeros(1, 0, dtype=torch.long))
        return [proposals.get(request.request_id, empty) for request, _ in entries]

    def _propose(self, drafting: list[tuple[Request, int]]) -> list[DraftProposal]:
        states = [self.states[request.request_id] for request, _ in drafting]
        counts = [count for _, count in drafting]
        depths = [self.max_depth(request) for request, _ in drafting]
        if isinstance(self.assistant, EagleAssistant):
            return self.assistant.propose_each(states, [request.tokens for request, _ in drafting], counts, depths)
        return self.assistant.propose_each(torch.cat(states), counts, depths)
