"""N-gram drafting inside the engine: each drafting request's drafts are looked up in its own tokens, with no
drafter state at all.

Boundary: the lookups of a round. The lookup is the assistant's own (``NgramAssistant.lookup``, the function its
``generate`` rounds run); who drafts how many tokens is the engine's (``draft_budget.py``); verifying, keeping and
rolling back is the round's (``speculation.py``). Nothing is kept between rounds and the assistant is never copied:
a request's tokens are everything the lookup reads.

Shapes: ``L`` tokens of a request, ``N`` drafts.
"""

from __future__ import annotations

import time

import torch

from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.drafters.ngram import NgramAssistant

from .drafting import Drafters
from .request import Request

LOOKUP_ASSISTANTS = (NgramAssistant,)


class LookupDrafters(Drafters):
    """The engine's drafter for an ``NgramAssistant``: every decoding request may draft from its first round on."""

    runs_target = False

    def _begin(self, request: Request, features) -> bool:
        return True  # nothing to keep: a request's tokens are its drafter's whole state

    def _end(self, state) -> None:
        pass

    def observe(self, request: Request, *verdict) -> None:
        pass  # the next lookup reads the request's tokens, which hold the verdict

    def propose_rows(self, entries: list[tuple[Request, int]], record=None) -> list[DraftProposal]:
        """Each ``(request, count)``'s chain ``[1, N]`` (N <= count; N = 0 where nothing matches); ``record(count,
        seconds)`` gets each lookup's time."""
        proposals = []
        for request, count in entries:
            started = time.perf_counter()
            found = self.assistant.lookup(torch.tensor(request.tokens), min(count, self.max_depth(request)))
            proposals.append(DraftProposal(found[None]))
            if record is not None and count > 0:
                record(count, time.perf_counter() - started)
        return proposals
