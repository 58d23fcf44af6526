"""Iteration-level scheduling (Orca, Yu et al. OSDI'22): which requests run in the next forward, and how many
tokens each, under one per-round token budget shared by decode tokens and prefill chunks (vLLM v1; chunked
prefill as in Sarathi-Serve, Agrawal et al. OSDI'24, arXiv 2403.02310).

Boundary: decisions and block reservations only. The order among requests is a small replaceable
``SchedulingPolicy`` (FIFO by default); blocks come from ``RaggedPagedCache.reserve``; the forward is
``runner.py``'s; sampling and finishing are ``engine.py``'s. A request is in the cache exactly while it is
running (waiting requests hold no blocks).

The rules of one round (``Scheduler.schedule``), with ``budget = max_tokens_per_round``:
    1. Decode rows first (running requests with one uncomputed token), in policy order, one token each —
       stall-free: no decode row waits behind a prefill.
    2. Then running requests still prefilling, in policy order: each feeds ``min(uncomputed, budget left)``.
    3. Then, if nobody was preempted this round, waiting requests are admitted in policy order while budget
       is left, fewer than ``max_running`` run, and the blocks of their first chunk are free. Admission attaches
       the longest cached prefix (salted block hashes) first, so a shared system prompt costs no prefill.
       Admission stops at the first request that does not fit (no overtaking: FIFO stays FIFO).
    4. Out of blocks while reserving (1 or 2): the policy's lowest-priority running request that is not yet
       scheduled this round is preempted — its blocks freed, it goes back to waiting and is recomputed later
       (prompt + output so far; its full blocks are often still cached, so recompute is mostly prefix hits).
       If the requester itself is the lowest priority, it is the one preempted. Every request fits alone
       (``add_request`` refuses one that cannot), so preemption always makes progress.
    5. Last, drafts (with an assistant): decode rows in policy order get ``policy.draft_tokens(request, budget
       left)`` draft slots (at most ``request.draft_limit``), from free blocks only — drafts never preempt or
       hold back a decode row, a prefill chunk or an admission. A crowded round grants later rows fewer drafts,
       or none.
Tokens of a round never exceed the budget; ``max_running <= max_tokens_per_round`` keeps every decode row in.

Speculation (rule 5): ``SchedulingPolicy.draft_tokens`` grants a decode row draft slots from the budget left
after rules 1-3 (0 without an assistant: ``request.draft_limit`` is 0); ``ScheduledRow.draft_tokens`` carries
them to the engine, which drafts at most that many tokens and verifies them in the row (``speculation.py``). Why
last: a draft is a bet, every other token of the round is sure progress (a prefill chunk or an admission also
shortens someone's time to first token); a round with budget to spare spends it on drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hf_kvspec.cache.block_pool import OutOfBlocksError
from hf_kvspec.cache.ragged import RaggedPagedCache

from .request import Request, RequestStatus


class SchedulingPolicy:
    """Priorities among requests. FIFO: earlier ``request_id`` first (a preempted request keeps its place)."""

    def running_order(self, running: list[Request]) -> list[Request]:
        """Running requests, highest priority first."""
        return sorted(running, key=lambda r: r.request_id)

    def next_waiting(self, waiting: list[Request]) -> Request:
        """The waiting request to admit next."""
        return min(waiting, key=lambda r: r.request_id)

    def preemption_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt when blocks run out (the lowest priority)."""
        return max(candidates, key=lambda r: r.request_id)

    def draft_tokens(self, request: Request, budget_left: int) -> int:
        """Draft slots for a decode row: as many as it wants (``request.draft_limit``, 0 without an assistant)
        while budget is left, in policy order."""
        return min(request.draft_limit, budget_left)


FifoPolicy = SchedulingPolicy


@dataclass(frozen=True)
class ScheduledRow:
    """One request's work in a round: feed ``request.tokens[start : start + num_tokens]``."""

    request: Request
    start: int  # == request.num_computed when scheduled
    num_tokens: int
    samples: bool  # the run ends at the request's newest token: sample its next token
    draft_tokens: int = 0  # draft slots granted (reserved, counted in the budget); at most this many are verified


@dataclass
class RoundPlan:
    rows: list[ScheduledRow] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens + row.draft_tokens for row in self.rows)


