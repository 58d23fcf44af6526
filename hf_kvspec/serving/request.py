"""A request of the serving engine: its generation settings, its state between rounds and its telemetry.

Boundary: plain data and the few rules that are the request's own (when it is finished, what it feeds next).
It knows nothing about blocks (``RaggedPagedCache``), rounds (``scheduler.py``) or the model (``runner.py``).

Token bookkeeping: ``tokens = prompt_ids + output_ids``; ``num_computed`` of them have K/V in the cache. A round
feeds ``tokens[num_computed : num_computed + n]``; when that reaches the end of ``tokens`` the round samples
the next token from the last position's logits. A decode step is the case ``n == 1`` (only the newest token
is uncomputed); a prefill is any longer run, possibly split over rounds (chunked prefill). Preemption by
recompute sets ``num_computed`` back to 0: the request is prefilled again over prompt *and* output.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob


class RequestTooLongError(ValueError):
    """A request can never fit: its prompt plus ``max_new_tokens`` exceed the KV budget or the model's positions."""


class RequestFailedError(RuntimeError):
    """A request failed on its own (its logits processor, its drafter, ...) and was ended; the requests that
    shared its rounds went on (``Engine.step`` isolates the culprit). The original exception is ``__cause__``."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # an end-of-sequence token was generated (it is part of the output, as in generate())
    STOP = "stop"  # a stop string appeared in the decoded output
    CANCELLED = "cancelled"
    ERROR = "error"  # the request failed on its own (``RequestOutput.error`` says how); the others went on


@dataclass(frozen=True)
class SamplingSettings:
    """Per-request generation settings (the subset of ``GenerationConfig`` the engine honours)."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # with do_sample: a per-request generator, so samples ignore who else runs
    eos_token_id: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # callables (input_ids [1, L], scores [1, V]) -> scores [1, V], e.g. a transformers LogitsProcessorList
    logits_processor: Sequence[Callable] = ()
    logprobs: int | None = None  # None: off; k: each output token's log-probability and its k alternatives

    def __post_init__(self):
        _check_integer("max_new_tokens", self.max_new_tokens, low=1)
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}.")
        _check_number("temperature", self.temperature)
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"do_sample=True needs temperature > 0, got {self.temperature}; use do_sample=False "
                             "for greedy decoding.")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_integer("top_k", self.top_k, low=0, hint=" (0 = off)")
        if self.seed is not None:
            _check_integer("seed", self.seed, low=0, high=MAX_SEED, hint=" (a torch.Generator seed)")
        for token in self.eos_token_id:
            _check_integer("eos_token_id", token, low=0, hint=" (token ids)")
        if not all(isinstance(stop, str) and stop for stop in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {list(self.stop_strings)!r}; an empty "
                             "string would stop every request after its first token.")
        for processor in self.logits_processor:
            if not callable(processor):
                raise ValueError(f"logits_processor entries must be callables (input_ids, scores) -> scores, got "
                                 f"{processor!r}.")
        if self.logprobs is not None:
            _check_integer("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS,
                           hint=" (alternatives per output token; None: no log-probabilities)")


MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def _check_integer(name: str, value, low: int, high: int | None = None, hint: str = "") -> None:
    """``value`` is an ``int`` (not a bool) in ``low .. high``, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an integer {bounds}{hint}, got {value!r}.")


def _check_number(name: str, value) -> None:
    """``value`` is a finite real number (not a bool, not a string), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")


@dataclass
class RequestMetrics:
    """Per-request telemetry; times are ``time.perf_counter()`` seconds."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    cached_prompt_tokens: int = 0  # served by prefix reuse at the first admission
    num_preemptions: int = 0
    tau: float | None = None  # speculation: tokens per target forward (None: no assistant)
    acceptance_rate: float | None = None  # speculation: accepted / drafted tokens (None: nothing drafted yet)
    num_speculative_rounds: int = 0  # decode rounds with a drafter (drafts granted or not)
    num_speculative_tokens: int = 0  # tokens those rounds emitted (accepted drafts + the next token)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted

    def record_speculation(self, drafted: int, accepted: int, emitted: int) -> None:
        """One decode round with a drafter: ``drafted`` tokens verified, ``accepted`` kept, ``emitted`` output."""
        self.num_speculative_rounds += 1
        self.num_speculative_tokens += emitted
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.tau = self.num_speculative_tokens / self.num_speculative_rounds
        if self.num_draft_tokens:
            self.acceptance_rate = self.num_accepted_tokens / self.num_draft_tokens

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two tokens)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class RequestDelta:
    """What one round did for one request."""

    request_id: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when the request asked for log-probabilities


@dataclass
class RequestOutput:
    """A finished request, as ``Engine.generate_batch`` returns it."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    text: str | None = None
    error: str | None = None  # with finish_reason ERROR: what the request's own failure was
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asked for them


class Request:
    """One request's state between rounds (see the module docstring for the token bookkeeping)."""

    def __init__(self, request_id: int, prompt_ids: Sequence[int], settings: SamplingSettings,
                 salt: str | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.settings = settings
        self.salt = salt
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []  # one per output token with settings.logprobs, else empty
        self.num_computed = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.metrics = RequestMetrics()
        self.generator = _generator(settings)
        self.read_cursor = 0  # output tokens already yielded by Engine.stream
        self.fork_of: int | None = None  # a running request whose stored prefix this one shares when admitted
        self.draft_limit = 0  # draft tokens it would verify next round (set by the engine; 0: no speculation)
        self.error: BaseException | None = None  # with finish reason ERROR: the exception that ended it

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the newest token lacks K/V: the next round is a one-token decode step."""
        return self.num_uncomputed == 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, now: float, logprob: TokenLogprob | None = None) -> None:
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        self.metrics.num_output_tokens = len(self.output_ids)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now

    def finish(self, reason: FinishReason, now: float) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
        self.metrics.finish_time = now

    def reset_for_recompute(self) -> None:
        """Preempted: its K/V are gone; it will be prefilled again over prompt and output."""
        self.num_computed = 0
        self.status = RequestStatus.WAITING
        self.metrics.num_preemptions += 1


def _generator(settings: SamplingSettings) -> torch.Generator | None:
    if not settings.do_sample:
        return None
    generator = torch.Generator()
    if settings.seed is None:
        generator.seed()
    else:
        generator.manual_seed(settings.seed)
    return generator
