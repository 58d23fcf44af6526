"""The engine's speculation, in one place: who drafts how many tokens in a round, through which drafter, and what
the round's measurements teach the draft budget.

Boundary: between the engine and its drafters. The engine schedules (``scheduler.py``), runs the packed forward
(``runner.py``) and commits; this class chooses each decoding request's K before scheduling, as its draft limit
(``hf_kvspec.speculative.draft_budget``, or ``num_draft_tokens`` under ``"fixed"``), asks the drafter for the
proposals and turns them into verify rows (``speculation.py``); it hands the drafter each round's verdict and
features, and forgets a request's drafter state when it leaves. The drafters: EAGLE/Medusa heads in one batched
call (``head_drafting.py``), draft models in one packed forward per depth on a cache of their own
(``model_drafting.py``), n-gram lookups (``lookup_drafting.py``), the batched self-drafter
(``self_drafting.py``), the suffix pool (``suffix_drafting.py``), and one spawned assistant per request for
assistants of the user's own (``drafting.py``).

Costs are shared: the engines of one model, forward kind, thread count and drafter type in a process keep one
``draft_budget.Costs`` (``_COSTS``), so a new engine starts from what earlier ones measured.
"""

from __future__ import annotations

import time
import weakref

import torch

from hf_kvspec.speculative.draft_budget import Candidate, Costs, DraftBudget
from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.drafters.quantized_self import QuantizedSelfAssistant
from hf_kvspec.speculative.drafters.suffix import SuffixAssistant
from hf_kvspec.speculative.round import keep_columns
from hf_kvspec.speculative.rounds import keep_nodes

from .drafting import Drafters, check_assistant, resolve_assistant
from .head_drafting import HEAD_ASSISTANTS, HeadDrafters
from .lookup_drafting import LOOKUP_ASSISTANTS, LookupDrafters
from .mixed_drafting import MixedDrafters
from .model_drafting import MODEL_ASSISTANTS, ModelDrafters
from .request import Request
from .scheduler import RoundPlan, ScheduledRow
from .self_drafting import SelfDrafters, check_self_drafting
from .speculation import Verdict, VerifyRow
from .suffix_drafting import SuffixDrafters

DRAFT_LENGTHS = ("goodput", "fixed")
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {engine kind: measured Costs}


def check_draft_lengths(draft_lengths) -> None:
    if draft_lengths not in DRAFT_LENGTHS:
        raise ValueError(f"draft_lengths must be 'goodput' (chosen per round from load) or 'fixed', got "
                         f"{draft_lengths!r}.")


def make_drafters(assistant, model, cache, num_draft_tokens: int | None, step_seconds=lambda: 0.0):
    """The engine's drafter for ``assistant`` (an ``Assistant``, a spec string, or two of them as a list or
    ``"suffix+<spec>"``: the suffix pool and a model drafter, chosen per request), refused by name if it cannot
    run exactly inside the engine."""
    if assistant == "auto":
        assistant = auto_assistants(model)
    parts = assistant.split("+") if isinstance(assistant, str) and "+" in assistant else assistant
    if isinstance(parts, (list, tuple)):
        return _mixed(parts, model, cache, num_draft_tokens, step_seconds)
    assistant = resolve_assistant(assistant, model)
    if isinstance(assistant, SuffixAssistant):
        return SuffixDrafters(assistant, num_draft_tokens)
    if isinstance(assistant, QuantizedSelfAssistant):
        check_self_drafting(assistant, model)
        return SelfDrafters(assistant, cache, num_draft_tokens)
    check_assistant(assistant, sliding=any(layer.is_sliding for layer in cache.layers))
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    # the exact classes: a subclass may draft otherwise than the batched paths assume
    if type(assistant) in MODEL_ASSISTANTS:
        return ModelDrafters(assistant, model, cache, num_draft_tokens, pad)
    kind = HeadDrafters if type(assistant) in HEAD_ASSISTANTS else (
        LookupDrafters if type(assistant) in LOOKUP_ASSISTANTS else Drafters)
    return kind(assistant, model, num_draft_tokens, pad)


def auto_assistants(model) -> list[str] | str:
    """``assistant="auto"``: the suffix pool and the bundled EAGLE head when the head was trained for ``model``,
    else the suffix pool alone (it needs no model of its own)."""
    from hf_kvspec.heads.bundled import bundled_heads_path
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.pairing import BaseModelMismatchError, check_base_model

    try:
        check_base_model(EagleConfig.from_pretrained(bundled_heads_path("eagle")), model)
    except (BaseModelMismatchError, OSError, TypeError):
        return "suffix"
    return ["suffix", "eagle"]


