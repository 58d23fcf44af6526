"""``Engine``: continuous batching on an unmodified transformers model over a paged KV cache — requests join
and leave every round, prompts are prefilled in chunks under a per-round token budget, shared prefixes are
computed once, and requests are preempted (and recomputed) when blocks run out.

Boundary: the public surface and the round's commit point. Scheduling rules are ``scheduler.py``'s, the packed
forward ``runner.py``'s, attention over ragged rows ``attention.py``'s, K/V storage
``hf_kvspec.cache.ragged``'s, token choice and stop rules ``sampling.py``'s. The engine is synchronous: each
``step()`` runs one round (one forward); a server loop calls it.

A round (``step``) is all or nothing: schedule (blocks reserved) -> forward -> choose every sampling row's token
-> commit (K/V kept, requests advanced, finished ones leave and free their blocks). If anything raises before
the commit — the model, a logits processor, a stop-string check — the round's reservations are given back,
sampled requests' generators are restored and no request advances; the exception propagates and the next
``step()`` runs the round again.

Greedy output of each request is the same as ``model.generate(prompt, do_sample=False)`` on that prompt alone
(``tests/serving``), whoever else is running, however its prompt was chunked, shared or recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from hf_kvspec.cache.ragged import RaggedPagedCache

from .attention import register_ragged_attention
from .prompts import Prompt, make_settings, prompt_ids, settings_from_generation_config
from .request import FinishReason, Request, RequestDelta, RequestOutput, RequestTooLongError
from .runner import ForwardRunner
from .sampling import finish_reason, next_token
from .scheduler import RoundPlan, Scheduler, SchedulingPolicy
from .telemetry import EngineStats, RoundStats


class Engine:
    """Continuous batching over a ``RaggedPagedCache`` (see the module docstring).

    Args:
        model: a causal LM (``PreTrainedModel``) with full or sliding-window attention layers.
        tokenizer: needed for text / chat prompts, stop strings and decoded text in outputs.
        kv_budget: the KV cache size: a number of blocks (``int``) or bytes (``"256MB"``).
        block_size: tokens per KV block.
        max_tokens_per_round: the token budget of one forward, shared by decode tokens and prefill chunks.
        max_running: requests running at once (at most ``max_tokens_per_round``).
        policy: the scheduling policy (``SchedulingPolicy``: FIFO).
        enable_prefix_caching: reuse computed full blocks of identical (and identically salted) prefixes.
    """

    def __init__(self, model, tokenizer=None, *, kv_budget: int | str = "256MB", block_size: int = 16,
                 max_tokens_per_round: int = 256, max_running: int = 16, policy: SchedulingPolicy | None = None,
                 enable_prefix_caching: bool = True):
        for name, value in (("block_size", block_size), ("max_tokens_per_round", max_tokens_per_round),
                            ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        register_ragged_attention()
        self.model, self.tokenizer = model, tokenizer
        num_blocks = RaggedPagedCache.blocks_for(model.config, kv_budget, block_size, model.dtype)
        self.cache = RaggedPagedCache(model.config, num_blocks, block_size, enable_prefix_caching, model.dtype)
        self.scheduler = Scheduler(self.cache, policy or SchedulingPolicy(), max_tokens_per_round, max_running)
        self.runner = ForwardRunner(model, self.cache)
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        self._cancelled: list[RequestDelta] = []
        self._max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, *, max_new_tokens: int = 32, do_sample: bool = False,
                    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    stop_strings: str | Sequence[str] | None = None, eos_token_id: int | Sequence[int] | None = None,
                    logits_processor: Sequence | None = None, salt: str | None = None) -> int:
        """Queue a request; returns its id. ``prompt``: token ids, chat messages or text. ``seed``: a per-request
        generator for ``do_sample``. ``eos_token_id``: default the model's ``generation_config``'s. ``salt``: a
        tenant salt; prefix blocks are shared only between requests with the same salt.

        Raises ``RequestTooLongError`` when the prompt plus ``max_new_tokens`` can never fit the KV budget or
        the model's positions."""
        settings = make_settings(self.model.generation_config, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                 stop_strings=stop_strings, eos_token_id=eos_token_id,
                                 logits_processor=logits_processor)
        if settings.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: build Engine(model, tokenizer, ...).")
        ids = prompt_ids(prompt, self.tokenizer)
        self._check_fits(len(ids), settings.max_new_tokens)
        request = Request(self._next_id, ids, settings, salt)
        self._next_id += 1
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """A request alone must fit: its K/V peak at prompt + max_new_tokens - 1 tokens (the last token is never
        fed), and its positions must stay below the model's maximum."""
        needed, capacity = prompt_len + max_new_tokens - 1, self.cache.capacity_tokens()
        if needed > capacity:
            raise RequestTooLongError(
                f"A {prompt_len}-token prompt with max_new_tokens={max_new_tokens} needs {needed} KV slots; the "
                f"whole KV budget holds {capacity}. Raise kv_budget or lower max_new_tokens / the prompt.")
        if self._max_positions is not None and prompt_len + max_new_tokens > self._max_positions:
            raise RequestTooLongError(
                f"A {prompt_len}-token prompt with max_new_tokens={max_new_tokens} runs past the model's "
                f"max_position_embeddings={self._max_positions}; shorten the prompt or lower max_new_tokens.")

    def cancel(self, request_id: int) -> None:
        """Stop a request now: it leaves the queue, its blocks are freed; the next ``step()`` reports it."""
        request = self._requests[request_id]
        if request.finished:
            return
        self.scheduler.remove(request)
        request.finish(FinishReason.CANCELLED, time.perf_counter())
        self._cancelled.append(RequestDelta(request_id, (), True, FinishReason.CANCELLED))

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def get_output(self, request_id: int, forget: bool = True) -> RequestOutput:
        """A request's output so far (all of it once finished); ``forget`` drops a finished request's record."""
        request = self._requests[request_id]
        if forget and request.finished:
            del self._requests[request_id]
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(request_id, list(request.prompt_ids), list(request.output_ids), request.finish_reason,
                             request.metrics, text)

    # ---- rounds --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one round; returns what it did for each request (cancellations since the last step included)."""
        deltas, self._cancelled = self._cancelled, []
        started = time.perf_counter()
        plan, tokens = self._run_round()
        if plan.rows:
            deltas += self._commit(plan, tokens, time.perf_counter())
            self._record(plan, tokens, time.perf_counter() - started)
        return deltas

    def _run_round(self) -> tuple[RoundPlan, list[int]]:
        """Schedule, forward and choose tokens; on any exception, undo the round's reservations and samples."""
        generators = []
        try:
            plan = self.scheduler.schedule()
            if not plan.rows:
                return plan, []
            sampling = [row.request for row in plan.rows if row.samples]
            generators = [(r.generator, r.generator.get_state()) for r in sampling if r.generator is not None]
            logits = self.runner.run(plan.rows)  # [K, V], one row per sampling request
            return plan, [next_token(request, logits[k]) for k, request in enumerate(sampling)]
        except BaseException:
            self.cache.end_forward(ok=False)
            for generator, state in generators:
                generator.set_state(state)
            raise

    def _commit(self, plan: RoundPlan, tokens: list[int], now: float) -> list[RequestDelta]:
        self.cache.end_forward(ok=True)
        deltas, sampled, admitted = [], iter(tokens), {id(r) for r in plan.admitted}
        for row in plan.rows:
            request = row.request
            if id(request) in admitted:
                self._on_admitted(request, cached_tokens=row.start)
            request.num_computed += row.num_tokens
            if not row.samples:
                continue
            request.append_token(next(sampled), now)
            reason = finish_reason(request, self.tokenizer)
            if reason is not None:
                request.finish(reason, now)
                self.scheduler.remove(request)
            else:
                self.cache.record_tokens(request.request_id, request.tokens)
            deltas.append(RequestDelta(request.request_id, (request.output_ids[-1],), reason is not None, reason))
        return deltas

    def _on_admitted(self, request: Request, cached_tokens: int) -> None:
        """Prefix-reuse figures of an admission (a recompute after preemption counts too)."""
        block = self.cache.block_size
        self.stats.record_admission((request.num_tokens - 1) // block, cached_tokens // block)
        if request.metrics.num_preemptions == 0:
            request.metrics.cached_prompt_tokens = cached_tokens

    def _record(self, plan: RoundPlan, tokens: list[int], seconds: float) -> None:
        decode = sum(1 for row in plan.rows if row.num_tokens == 1 and row.samples)
        self.stats.record(RoundStats(
            num_tokens=plan.num_tokens, num_rows=len(plan.rows), num_decode_rows=decode, num_sampled=len(tokens),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            used_blocks=self.cache.num_total_blocks() - self.cache.num_free_blocks(),
            total_blocks=self.cache.num_total_blocks(), slot_utilization=self.cache.utilization(),
            preempted=len(plan.preempted), seconds=seconds))

    # ---- convenience ---------------------------------------------------------------------------------------
    def stream(self, request_id: int) -> Iterator[RequestDelta]:
        """Yield ``request_id``'s new tokens as rounds produce them (running rounds as needed) until it finishes.
        Other requests advance too; their tokens wait for their own ``stream`` / ``get_output``."""
        request = self._requests[request_id]
        while True:
            new = request.output_ids[request.read_cursor:]
            request.read_cursor += len(new)
            if new or request.finished:
                yield RequestDelta(request_id, tuple(new), request.finished, request.finish_reason)
            if request.finished:
                return
            self.step()

    def generate_batch(self, prompts: Sequence[Prompt], generation_config=None, progress_bar: bool = True,
                       **kwargs) -> list[RequestOutput]:
        """Offline: run ``prompts`` to completion, return their outputs in the same order (as transformers'
        ``generate_batch``, but a list). Settings: ``generation_config`` fields, overridden by ``kwargs``
        (``add_request``'s keywords)."""
        from tqdm.auto import tqdm

        settings = settings_from_generation_config(generation_config) if generation_config is not None else {}
        ids = [self.add_request(prompt, **{**settings, **kwargs}) for prompt in prompts]
        pending = set(ids)
        with tqdm(total=len(ids), disable=not progress_bar, desc="Engine.generate_batch") as bar, \
                self.runner.held_across_rounds():
            while pending:
                finished = [d.request_id for d in self.step() if d.finished and d.request_id in pending]
                pending.difference_update(finished)
                bar.update(len(finished))
        return [self.get_output(request_id) for request_id in ids]

    def telemetry(self) -> dict:
        """Engine-wide figures now: running / waiting counts, block use, tokens per forward, preemptions, prefix
        hits (per-request figures are in each output's ``metrics``)."""
        used = self.cache.num_total_blocks() - self.cache.num_free_blocks()
        return {**self.stats.summary(), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "used_blocks": used,
                "total_blocks": self.cache.num_total_blocks(),
                "block_utilization": used / self.cache.num_total_blocks(),
                "slot_utilization": self.cache.utilization()}
