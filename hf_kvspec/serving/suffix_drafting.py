"""Suffix drafting inside the engine: one pool for every request of the engine, each request reading and writing
its own tenant (its salt), all lookups of a round in one pass.

Boundary: the requests' text in the ``SuffixPool`` (``hf_kvspec.speculative.suffix_pool``) and the round's
proposals. Which requests draft how many tokens is the draft budget's (``draft_budget.py``); verifying and keeping
is the round's (``speculation.py``, ``engine.py``).

A request's text enters the pool when it starts decoding and grows with every round it drafts in; when it finishes
(or is cancelled, preempted, fails) it stays as history of its tenant: later requests with the same salt draft from
it.

A lookup costs microseconds, so it runs before the round is planned: the draft budget gets each request's gains
(``expected_gains``: each node's estimated acceptance, best first, times the request's measured ratio of accepted
to estimated drafts) instead of a guess from past acceptance, and the round then verifies the looked-up draft cut
to the K the plan gave. Unsalted requests draft from their own text only, unless the pool was built with ``share_unsalted=True`` (one
user's deployment). Nothing of one tenant is ever proposed to another (``suffix_pool.py``, "tenant").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hf_kvspec.speculative.draft_budget import DECAY, PRIOR_WEIGHT
from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.drafters.suffix import SuffixAssistant, proposal_of
from hf_kvspec.speculative.suffix_pool import SuffixDraft, SuffixPool

from .request import Request


class Ratio:
    """A decayed ratio ``hits / tries`` per request over a pooled one (the prior of a request not yet measured,
    worth ``PRIOR_WEIGHT`` rounds)."""

    def __init__(self, prior: float):
        self.pooled = [prior, 1.0]
        self.requests: dict[int, list[float]] = {}

    def add(self, request_id: int, hits: float, tries: float) -> None:
        for table in (self.requests.setdefault(request_id, [0.0, 0.0]), self.pooled):
            table[0], table[1] = DECAY * table[0] + hits, DECAY * table[1] + tries

    def __call__(self, request_id: int) -> float:
        pooled = self.pooled[0] / max(self.pooled[1], 1e-9)
        hits, tries = self.requests.get(request_id, (0.0, 0.0))
        return (hits + PRIOR_WEIGHT * pooled) / (tries + PRIOR_WEIGHT)

    def forget(self, request_id: int) -> None:
        self.requests.pop(request_id, None)


class SuffixDrafters:
    """The engine's drafter for ``SuffixAssistant``: its pool, shared by every request of the engine.

    Args:
        assistant: a ``SuffixAssistant`` (its pool, tree and probability settings; its own ``salt`` is not used:
            each request's salt names its tenant).
        num_draft_tokens: nodes per request per round at most (default the assistant's own).
    """

    shared_cost = False
    feature_layers = None
    runs_target = False

    def __init__(self, assistant: SuffixAssistant, num_draft_tokens: int | None = None):
        size = assistant.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"num_draft_tokens must be a non-negative int, got {size!r}.")
        self.assistant, self.pool, self.num_draft_tokens = assistant, assistant.pool, size
        self._live: set[int] = set()
        self.last: dict[int, SuffixDraft] = {}  # request id -> its proposal of the round (the mixed drafter reads it)
        self.ratio = Ratio(prior=1.0)  # accepted / estimated drafts, per request
        self._previewed: dict[int, tuple[int, SuffixDraft]] = {}  # request id -> (its tokens then, the draft)
        self._verified: dict[int, float] = {}  # request id -> the estimate of the draft it verifies this round

    # ---- the engine's drafter interface (as ``drafting.Drafters``) ----------------------------------------
    def has_state(self, request: Request) -> bool:
        return request.request_id in self._live

    def draft_limit(self, request: Request) -> int:
        room = request.settings.max_new_tokens - len(request.output_ids)
        if not self.has_state(request) or room <= 1:
            return 0
        return self.num_draft_tokens if self.assistant.tree else min(self.num_draft_tokens, room - 1)

    def gather(self, request: Request, features) -> None:
        pass

    def start(self, request: Request) -> None:
        """``request`` decodes from now on: its text enters its tenant's pool."""
        self._live.add(request.request_id)
        self.pool.update(request.request_id, request.tokens, request.salt)

    def observe(self, request: Request, kept_width: int = 0, num_accepted: int = 0, *args) -> None:
        """The round's verdict: the pool learns the text, the request's ratio the drafts it verified."""
        self.pool.update(request.request_id, request.tokens, request.salt)
        expected = self._verified.pop(request.request_id, None)
        if expected:
            self.ratio.add(request.request_id, num_accepted, expected)

    def expected_gains(self, request: Request, limit: int, rows: int = 1) -> tuple[float, ...]:
        """Before the plan: each node's estimated acceptance in ``request``'s draft of at most ``limit`` nodes,
        calibrated by the request's ratio (module docstring); the draft is kept for ``propose``. ``rows``: the
        round's decoding requests (a lookup's cost is the request's own: unused here)."""
        return self.gains(request, self.preview(request, limit))

    def gains(self, request: Request, draft: SuffixDraft) -> tuple[float, ...]:
        """Each node's estimated acceptance in ``draft``, calibrated by ``request``'s measured ratio."""
        ratio = self.ratio(request.request_id)
        return tuple(min(prob * ratio, 1.0) for prob in draft.probs)

    def preview(self, request: Request, limit: int) -> SuffixDraft:
        """``request``'s draft of at most ``limit`` nodes, looked up now and kept for ``propose``."""
        draft = self._lookup(request, limit)
        self._previewed[request.request_id] = (request.num_tokens, draft)
        return draft

    def drop(self, request: Request) -> None:
        """``request`` left: its text stays as its tenant's history (or goes, if the tenant was its own)."""
        if request.request_id in self._live:
            self._live.discard(request.request_id)
            self.pool.update(request.request_id, request.tokens, request.salt)
            self.pool.release(request.request_id)
        for table in (self.last, self._previewed, self._verified):
            table.pop(request.request_id, None)
        self.ratio.forget(request.request_id)

    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s draft ``[1, N]`` (N <= count) from the pool; ``record(count, seconds)`` gets
        each lookup's time."""
        proposals = []
        for request, count in entries:
            started = time.perf_counter()
            proposals.append(self.propose(request, count))
            self._verified[request.request_id] = self.last[request.request_id].expected
            if record is not None:
                record(count, time.perf_counter() - started)
        return proposals

    def propose(self, request: Request, count: int) -> DraftProposal:
        """``request``'s draft of at most ``count`` nodes (the one looked up before the plan, if any), no path
        past its last token but one."""
        tokens, draft = self._previewed.pop(request.request_id, (None, None))
        if draft is None or tokens != request.num_tokens:
            draft = self._lookup(request, count)
        self.last[request.request_id] = draft = draft.cut(count)
        return _single(draft)

    def _lookup(self, request: Request, count: int) -> SuffixDraft:
        room = request.settings.max_new_tokens - len(request.output_ids) - 1
        if count <= 0 or room <= 0:
            return SuffixDraft()
        self.pool.update(request.request_id, request.tokens, request.salt)
        assistant = self.assistant
        draft = self.pool.propose(request.request_id, count, min(count, room), assistant.min_prob,
                                  assistant.spec_factor)
        return draft if assistant.tree else draft.chain()


def _single(draft: SuffixDraft) -> DraftProposal:
    """A one-row proposal ``[1, N]``: a chain, or a tree with its parents (no filler: the row is its own)."""
    if not draft.tokens:
        return DraftProposal(torch.zeros(1, 0, dtype=torch.long))
    return proposal_of([draft], [0], tree=not draft.is_chain)


def warm_pool(pool: SuffixPool, path: str | Path) -> int:
    """Fill ``pool`` from a file: a pool ``SuffixPool.save`` wrote (``{"tenant", "tokens"}`` lines) or the results
    of an earlier ``hf-kvspec batch`` (``{"output_ids": [...], "salt"?: ...}`` lines: each output is added under
    its salt, an unsalted one only to a pool that shares unsalted text). Returns the sequences added."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--warm-pool {path}: no such file.")
    with path.open() as lines:
        first = next((json.loads(line) for line in lines if line.strip()), {})
    if "tenant" in first and "tokens" in first:
        return pool.load(path)
    added = 0
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("output_ids"), list):
                raise ValueError(f"{path}:{number}: neither a saved pool line ({{'tenant', 'tokens'}}) nor a batch "
                                 "result ({'output_ids': [...]}); give a file that SuffixPool.save or hf-kvspec "
                                 "batch --out wrote.")
            before = pool.stats()["sequences"]
            pool.add(record["output_ids"], record.get("salt"))
            added += pool.stats()["sequences"] > before
    return added
