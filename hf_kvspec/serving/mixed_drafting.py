"""Two drafters for one engine, chosen per request and round: the suffix pool or a model drafter (EAGLE, Medusa, a
draft model, n-gram), whichever promises more of that request's tokens per second (SuffixDecoding's hybrid,
arXiv 2411.04975, with the choice made from each request's own measured acceptance of each source).

Boundary: the choice. Drafting is ``suffix_drafting.py``'s and ``drafting.py``'s; K is the draft budget's
(``draft_budget.py``); verifying and keeping is the round's.

Each round a drafting request with K slots first looks up the pool (cheap: no model). Then, per request:

    suffix    expected accepted drafts  E_s = rho * (the pool draft's own estimate: the sum of its nodes' shares)
    model     expected accepted drafts  E_m = a + a^2 + ... + a^K, at the request's acceptance a of model drafts
    choice    the model's drafts when  (1 + E_m) * step / (step + d_m)  >  1 + E_s,  else the pool's

``rho`` is the request's measured ratio of accepted to estimated pool drafts and ``a`` its per-draft acceptance
of model drafts, each decayed and started from the pooled figure of all requests (worth ``PRIOR_WEIGHT`` rounds);
``d_m`` is the model drafter's measured seconds per request call and ``step`` the round forward's measured seconds.
Both drafters see every round, whoever drafted (a feature drafter needs the target's features of every committed
column; the pool needs the text), so switching costs nothing.
"""

from __future__ import annotations

import time

import torch

from hf_kvspec.speculative.draft_budget import DECAY
from hf_kvspec.speculative.drafters.base import DraftProposal

from .drafting import Drafters
from .request import Request
from .suffix_drafting import Ratio, SuffixDrafters


class MixedDrafters:
    """The engine's drafter for ``[SuffixAssistant, model assistant]`` (module docstring).

    Args:
        suffix: the pool's drafter.
        model: the model assistant's per-request drafter.
        step_seconds: the round forward's measured seconds (0 until one was measured).
    """

    shared_cost = False

    def __init__(self, suffix: SuffixDrafters, model: Drafters, step_seconds=lambda: 0.0):
        self.suffix, self.model, self.step_seconds = suffix, model, step_seconds
        self.assistant, self.feature_layers = model.assistant, model.feature_layers
        self.pool = suffix.pool
        self.suffix_ratio = Ratio(prior=1.0)  # accepted / estimated pool drafts
        self.model_alpha = Ratio(prior=0.6)  # accepted / offered model drafts, per draft position
        self.model_seconds = 0.0  # decayed mean of a model drafter call
        self.source: dict[int, str] = {}  # request id -> who drafted its row this round
        self.expected: dict[int, float] = {}  # request id -> the pool draft's own estimate, when the pool drafted
        self.drafted_by = {"suffix": 0, "model": 0}

    # ---- sessions ----------------------------------------------------------------------------------------
    def has_session(self, request: Request) -> bool:
        return self.suffix.has_session(request) or self.model.has_session(request)

    def draft_limit(self, request: Request) -> int:
        return max(self.suffix.draft_limit(request), self.model.draft_limit(request))

    def gather(self, request: Request, features) -> None:
        self.model.gather(request, features)

    def expected_gains(self, request: Request, limit: int) -> None:
        return None  # the source is chosen after the plan: K comes from the request's running acceptance

    def start(self, request: Request) -> None:
        self.suffix.start(request)
        if not self.model.has_session(request):
            self.model.start(request)

    def drop(self, request: Request) -> None:
        self.suffix.drop(request)
        self.model.drop(request)
        for table in (self.source, self.expected):
            table.pop(request.request_id, None)
        self.suffix_ratio.forget(request.request_id)
        self.model_alpha.forget(request.request_id)

    def observe(self, request: Request, kept_width: int, num_accepted: int, num_draft: int, path_features,
                accepted_nodes: torch.Tensor) -> None:
        """Both drafters see the round; the source that drafted learns its acceptance."""
        self.suffix.observe(request)
        if self.model.has_session(request):
            self.model.observe(request, kept_width, num_accepted, num_draft, path_features, accepted_nodes)
        else:  # a feature drafter's session begins once the request has fed a column
            self.model.gather(request, path_features[0] if path_features is not None else None)
            self.model.start(request)
        source = self.source.pop(request.request_id, None)
        if source == "suffix":
            self.suffix_ratio.add(request.request_id, num_accepted, self.expected.pop(request.request_id))
        elif source == "model" and num_draft:
            self.model_alpha.add(request.request_id, num_accepted, min(num_accepted + 1, num_draft))

    # ---- drafting ----------------------------------------------------------------------------------------
    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s proposal from the source the module docstring's rule picks."""
        proposals: dict[int, DraftProposal] = {}
        to_model = []
        for request, count in entries:
            started = time.perf_counter()
            pooled = self.suffix.propose(request, count)
            draft = self.suffix.last[request.request_id]
            if self._model_pays(request, count, draft.expected):
                to_model.append((request, count))
                continue
            proposals[request.request_id] = pooled
            self._chose(request, "suffix", draft.expected if draft.tokens else None)
            if record is not None:
                record(count, time.perf_counter() - started)
        started = time.perf_counter()
        for (request, _), proposal in zip(to_model, self.model.propose_rows(to_model, record)):
            proposals[request.request_id] = proposal
            self._chose(request, "model", None)
        if to_model:
            seconds = (time.perf_counter() - started) / len(to_model)
            self.model_seconds = DECAY * self.model_seconds + (1 - DECAY) * seconds if self.model_seconds else seconds
        return [proposals[request.request_id] for request, _ in entries]

    def _model_pays(self, request: Request, count: int, pool_expected: float) -> bool:
        if count <= 0 or not self.model.has_session(request):
            return False
        alpha = min(self.model_alpha(request.request_id), 1 - 1e-6)
        model_expected = alpha * (1 - alpha**count) / (1 - alpha)
        step = self.step_seconds()
        share = step / (step + self.model_seconds) if step > 0 else 1.0
        return (1 + model_expected) * share > 1 + self.suffix_ratio(request.request_id) * pool_expected

    def _chose(self, request: Request, source: str, expected: float | None) -> None:
        self.drafted_by[source] += 1
        if source == "suffix" and expected is None:
            return  # nothing drafted: a plain row, nothing to learn
        self.source[request.request_id] = source
        if expected is not None:
            self.expected[request.request_id] = expected