def _mixed(parts, model, cache, num_draft_tokens: int | None, step_seconds) -> MixedDrafters:
    drafters = [make_drafters(part, model, cache, num_draft_tokens) for part in parts]
    suffix = [d for d in drafters if isinstance(d, SuffixDrafters)]
    others = [d for d in drafters if isinstance(d, Drafters)]
    if len(drafters) != 2 or len(suffix) != 1 or len(others) != 1:
        raise ValueError(f"two assistants are the suffix pool and one model drafter, e.g. ['suffix', 'eagle'] or "
                         f"'suffix+medusa' (self-int8 drafts for all requests at once and is not mixed); got {parts!r}.")
    return MixedDrafters(suffix[0], others[0], step_seconds)


class RoundDrafts:
    """Speculation of one engine (module docstring): its drafter and, under ``"goodput"``, its draft budget."""

    def __init__(self, model, cache, runner, assistant, num_draft_tokens: int | None, draft_lengths: str):
        check_draft_lengths(draft_lengths)
        self.cache = cache
        self.step = 0.0  # the last round forward's seconds (the mixed drafter weighs a model draft against it)
        self.drafters = make_drafters(assistant, model, cache, num_draft_tokens, lambda: self.step)
        self.feature_layers = self.drafters.feature_layers
        self.budget = None
        if draft_lengths == "goodput":
            self.budget = DraftBudget(shared_cost=self.drafters.shared_cost, costs=_costs(model, runner, self.drafters))

    @property
    def runs_target_outside(self) -> bool:
        """Whether drafting may run the target's own forward outside the engine's attention (an assistant of the
        user's own, spawned per request): then the engine must not hold its attention switch across rounds."""
        return self.drafters.runs_target

    # ---- before and after scheduling ---------------------------------------------------------------------
    def set_limits(self, running: list[Request]) -> None:
        """Each running request's draft limit for the scheduler: its K for this round (0 unless it is decoding with
        a drafter). Under the goodput choice K is planned here, before scheduling, for a round of the decoding
        requests' tokens: a request at K = 0 reserves no draft slots, and its row takes the plain path."""
        decoding = [r for r in running if r.is_decoding and self.drafters.has_state(r)]
        for request in running:
            request.draft_limit = 0
        limits = {r.request_id: self.drafters.draft_limit(r) for r in decoding}
        if self.budget is not None and decoding:
            steps = sum(r.is_decoding for r in running)  # the round's sure tokens, one per decoding request
            limits = self.budget.plan(steps, steps, [
                Candidate(r.request_id, limits[r.request_id], self.drafters.expected_gains(r, limits[r.request_id], steps))
                for r in decoding])
        for request in decoding:
            request.draft_limit = limits[request.request_id]

    def draft(self, plan: RoundPlan) -> dict[int, VerifyRow]:
        """The round's verify rows by row index: each drafting row's proposal of at most its chosen K. Under the
        goodput choice a row at K = 0 takes the plain path (no entry); under ``"fixed"`` it verifies no drafts."""
        lengths = self._lengths(plan)
        asked = {index: count for index, count in lengths.items() if count > 0 or self.budget is None}
        if not asked:
            return {}
        record = None if self.budget is None else (
            self.budget.record_draft_step if self.drafters.shared_cost else self.budget.record_draft)
        proposals = self.drafters.propose_rows([(plan.rows[i].request, count) for i, count in asked.items()], record)
        verify = {}
        for index, proposal in zip(asked, proposals):
            request = plan.rows[index].request
            proposal = without_forbidden(request, proposal)  # drafts the request's grammar forbids
            if self.budget is not None and proposal.tokens.shape[1] == 0:  # asked, found nothing (an n-gram miss,
                self.budget.record_verdict(request.request_id, 1, 0)  # all forbidden): as good as a rejected
                continue  # draft; a plain row
            verify[index] = VerifyRow(request, proposal)
        return verify

    def _lengths(self, plan: RoundPlan) -> dict[int, int]:
        """Row index -> drafts to ask for: the slots granted, at most the request's limit (``set_limits``)."""
        return {index: min(row.draft_tokens, row.request.draft_limit) for index, row in enumerate(plan.rows)
                if row.samples and row.num_tokens == 1 and self.drafters.has_state(row.request)}

    # ---- what the round measured -------------------------------------------------------------------------
    def record_forward(self, tokens: int, seconds: float) -> None:
        self.step = seconds
        if self.budget is not None:
            self.budget.record_forward(tokens, seconds)

    def accept(self, row: VerifyRow, logits: torch.Tensor) -> Verdict:
        """``row``'s verdict from its logits ``[1 + N, V]`` (``VerifyRow.accept``); its time teaches the budget
        what a verify row costs."""
        started = time.perf_counter()
        verdict = row.accept(logits)
        if self.budget is not None:
            self.budget.record_verify_row(time.perf_counter() - started)
        return verdict

    def record_verdict(self, request: Request, verdict: Verdict, emitted: int) -> None:
        """A verified row's figures: the request's metrics and the budget's acceptance (``emitted``: tokens it
        appended, fewer than the verdict's when it stopped)."""
        request.metrics.record_speculation(verdict.num_draft, verdict.num_accepted, emitted)
        if self.budget is not None:
            self.budget.record_verdict(request.request_id, verdict.num_draft, verdict.num_accepted)

    # ---- the drafter's state per request ---------------------------------------------------------------
    def keep(self, request: Request, row: ScheduledRow, verdict: Verdict, verified: bool, features) -> None:
        """A request that goes on after the round: a verified row's root and accepted path stay in the cache
        (``round.keep_columns``); its drafter sees the verdict (a plain row of a request with a drafter state is a
        round that drafted nothing), or its state begins. ``features`` [width, F] | None are the row's columns."""
        if verified:
            keep_columns(self.cache, row.start, verdict.kept, seq_id=request.request_id)
            request.num_computed += verdict.num_accepted
            path = None if features is None else features[verdict.kept[0]][None]  # [1, 1 + k, F]
            self.drafters.observe(request, request.num_computed, verdict.num_accepted, verdict.num_draft, path,
                                  verdict.accepted_nodes)
        elif self.drafters.has_state(request) and row.num_tokens == 1:
            path = None if features is None else features[:1][None]  # [1, 1, F] the root's
            self.drafters.observe(request, request.num_computed, 0, 0, path, torch.zeros(1, 0, dtype=torch.long))
        else:
            self.gather(request, features)
            self.drafters.start(request)

    def gather(self, request: Request, features) -> None:
        """Features of prefill columns, kept until the request's drafter state begins."""
        self.drafters.gather(request, features)

    def telemetry(self) -> dict:
        """The suffix pool's figures (``SuffixPool.stats``) when one drafts, and who drafted how many rows when two
        drafters are mixed."""
        pool = getattr(self.drafters, "pool", None)
        out = {} if pool is None else {"suffix_pool": pool.stats()}
        model_drafter = self.drafters.model if isinstance(self.drafters, MixedDrafters) else self.drafters
        if isinstance(model_drafter, ModelDrafters):
            out.update(model_drafter.telemetry())
        if isinstance(self.drafters, MixedDrafters):
            out["drafted_by"] = dict(self.drafters.drafted_by)
        return out

    def forget(self, request: Request) -> None:
        """``request`` finished, was cancelled, preempted or failed: its drafter state and estimates go."""
        self.drafters.drop(request)
        if self.budget is not None:
            self.budget.release([request.request_id])


