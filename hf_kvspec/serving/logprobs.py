"""Log-probabilities of the tokens a request emits: the target's own distribution at each emitted position, as the
request samples from it.

Boundary: numbers from score rows the round already computed; no forward of its own. A plain decode row gives the
scores of its one position (``sampling.py``); a verify row gives the scores of every node, processed after its own
path (``rounds.py``), of which the root's and the accepted path's are the emitted tokens' positions — so under
speculation the values are the target's, exactly as if the request had decoded plainly, never the drafter's.

Which distribution: ``log_softmax`` of the scores after the request's logits processors and, when it samples, its
warpers (temperature, then top-k, then top-p: ``sampling.warpers``) — the distribution its tokens are drawn
from. Greedy requests have no warpers: the model's own distribution after the processors. Tokens that top-k or
top-p removed have ``-inf``.

Shapes: ``n`` emitted tokens · ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's limit for chat)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its log-probability, and the ``top`` most likely tokens at its position (id,
    log-probability), most likely first; ``top`` is empty when the request asked for none."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(scores: torch.Tensor, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """Each of ``tokens`` (``n``) with its log-probability under its row of ``scores`` ``[n, V]`` (processed and
    warped as the request samples) and its row's ``top`` most likely tokens."""
    logprobs = torch.log_softmax(scores.to(torch.float32), dim=-1)  # [n, V]
    ids = torch.tensor(tokens, dtype=torch.long, device=scores.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [n]
    if top > 0:
        values, indices = logprobs.topk(top, dim=-1)  # [n, top] each, most likely first
        alternatives = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return tuple(TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives))


def prompt_logprobs(model, ids: list[int], top: int) -> tuple[TokenLogprob | None, ...]:
    """Each prompt token's log-probability given the tokens before it (``echo``): one plain forward of ``model``
    over ``ids`` (``L`` tokens); the first token has none (None). The model's own distribution: no processing."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1]  # [L - 1, V]
    return (None, *token_logprobs(logits, ids[1:], top))
