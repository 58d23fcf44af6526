"""Drafting inside the serving engine through per-request sessions: a draft model, or an assistant of the user's
own, gets a private copy begun on each decoding request alone (a one-row ``DraftContext``). The engine's own
drafters need no copies: EAGLE/Medusa heads keep a state per request and draft for all of them in one call
(``head_drafting.py``), n-gram lookups read each request's tokens (``lookup_drafting.py``), and self-drafting and
the suffix pool have theirs (``self_drafting.py``, ``suffix_drafting.py``). ``Drafters`` below is also the base
those share: features gathered before a request's state begins, limits, and forgetting a request.

Boundary: adapts the speculative package's ``Assistant`` protocol — made for one rectangular ``generate`` call —
to requests that join, leave and are recomputed between rounds. It owns the sessions and the target features
gathered for them; verification is ``speculation.py``'s, the forward ``runner.py``'s, K/V ``RaggedPagedCache``'s.

Why one session per request for an arbitrary assistant: such an assistant keeps per-call state aligned with one
rectangular buffer (a draft model's cache, column by column). With rows of different lengths arriving at any
round, one batched context would have to re-align or re-prefill that state whenever the set of rows changes; a
one-row buffer per request never needs either, and is exact under joins, leaves and preemption by construction:
a session begins when the request's prefill ends, from that request's own tokens and features, and is dropped when
the request finishes, is cancelled or preempted. The price is one ``propose`` per drafting request per round (a
draft model's forwards are not yet packed across requests). A session takes a shallow copy of the assistant
(models shared, state its own) with its ``"auto"`` draft-length tuner off: the engine's budget sizes the drafts.

Features (assistants with ``wants_hidden_states``): the runner captures the target's features on the packed
forward (``FeatureCapture``) and each request gets its own columns. Until its state begins they are gathered
(prefill chunks); the state begins with them; afterwards each round's ``observe`` gets the columns of the
root and the accepted path. Columns a request never fed (a prefix-cache hit) have no features: EAGLE takes zeros
for them, which stays exact (only fewer drafts are accepted).

Shapes: ``L`` tokens of a request, ``N`` draft tokens, ``F`` feature width, ``C`` gathered feature columns.
"""

from __future__ import annotations

import copy
import time

import torch

from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal, RoundOutcome
from hf_kvspec.speculative.positions import History, PositionwiseProcessor
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
    """Refuse, by name, what the engine cannot run exactly with per-request sessions."""
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


class DraftSession:
    """One request's drafter: a private copy of the engine's assistant, begun on the request's tokens."""

    def __init__(self, template: Assistant, target, tokens: list[int], features: torch.Tensor | None,
                 pad_token_id: int):
        self.assistant = copy.copy(template)
        self.assistant.auto = None  # the engine's budget sizes the drafts (module docstring)
        self.device, self.pad_token_id = target.device, pad_token_id
        self.assistant.begin(target, self._buffer(tokens), target_hidden=features)  # features [1, C, F] | None

    def _buffer(self, tokens: list[int]) -> TokenBuffer:
        # [1, L]: every column real, the last one (the newest token) not yet in the target's cache
        return TokenBuffer(torch.tensor([tokens], device=self.device), None, self.pad_token_id)

    def propose(self, request: Request, count: int, max_depth: int,
                processor: PositionwiseProcessor) -> DraftProposal:
        """At most ``count`` drafts ``[1, N]`` (a chain or a tree), no path deeper than ``max_depth``."""
        buffer = self._buffer(request.tokens)
        history = History(buffer.tokens, buffer.width + count + 1, self.pad_token_id)
        alive = torch.ones(1, dtype=torch.bool, device=self.device)
        ctx = DraftContext(buffer, history, count, request.settings.do_sample, alive, processor, max_depth=max_depth)
        return cap_proposal(self.assistant.propose(ctx), max_depth, max_nodes=count)

    def observe(self, kept_width: int, num_accepted: int, num_draft: int, path_features: torch.Tensor | None,
                accepted_nodes: torch.Tensor) -> None:
        """The round's verdict: the target now holds ``kept_width`` tokens of the request; ``path_features``
        ``[1, 1 + num_accepted, F]`` are the root's and the accepted path's."""
        accepted = torch.tensor([num_accepted], device=self.device)
        alive = torch.ones(1, dtype=torch.bool, device=self.device)
        self.assistant.observe(RoundOutcome(kept_width, accepted, alive, num_draft, 0.0, 0.0, path_features,
                                            accepted_nodes=accepted_nodes))

    def end(self) -> None:
        self.assistant.end()


