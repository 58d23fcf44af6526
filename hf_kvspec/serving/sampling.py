"""Choosing each request's next token from its logits, and deciding when a request is done.

Boundary: one request at a time, plain torch on a ``[V]`` logits row; no cache, no scheduling. Greedy takes the
argmax of the processed scores, as ``generate(do_sample=False)`` does; sampling applies transformers' own
temperature / top-k / top-p warpers in ``generate``'s order and draws with the request's ``torch.Generator``,
so a seeded request's samples depend on its own logits only, never on which other requests share the round.

Deviation from ``GenerationConfig``: ``top_k`` defaults to 0 (off) here, not 50 — a sampled request gets the
model's distribution unless it asks for truncation.

Shape legend: V vocabulary · L prompt + output tokens.
"""

from __future__ import annotations

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .logprobs import TokenLogprob, token_logprobs
from .request import FinishReason, Request, SamplingSettings


def process_scores(request: Request, logits: torch.Tensor) -> torch.Tensor:  # [V] -> [1, V] fp32
    """The request's logits processors (if any) on fp32 scores, with its tokens so far as ``input_ids``."""
    scores = logits.to(torch.float32)[None]
    if request.settings.logits_processor:
        input_ids = torch.tensor([request.tokens], dtype=torch.long, device=logits.device)  # [1, L]
        for processor in request.settings.logits_processor:
            scores = processor(input_ids, scores)
    return scores


def warpers(settings: SamplingSettings) -> list:
    """The request's sampling warpers as transformers processors: temperature, then top-k, then top-p
    (``generate``'s order); none for greedy decoding."""
    if not settings.do_sample:
        return []
    out = [TemperatureLogitsWarper(settings.temperature)] if settings.temperature != 1.0 else []
    out += [TopKLogitsWarper(settings.top_k)] if settings.top_k > 0 else []
    return out + ([TopPLogitsWarper(settings.top_p)] if settings.top_p < 1.0 else [])


def warped_scores(request: Request, scores: torch.Tensor) -> torch.Tensor:  # [1, V] -> [1, V]
    """The request's warpers on processed scores (none for greedy decoding)."""
    for warper in warpers(request.settings):
        scores = warper(None, scores)
    return scores


def next_token(request: Request, logits: torch.Tensor) -> int:
    """The request's next token from the logits ``[V]`` of its last fed position."""
    return choose(request, logits)[0]


def choose(request: Request, logits: torch.Tensor) -> tuple[int, tuple[TokenLogprob, ...]]:
    """The request's next token from the logits ``[V]`` of its last fed position, with its log-probability when
    the request asked for them (``logprobs.py``: under the distribution the token was drawn from)."""
    scores = warped_scores(request, process_scores(request, logits))  # [1, V]
    if not request.settings.do_sample:
        token = int(scores.argmax(dim=-1))
    else:  # the generator is a CPU one on every device
        token = int(torch.multinomial(torch.softmax(scores, dim=-1).cpu(), 1, generator=request.generator))
    top = request.settings.logprobs
    return token, (() if top is None else token_logprobs(scores, [token], top))


def finish_reason(request: Request, tokenizer) -> FinishReason | None:
    """Why the request stops after its newest token, or None: EOS, then a stop string, then the length limit."""
    settings = request.settings
    if request.output_ids and request.output_ids[-1] in settings.eos_token_id:
        return FinishReason.EOS
    if settings.stop_strings and _ends_with_stop_string(request.output_ids, settings.stop_strings, tokenizer):
        return FinishReason.STOP
    if len(request.output_ids) >= settings.max_new_tokens:
        return FinishReason.LENGTH
    return None


def _ends_with_stop_string(output_ids: list[int], stop_strings: tuple[str, ...], tokenizer) -> bool:
    """A stop string occurs in the decoded text of the newest tokens. The window is counted in UTF-8 bytes, not
    characters: a byte-level BPE token may hold a single byte of a character ('👍🏽' is 2 characters, 8 bytes, 6
    tokens of SmolLM2), but every token decodes to at least one byte, so ``bytes(stop) + 1`` tokens cover any
    occurrence the newest token completed (the extra one keeps a leading space that a first token would lose).
    Same decisions as transformers' ``StopStringCriteria``, which ``generate`` uses (tests/serving)."""
    window = max(len(stop.encode("utf-8")) for stop in stop_strings) + 1
    text = tokenizer.decode(output_ids[-window:], skip_special_tokens=False)
    return any(stop in text for stop in stop_strings)
