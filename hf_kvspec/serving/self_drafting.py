"""Self-drafting inside the engine: a weight-only quantized copy of the target (int8 or int4) drafts a chain for
every drafting request of a round at once, one packed forward per draft depth, on the engine's own paged cache.

Boundary: the draft forwards and their tokens. Which requests draft how many tokens is the engine's
(``draft_budget.py``); verifying, keeping and rolling back is the round's (``speculation.py``, ``engine.py``).
The quantized copy is ``QuantizedSelfAssistant``'s (``hf_kvspec.forward``'s fast forward over int8/int4
weights); the target is never changed.

A round with requests a (3 drafts) and b (1 draft), each holding its committed tokens but the root r::

    depth 0   packed [r_a | r_b]    at positions [s_a | s_b]          -> d_a0, d_b0
    depth 1   packed [d_a0]         at [s_a + 1]                      -> d_a1
    depth 2   packed [d_a1]         at [s_a + 2]                      -> d_a2
    verify    the round's forward over [r_a d_a0 d_a1 d_a2 | r_b d_b0 | other rows] at the same positions

Each draft forward is a scratch forward (``RaggedPagedCache.begin_forward(scratch=True)``): it writes the copy's
K/V into the request's reserved draft slots and attends to the fp32 target's K/V of everything committed; the
verify forward then overwrites those slots with the target's own K/V, so nothing of the copy survives a round.
Drafts are the copy's argmax (verified as point masses: greedy output is the target's, sampled output is
distributed as the target's). Drafting for many requests costs about what drafting for one does: the int8 kernel
reads each weight once for all rows of a forward (``kernels/qgemv.c``), so the cost is shared by the round
(``shared_cost``: ``DraftBudget`` costs a depth by the rows drafting at it, from this drafter's measured forwards).

Shapes: ``n`` requests drafting at a depth, ``V`` vocabulary.
"""

from __future__ import annotations

import time

import torch

from hf_kvspec.cache.ragged import RaggedPagedCache, RaggedRow
from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.drafters.quantized_self import QuantizedSelfAssistant

from .attention import RaggedAttend
from .request import Request


def check_self_drafting(assistant: QuantizedSelfAssistant, model) -> None:
    """Refuse, by name, a self-drafter the engine cannot run: one built for another model."""
    if assistant.target is not model:
        raise ValueError("QuantizedSelfAssistant drafts from a copy of the model it was built with; build it on "
                         "the engine's model: Engine(model, assistant=QuantizedSelfAssistant(model)) or "
                         "assistant='self-int8'.")


class SelfDrafters:
    """The engine's drafter for ``QuantizedSelfAssistant``: no per-request state, every decoding request may draft.

    Args:
        assistant: a ``QuantizedSelfAssistant`` of the engine's model (its quantized copy drafts).
        cache: the engine's ``RaggedPagedCache``.
        num_draft_tokens: drafts per request per round at most (default the assistant's own size).
    """

    shared_cost = True
    runs_target = False  # its forwards are the engine's own, on the engine's cache
    feature_layers = None
    pool = None

    def __init__(self, assistant, cache: RaggedPagedCache, num_draft_tokens: int | None = None):
        own = assistant.num_draft_tokens
        size = num_draft_tokens if num_draft_tokens is not None else (own if isinstance(own, int) else 8)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"num_draft_tokens must be a non-negative int, got {size!r}.")
        self.assistant, self.cache, self.num_draft_tokens = assistant, cache, size
        self.forward = assistant.forward  # the quantized copy's fast forward

    # ---- the engine's drafter interface (as ``drafting.Drafters``) ----------------------------------------
    def has_state(self, request: Request) -> bool:
        return True

    def draft_limit(self, request: Request) -> int:
        room = request.settings.max_new_tokens - len(request.output_ids)
        return max(min(self.num_draft_tokens, room - 1), 0)

    def expected_gains(self, request: Request, limit: int, rows: int = 1) -> None:
        return None  # drafts are made after the plan: K comes from the request's running acceptance

    def gather(self, request: Request, features) -> None:
        pass

    def start(self, request: Request) -> None:
        pass

    def drop(self, request: Request) -> None:
        pass

    def observe(self, request: Request, *args) -> None:
        pass

    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s chain ``[1, count]``, drafted together, one packed forward per depth;
        ``record(rows, seconds)`` gets each depth's forward time (``DraftBudget.record_draft_step``)."""
        tokens = {request.request_id: [] for request, _ in entries}
        for depth in range(max((count for _, count in entries), default=0)):
            started = time.perf_counter()
            drafting = [(request, count) for request, count in entries if count > depth]
            fed = [tokens[r.request_id][-1] if depth else r.tokens[-1] for r, _ in drafting]
            for (request, _), token in zip(drafting, self._step(drafting, fed, depth)):
                tokens[request.request_id].append(token)
            if record is not None:
                record(len(drafting), time.perf_counter() - started)
        return [DraftProposal(torch.tensor([tokens[r.request_id]], dtype=torch.long).view(1, -1))
                for r, _ in entries]

    def _step(self, drafting: list[tuple[Request, int]], fed: list[int], depth: int) -> list[int]:
        """One scratch forward: each request's token ``fed`` at position ``num_computed + depth`` -> its argmax."""
        rows = [RaggedRow(r.request_id, r.num_computed + depth, 1, None) for r, _ in drafting]
        input_ids = torch.tensor([fed], dtype=torch.long)  # [1, n]
        positions = torch.tensor([[row.start for row in rows]], dtype=torch.long)  # [1, n]
        self.cache.begin_forward(rows, input_ids.device, scratch=True)
        ok = False
        try:
            with torch.no_grad():
                logits, _ = self.forward.run(input_ids, positions, RaggedAttend(self.cache, self.forward.scaling),
                                             torch.arange(len(rows)), None)  # [1, n, V]
            ok = True
        finally:
            self.cache.end_forward(ok=ok)
        return logits[0].argmax(dim=-1).tolist()