class Drafters:
    """The engine's drafter sessions, one per decoding request, and the features gathered before each begins."""

    def __init__(self, assistant: Assistant, target, num_draft_tokens: int | None, pad_token_id: int):
        own = assistant.num_draft_tokens
        size = num_draft_tokens if num_draft_tokens is not None else (
            own if isinstance(own, int) else min(AUTO_DRAFT_TOKENS, assistant.max_draft_tokens))
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"num_draft_tokens must be a non-negative int, got {size!r}.")
        self.assistant, self.target, self.num_draft_tokens = assistant, target, size
        self.pad_token_id = pad_token_id
        self.feature_layers = tuple(assistant.feature_layers) if assistant.wants_hidden_states else None
        self.sessions: dict[int, DraftSession] = {}
        self._gathered: dict[int, list[torch.Tensor]] = {}  # request id -> feature columns [n, F] each

    def has_session(self, request: Request) -> bool:
        return request.request_id in self.sessions

    def draft_limit(self, request: Request) -> int:
        """Drafts ``request`` would verify next round: 0 without a session or when its next token is its last
        (a path of ``room - 1`` drafts plus the next token fills the tokens left)."""
        room = request.settings.max_new_tokens - len(request.output_ids)
        if not self.has_session(request) or room <= 1:
            return 0
        return self.num_draft_tokens if self.assistant.proposes_trees else min(self.num_draft_tokens, room - 1)

    def max_depth(self, request: Request) -> int:
        return request.settings.max_new_tokens - len(request.output_ids) - 1

    shared_cost = False  # each request's draft call costs its own time (``DraftBudget``)
    pool = None  # no suffix pool
    #: a session's assistant may run the target's own forward (a draft model that is the target), outside the
    #: engine's attention (``RoundDrafts.runs_target_outside``)
    runs_target = True

    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s proposal ``[1, N]`` (N <= count), one session at a time; ``record(count,
        seconds)`` gets each call's time. A session that raises is dropped before the error propagates."""
        proposals = []
        for request, count in entries:
            started = time.perf_counter()
            try:
                proposals.append(self.sessions[request.request_id].propose(
                    request, count, self.max_depth(request), request_processor(request)) if count > 0
                    else DraftProposal(torch.zeros(1, 0, dtype=torch.long)))
            except BaseException:
                self.drop(request)
                raise
            if record is not None:
                record(count, time.perf_counter() - started)
        return proposals

    def observe(self, request: Request, kept_width: int, num_accepted: int, num_draft: int,
                path_features: torch.Tensor | None, accepted_nodes: torch.Tensor) -> None:
        """``request``'s round verdict for its session (``DraftSession.observe``)."""
        self.sessions[request.request_id].observe(kept_width, num_accepted, num_draft, path_features, accepted_nodes)

    def expected_gains(self, request: Request, limit: int, rows: int = 1) -> None:
        return None  # drafts are made after the plan: K comes from the request's running acceptance

    def gather(self, request: Request, features: torch.Tensor | None) -> None:
        """Features ``[n, F]`` of columns ``request`` fed while it has no session."""
        if self.feature_layers is not None and features is not None:
            self._gathered.setdefault(request.request_id, []).append(features.clone())

    def start(self, request: Request) -> None:
        """Begin ``request``'s session on its tokens (its prefill, or a plain decode step, has just ended)."""
        stale = self.sessions.pop(request.request_id, None)
        if stale is not None:  # a recompute whose preemption bypassed the engine (Scheduler.preempt)
            self._end(stale)
        gathered = self._gathered.pop(request.request_id, [])
        features = torch.cat(gathered)[None] if self.feature_layers is not None and gathered else None
        if self.feature_layers is not None and features is None:
            return  # a feature drafter needs at least the newest column's feature: begin after the next forward
        self.sessions[request.request_id] = self._begin(request, features)

    def _begin(self, request: Request, features: torch.Tensor | None):
        """The session of ``request`` (features ``[1, C, F]`` | None)."""
        return DraftSession(self.assistant, self.target, request.tokens, features, self.pad_token_id)

    def _end(self, session) -> None:
        session.end()

    def drop(self, request: Request) -> None:
        """``request`` finished, was cancelled or preempted, or its session broke: forget its drafter state."""
        self._gathered.pop(request.request_id, None)
        session = self.sessions.pop(request.request_id, None)
        if session is not None:
            self._end(session)
