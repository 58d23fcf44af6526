"""Two drafters for one engine, chosen per request and round: the suffix pool or a model drafter (EAGLE, Medusa, a
draft model, n-gram), whichever promises more of that request's tokens per second (SuffixDecoding's hybrid,
arXiv 2411.04975, with the choice made from each request's own measured acceptance of each source).

Boundary: the choice. Drafting is ``suffix_drafting.py``'s and ``drafting.py``'s; K is the draft budget's
(``draft_budget.py``); verifying and keeping is the round's.

Before the plan each drafting request looks up the pool (cheap: no model) for a draft as long as its limit, and
its source is chosen then, per request, for a round of S decoding requests whose forward takes ``step`` seconds:

    suffix    expected accepted drafts  E_s = rho * (the pool draft's own estimate: the sum of its nodes' shares)
    model     expected accepted drafts  E_m = a + a^2 + ... + a^K, at the request's acceptance a of model drafts
    choice    the model's drafts when  (S + E_m) / (step + d_m)  >  (S + E_s) / step,  else the pool's

that is, the round's tokens per second with this request drafting from one source or the other: a model draft
call of ``d_m`` seconds delays every row of the round, a lookup none. ``rho`` is the request's measured ratio of
accepted to estimated pool drafts (``SuffixDrafters.ratio``) and ``a`` its per-draft acceptance of model drafts,
each decayed and started from the pooled figure of all requests (worth ``PRIOR_WEIGHT`` rounds); ``d_m`` is the
model drafter's measured seconds per request call and ``step`` the round forward's measured seconds. A request
drafting from the pool gives the draft budget its gains (its lookup's cost is sunk, as for the pool alone); one
drafting from the model gives none (the budget uses its measured acceptance and the model's measured draft cost,
which only model calls feed). Both drafters see every round, whoever drafted (a feature drafter needs the
target's features of every committed column; the pool needs the text), so switching costs nothing.
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
        self.runs_target = model.runs_target
        self.assistant, self.feature_layers = model.assistant, model.feature_layers
        self.pool = suffix.pool
        self.model_alpha = Ratio(prior=0.6)  # accepted / offered model drafts, per draft position
        self.model_seconds = 0.0  # decayed mean of a model drafter call
        self.planned: dict[int, str] = {}  # request id -> the source chosen before this round's plan
        self.source: dict[int, str] = {}  # request id -> who drafted its row this round
        self.drafted_by = {"suffix": 0, "model": 0}

    # ---- per-request state -------------------------------------------------------------------------------------
    def has_state(self, request: Request) -> bool:
        return self.suffix.has_state(request) or self.model.has_state(request)

    def draft_limit(self, request: Request) -> int:
        return max(self.suffix.draft_limit(request), self.model.draft_limit(request))

    def gather(self, request: Request, features) -> None:
        self.model.gather(request, features)

    def expected_gains(self, request: Request, limit: int, rows: int = 1) -> tuple[float, ...] | None:
        """Before the plan: the pool's gains for ``request`` when its pool draft wins in a round of ``rows``
        decoding requests (module docstring), None when the model's drafts promise more (K then comes from its
        measured acceptance)."""
        draft = self.suffix.preview(request, limit)
        model = self._model_pays(request, limit, draft.expected, rows)
        self.planned[request.request_id] = "model" if model else "suffix"
        return None if model else self.suffix.gains(request, draft)

    def start(self, request: Request) -> None:
        self.suffix.start(request)
        if not self.model.has_state(request):
            self.model.start(request)

    def drop(self, request: Request) -> None:
        self.suffix.drop(request)
        self.model.drop(request)
        for table in (self.planned, self.source):
            table.pop(request.request_id, None)
        self.model_alpha.forget(request.request_id)

    def observe(self, request: Request, kept_width: int, num_accepted: int, num_draft: int, path_features,
                accepted_nodes: torch.Tensor) -> None:
        """Both drafters see the round; the source that drafted learns its acceptance (the pool its ratio)."""
        self.suffix.observe(request, kept_width, num_accepted)
        if self.model.has_state(request):
            self.model.observe(request, kept_width, num_accepted, num_draft, path_features, accepted_nodes)
        else:  # a feature drafter's state begins once the request has fed a column
            self.model.gather(request, path_features[0] if path_features is not None else None)
            self.model.start(request)
        if self.source.pop(request.request_id, None) == "model" and num_draft:
            self.model_alpha.add(request.request_id, num_accepted, min(num_accepted + 1, num_draft))

    # ---- drafting ----------------------------------------------------------------------------------------
    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s proposal from the source chosen before the plan (or now, by the same rule,
        when there was no plan: fixed draft lengths). ``record`` gets the model's calls only (a lookup's time is
        sunk)."""
        to_pool, to_model = [], []
        for request, count in entries:
            planned = self.planned.pop(request.request_id, None)
            if planned is None:
                pays = self._model_pays(request, count, self.suffix.preview(request, count).expected, len(entries))
                planned = "model" if pays else "suffix"
            (to_model if planned == "model" else to_pool).append((request, count))
        proposals = dict(zip((r.request_id for r, _ in to_pool), self.suffix.propose_rows(to_pool)))
        self.drafted_by["suffix"] += len(to_pool)
        started = time.perf_counter()
        for (request, _), proposal in zip(to_model, self.model.propose_rows(to_model, record)):
            proposals[request.request_id] = proposal
            self.drafted_by["model"] += 1
            self.source[request.request_id] = "model"
        if to_model:
            seconds = (time.perf_counter() - started) / len(to_model)
            self.model_seconds = DECAY * self.model_seconds + (1 - DECAY) * seconds if self.model_seconds else seconds
        return [proposals[request.request_id] for request, _ in entries]

    def _model_pays(self, request: Request, count: int, pool_expected: float, rows: int) -> bool:
        if count <= 0 or not self.model.has_state(request):
            return False
        alpha = min(self.model_alpha(request.request_id), 1 - 1e-6)
        model_expected = alpha * (1 - alpha**count) / (1 - alpha)
        step = self.step_seconds()
        share = step / (step + self.model_seconds) if step > 0 else 1.0
        rows = max(rows, 1)
        return (rows + model_expected) * share > rows + self.suffix.ratio(request.request_id) * pool_expected