def without_forbidden(request: Request, proposal: DraftProposal) -> DraftProposal:
    """``proposal`` without the drafts a grammar of the request forbids (``GrammarLogitsProcessor``): they would
    be verified only to be rejected. Only point-mass drafts or greedy requests: removing a zero-probability
    candidate then changes nothing (its rejection leaves the target's distribution as it was), where with a
    drafter's own probabilities it would change the residual the next candidate is tested against."""
    if proposal.probs is not None and request.settings.do_sample:
        return proposal
    parents = None if proposal.parents is None else proposal.parents.reshape(-1).tolist()
    drafts = proposal.tokens[0].tolist()
    for processor in request.settings.logits_processor:
        check = getattr(processor, "allowed_drafts", None)
        allowed = None if check is None else check(request.tokens, drafts, parents)
        if allowed is not None and not all(allowed):
            return keep_nodes(proposal, allowed)
    return proposal


def _costs(model, runner, drafters) -> Costs:
    """The measured forward and draft costs of this model, forward kind, thread count and drafter, shared with
    earlier engines of the same kind in this process."""
    drafter = drafters.assistant
    key = (runner.fast is not None, runner.reference, torch.get_num_threads(), type(drafters).__name__,
           type(drafter).__name__, getattr(drafter, "weights", None))
    return _COSTS.setdefault(model, {}).setdefault(key, Costs())
