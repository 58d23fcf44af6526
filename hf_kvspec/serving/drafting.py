"""Drafting inside the serving engine for an assistant of the user's own: one ``Assistant.spawn()`` of it per
decoding request, begun on that request alone (a one-row ``DraftContext``). The engine's own drafters need none:
EAGLE/Medusa heads keep a state per request and draft for all of them in one call (``head_drafting.py``), draft
models draft in one packed forward per depth on a cache of their own (``model_drafting.py``), n-gram lookups read
each request's tokens (``lookup_drafting.py``), and self-drafting and the suffix pool have theirs
(``self_drafting.py``, ``suffix_drafting.py``). ``Drafters`` below is also the base those share: per-request
state keyed by request id, features gathered before it begins, limits, and forgetting a request.

Boundary: adapts the speculative package's ``Assistant`` protocol — made for one rectangular ``generate`` call —
to requests that join, leave and are recomputed between rounds. It owns the per-request states and the target
features gathered for them; verification is ``speculation.py``'s, the forward ``runner.py``'s, K/V
``RaggedPagedCache``'s.

Why one spawned assistant per request for an arbitrary assistant: it keeps per-call state aligned with one
rectangular buffer (column by column). With rows of different lengths arriving at any round, one batched context
would have to re-align or re-prefill that state whenever the set of rows changes; a one-row buffer per request
never needs either, and is exact under joins, leaves and preemption by construction: the state begins when the
request's prefill ends, from that request's own tokens and features, and ends when the request finishes, is
cancelled or preempted. The price is one ``propose`` per drafting request per round. The engine's budget gives
each call its K (``DraftContext.num_draft_tokens``); the spawned assistant has no tuner of its own.

Features (assistants with ``wants_hidden_states``): the runner captures the target's features on the packed
forward (``FeatureCapture``) and each request gets its own columns. Until its state begins they are gathered
(prefill chunks); the state begins with them; afterwards each round's ``observe`` gets the columns of the
root and the accepted path. Columns a request never fed (a prefix-cache hit) have no features: EAGLE takes zeros
for them, which stays exact (only fewer drafts are accepted).

Shapes: ``L`` tokens of a request, ``N`` draft tokens, ``F`` feature width, ``C`` gathered feature columns.
"""

from __future__ import annotations

import time

import torch

from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal, RoundOutcome
from hf_kvspec.speculative.positions import History
from hf_kvspec.speculative.rounds import cap_proposal

from .request import Request
from .speculation import request_processor

#: drafts per request per round when the assistant's own size is ``"auto"`` and the engine is given none
AUTO_DRAFT_TOKENS = 8


def resolve_assistant(assistant, model):
    """An ``Assistant``, or a spec string: ``ngram``, ``draft:...``, ``early_exit`` ... (``make_assistant``) or
    ``medusa`` / ``eagle`` (the bundled heads, ``make_head_assistant``)."""
    if not isinstance(assistant, str):
        return assistant
    from hf_kvspec.speculative.assistants import HEAD_ASSISTANTS, make_assistant, make_head_assistant

    if assistant in HEAD_ASSISTANTS:
        return make_head_assistant(assistant, model)
    if assistant == "suffix":  # the engine's pool keeps unsalted requests apart (``suffix_drafting.py``)
        from hf_kvspec.speculative.drafters.suffix import SuffixAssistant
        from hf_kvspec.speculative.suffix_pool import SuffixPool

        return SuffixAssistant(pool=SuffixPool())
    return make_assistant(assistant, model)


def check_assistant(assistant: Assistant, sliding: bool) -> None:
    """Refuse, by name, what the engine cannot run exactly, one spawned assistant per request."""
    if not isinstance(assistant, Assistant):
        raise TypeError(f"assistant must be an hf_kvspec Assistant or a spec string, got {type(assistant).__name__}.")
    name = type(assistant).__name__
    if assistant.shares_target_cache or assistant.runs_verify_forward:
        raise ValueError(f"{name} drafts with the target's own cache (self-speculation); the engine's paged cache "
                         "is shared by all requests. Use ngram, a draft model, medusa, eagle or self-int8.")
    if assistant.acceptance != "exact":
        raise ValueError(f"{name}(acceptance={assistant.acceptance!r}) is lossy; the engine verifies exactly. "
                         "Build the assistant with acceptance='exact'.")
    if assistant.proposes_trees and sliding:
        raise ValueError(f"{name} drafts trees, and this model has sliding-window layers, where the engine's "
                         "attention takes no tree mask; use a chain drafter (ngram, a draft model).")