class Scheduler:
    """Waiting and running requests, and the per-round plan (rules in the module docstring)."""

    def __init__(self, cache: RaggedPagedCache, policy: SchedulingPolicy, max_tokens_per_round: int,
                 max_running: int):
        if max_running > max_tokens_per_round:
            raise ValueError(f"max_running={max_running} exceeds max_tokens_per_round={max_tokens_per_round}: every "
                             "running request needs a token of the round; lower max_running or raise the budget.")
        self.cache, self.policy = cache, policy
        self.max_tokens_per_round, self.max_running = max_tokens_per_round, max_running
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """A finished or cancelled request leaves; its blocks go back to the pool."""
        if request in self.running:
            self.running.remove(request)
            self.cache.release(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)

    def preempt(self, request: Request, plan: RoundPlan | None = None) -> None:
        """Free a running request's blocks and send it back to waiting (recompute later)."""
        self.running.remove(request)
        self.cache.release(request.request_id)
        request.reset_for_recompute()
        self.waiting.append(request)
        if plan is not None:
            plan.preempted.append(request)

    # ---- one round ---------------------------------------------------------------------------------------
    def schedule(self, only: set[int] | None = None) -> RoundPlan:
        """The next round's plan. ``only``: a round of these running requests alone, admitting nobody (the
        engine re-runs a failed round request by request to find the culprit); preemption is as usual."""
        plan, budget = RoundPlan(), self.max_tokens_per_round
        order = self.policy.running_order(self.running)
        if only is not None:
            order = [r for r in order if r.request_id in only]
        for request in [r for r in order if r.is_decoding] + [r for r in order if not r.is_decoding]:
            if budget == 0:
                break
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this round
                budget -= self._schedule_running(request, budget, plan)
        if not plan.preempted and only is None:
            budget -= self._admit(plan, budget)
        self._grant_drafts(plan, budget)
        return plan

    def _grant_drafts(self, plan: RoundPlan, budget: int) -> int:
        """Rule 3': draft slots for the decode rows, in policy order, from the budget and the free blocks only;
        returns the slots granted."""
        rank = {id(r): i for i, r in enumerate(self.policy.running_order(self.running))}
        decode = [i for i, row in enumerate(plan.rows) if row.num_tokens == 1 and row.samples]
        granted = 0
        for index in sorted(decode, key=lambda i: rank[id(plan.rows[i].request)]):
            row = plan.rows[index]
            seq_id, end = row.request.request_id, row.start + 1
            drafts = min(self.policy.draft_tokens(row.request, budget - granted), budget - granted)
            while drafts > 0 and self.cache.blocks_to_grow(seq_id, end + drafts) > self.cache.num_free_blocks():
                drafts -= 1
            if drafts > 0:
                self.cache.reserve(seq_id, end + drafts)
                plan.rows[index] = replace(row, draft_tokens=drafts)
                granted += drafts
        return granted

    def _schedule_running(self, request: Request, budget: int, plan: RoundPlan) -> int:
        """Schedule a running request (rules 1, 2, 4); returns the tokens it takes from the budget."""
        num_tokens = min(request.num_uncomputed, budget)
        if not self._reserve(request, request.num_computed + num_tokens, plan):
            return 0
        plan.rows.append(ScheduledRow(request, request.num_computed, num_tokens, num_tokens == request.num_uncomputed))
        return num_tokens

    def _reserve(self, request: Request, new_length: int, plan: RoundPlan) -> bool:
        """Reserve blocks, preempting lower-priority requests as needed (rule 4); False if it was preempted."""
        while True:
            try:
                self.cache.reserve(request.request_id, new_length)
                return True
            except OutOfBlocksError:
                scheduled = {id(row.request) for row in plan.rows}
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = self.policy.preemption_victim(candidates)
                self.preempt(victim, plan)
                if victim is request:
                    return False

    def _attach(self, request: Request) -> int:
        """Give an admitted request its cache row; returns the tokens already stored. A request forked from a
        running one (``fork_of``, e.g. the other choices of an ``n > 1`` request) shares the blocks of their
        common stored prefix copy-on-write; any other attaches its longest cached full-block prefix."""
        parent = next((r for r in self.running if r.request_id == request.fork_of), None)
        if parent is not None and parent.salt == request.salt:
            ours, theirs = request.tokens, parent.tokens
            limit = min(self.cache.length(parent.request_id), len(ours) - 1)  # the last token is always fed
            shared = 0
            while shared < limit and ours[shared] == theirs[shared]:
                shared += 1
            if shared > 0:
                self.cache.fork(parent.request_id, request.request_id, shared)
                return shared
        return self.cache.add_sequence(request.request_id, request.tokens, request.salt)

    def _admit(self, plan: RoundPlan, budget: int) -> int:
        """Rule 3: admit waiting requests while budget, ``max_running`` and free blocks allow; returns the
        tokens they take."""
        given = budget
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            request = self.policy.next_waiting(self.waiting)
            request.num_computed = self._attach(request)
            num_tokens = min(request.num_uncomputed, budget)
            new_length = request.num_computed + num_tokens
            if self.cache.blocks_to_grow(request.request_id, new_length) > self.cache.num_free_blocks():
                self.cache.release(request.request_id)
                request.num_computed = 0
                break
            self.cache.reserve(request.request_id, new_length)
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            plan.admitted.append(request)
            plan.rows.append(ScheduledRow(request, request.num_computed, num_tokens,
                                          num_tokens == request.num_uncomputed))
            budget -= num_tokens
        return given - budget