class Drafters:
    """One spawned assistant per decoding request (module docstring), and the features gathered before each
    begins; the base of the engine's batched drafters, whose per-request states replace the spawned assistants."""

    def __init__(self, assistant: Assistant, target, num_draft_tokens: int | None, pad_token_id: int):
        own = assistant.num_draft_tokens
        size = num_draft_tokens if num_draft_tokens is not None else (
            own if isinstance(own, int) else min(AUTO_DRAFT_TOKENS, assistant.max_draft_tokens))
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"num_draft_tokens must be a non-negative int, got {size!r}.")
        self.assistant, self.target, self.num_draft_tokens = assistant, target, size
        self.pad_token_id = pad_token_id
        self.feature_layers = tuple(assistant.feature_layers) if assistant.wants_hidden_states else None
        self.states: dict[int, object] = {}  # request id -> its drafter state (here: a spawned Assistant)
        self._gathered: dict[int, list[torch.Tensor]] = {}  # request id -> feature columns [n, F] each

    def has_state(self, request: Request) -> bool:
        return request.request_id in self.states

    def draft_limit(self, request: Request) -> int:
        """Drafts ``request`` would verify next round: 0 without a drafter state or when its next token is its last
        (a path of ``room - 1`` drafts plus the next token fills the tokens left)."""
        room = request.settings.max_new_tokens - len(request.output_ids)
        if not self.has_state(request) or room <= 1:
            return 0
        return self.num_draft_tokens if self.assistant.proposes_trees else min(self.num_draft_tokens, room - 1)

    def max_depth(self, request: Request) -> int:
        return request.settings.max_new_tokens - len(request.output_ids) - 1

    shared_cost = False  # each request's draft call costs its own time (``DraftBudget``)
    pool = None  # no suffix pool
    #: a spawned assistant may run the target's own forward (e.g. a subclass of ``DraftModelAssistant`` whose
    #: draft model is the target), outside the engine's attention (``RoundDrafts.runs_target_outside``)
    runs_target = True

    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s proposal ``[1, N]`` (N <= count), one request at a time; ``record(count,
        seconds)`` gets each call's time. A request whose drafter raises loses its state before the error propagates."""
        proposals = []
        for request, count in entries:
            started = time.perf_counter()
            try:
                proposals.append(self._propose_one(request, count) if count > 0
                                 else DraftProposal(torch.zeros(1, 0, dtype=torch.long)))
            except BaseException:
                self.drop(request)
                raise
            if record is not None:
                record(count, time.perf_counter() - started)
        return proposals

    def _propose_one(self, request: Request, count: int) -> DraftProposal:
        """``request``'s spawned assistant drafts at most ``count`` nodes ``[1, N]`` (a chain or a tree), no path
        deeper than the tokens it has left."""
        ctx = self._context(request, count)
        return cap_proposal(self.states[request.request_id].propose(ctx), ctx.max_depth, max_nodes=count)

    def _context(self, request: Request, count: int) -> DraftContext:
        """A one-row ``DraftContext`` over ``request``'s tokens for at most ``count`` drafts: its processors and
        warpers, no path deeper than the tokens it has left."""
        buffer = self._buffer(request.tokens)
        history = History(buffer.tokens, buffer.width + count + 1, self.pad_token_id)
        alive = torch.ones(1, dtype=torch.bool, device=self.target.device)
        return DraftContext(buffer, history, count, request.settings.do_sample, alive, request_processor(request),
                            max_depth=self.max_depth(request))

    def _buffer(self, tokens: list[int]) -> TokenBuffer:
        # [1, L]: every column real, the last one (the newest token) not yet in the target's cache
        return TokenBuffer(torch.tensor([tokens], device=self.target.device), None, self.pad_token_id)

    def observe(self, request: Request, kept_width: int, num_accepted: int, num_draft: int,
                path_features: torch.Tensor | None, accepted_nodes: torch.Tensor) -> None:
        """``request``'s round verdict: the target now holds ``kept_width`` of its tokens; ``path_features``
        ``[1, 1 + num_accepted, F]`` are the root's and the accepted path's."""
        device = self.target.device
        outcome = RoundOutcome(kept_width, torch.tensor([num_accepted], device=device),
                               torch.ones(1, dtype=torch.bool, device=device), num_draft, 0.0, 0.0, path_features,
                               accepted_nodes=accepted_nodes)
        self.states[request.request_id].observe(outcome)

    def expected_gains(self, request: Request, limit: int, rows: int = 1) -> None:
        return None  # drafts are made after the plan: K comes from the request's running acceptance

    def gather(self, request: Request, features: torch.Tensor | None) -> None:
        """Features ``[n, F]`` of columns ``request`` fed while it has no drafter state."""
        if self.feature_layers is not None and features is not None:
            self._gathered.setdefault(request.request_id, []).append(features.clone())

    def start(self, request: Request) -> None:
        """Begin ``request``'s drafter state on its tokens (its prefill, or a plain decode step, has just ended)."""
        stale = self.states.pop(request.request_id, None)
        if stale is not None:  # a recompute whose preemption bypassed the engine (Scheduler.preempt)
            self._end(stale)
        gathered = self._gathered.pop(request.request_id, [])
        features = torch.cat(gathered)[None] if self.feature_layers is not None and gathered else None
        if self.feature_layers is not None and features is None:
            return  # a feature drafter needs at least the newest column's feature: begin after the next forward
        self.states[request.request_id] = self._begin(request, features)

    def _begin(self, request: Request, features: torch.Tensor | None):
        """The state of ``request``: a spawned assistant begun on its tokens (features ``[1, C, F]`` | None)."""
        assistant = self.assistant.spawn()
        assistant.begin(self.target, self._buffer(request.tokens), target_hidden=features)
        return assistant

    def _end(self, state) -> None:
        state.end()

    def drop(self, request: Request) -> None:
        """``request`` finished, was cancelled or preempted, or its drafter broke: forget its drafter state."""
        self._gathered.pop(request.request_id, None)
        state = self.states.pop(request.request_id, None)
        if state is not None:
            self._end(state)
