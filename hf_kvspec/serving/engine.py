"""``Engine``: continuous batching on an unmodified transformers model over a paged KV cache — requests join
and leave every round, prompts are prefilled in chunks under a per-round token budget, shared prefixes are
computed once, and requests are preempted (and recomputed) when blocks run out.

Boundary: the public surface and the round's commit point. Scheduling rules are ``scheduler.py``'s, the packed
forward ``runner.py``'s, attention over ragged rows ``attention.py``'s, K/V storage
``hf_kvspec.cache.ragged``'s, token choice and stop rules ``sampling.py``'s. The engine is synchronous: each
``step()`` runs one round (one forward); a server loop calls it.

A round (``step``) is all or nothing: schedule (blocks reserved) -> forward -> choose every sampling row's token
-> commit (K/V kept, requests advanced, finished ones leave and free their blocks). If anything raises before
the commit — the model, a logits processor, a drafter — the round's reservations are given back, sampled
requests' generators are restored and no request advances. Then the round is run again one request at a time
(``_isolate``): a request whose round fails alone is the culprit and ends with finish reason ERROR (its
exception in ``RequestOutput.error``); every other request advances exactly as it would have, so one bad request
never fails another. Past the commit point a row's own bookkeeping (a stop-string decode) failing ends that
request only. What ``add_request`` can check (token ids, settings) it refuses before anything is queued. Only a
failure before any request was scheduled propagates out of ``step()`` (``failed_round`` is then empty).

Threads: the public methods hold one reentrant lock, so ``step``, ``add_request``, ``cancel``, ``stream`` and
``get_output`` may be called from several threads; rounds never overlap.

With an assistant, each decoding request drafts through the engine's drafter for it (``round_drafts.py``),
within the slots the scheduler granted it, and its drafts are verified in the same forward (``speculation.py``): the round commits,
per request, the accepted path plus one token and rolls the rest of its K/V back. How many tokens each request
drafts is chosen per round from load (``hf_kvspec.speculative.draft_budget``): the measured cost of the packed
forward against its token count, each drafter call's cost and each request's running acceptance, maximising the
round's expected tokens per second; a request at K = 0 takes the plain path (no draft call, no verify row), so a
round where nobody drafts is the plain engine's round.

Greedy output of each request is the same as ``model.generate(prompt, do_sample=False)`` on that prompt alone
(``tests/serving``), whoever else is running, however its prompt was chunked, shared or recomputed.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from hf_kvspec.cache.ragged import RaggedPagedCache

from .attention import register_ragged_attention
from .prompts import Prompt, check_vocabulary, make_settings, prompt_ids, settings_from_generation_config
from .request import FinishReason, Request, RequestDelta, RequestFailedError, RequestOutput, RequestTooLongError
from .round_drafts import RoundDrafts, check_draft_lengths
from .runner import ForwardRow, ForwardRunner
from .sampling import choose, finish_reason
from .scheduler import RoundPlan, ScheduledRow, Scheduler, SchedulingPolicy
from .speculation import Verdict, VerifyRow
from .telemetry import EngineStats, RoundStats


def _locked(method):
    """Run ``method`` under the engine's lock: ``step``, ``add_request``, ``cancel`` and the rest may be called
    from several threads; they take turns (a round is never entered twice)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass(frozen=True)
class RowResult:
    """What the round's forward decided for one scheduled row."""

    verdict: Verdict | None  # None: a prefill chunk short of the prompt's end (nothing sampled)
    features: torch.Tensor | None  # [width, F] the target's features of the row's columns (feature drafters)
    width: int  # packed columns of the row (its tokens and drafts)
    verified: bool = True  # False: a plain sample (no drafter state), not a verify row


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
        assistant: speculative decoding inside the rounds (``speculation.py``): an ``Assistant`` (ngram, a draft
            model, Medusa, EAGLE, the suffix pool, self-int8) or a spec string (``"ngram"``, ``"suffix"``,
            ``"eagle"``, ``"medusa"``, ``"self-int8"``, ``"draft:<dir>"``); or the suffix pool and one model drafter,
            chosen per request and round (``["suffix", "eagle"]`` or ``"suffix+eagle"``, ``mixed_drafting.py``);
            ``"auto"``: the suffix pool with the bundled EAGLE head where it was trained for this model, else alone.
        num_draft_tokens: drafts (tree nodes) per request per round at most; default the assistant's own size
            (``drafting.AUTO_DRAFT_TOKENS`` where its size is ``"auto"``). The token budget may grant fewer.
        draft_lengths: ``"goodput"`` (default): each round gives each drafting request the K in
            ``0 .. num_draft_tokens`` that maximises the round's expected tokens per second, from measured costs and
            acceptance (``draft_budget.py``); ``"fixed"``: every decoding request drafts ``num_draft_tokens`` (the
            reference; speculation may then cost more than it gains under load).
        fast_forward: the rounds' packed forward on ``hf_kvspec.forward``'s fast forward (packed weight copies):
            ``None`` where it applies and pays (fp32 Llama-family models on CPU), ``True`` or an error naming why
            not, ``False`` the model's own forward (the reference).
    """

    def __init__(self, model, tokenizer=None, *, kv_budget: int | str = "256MB", block_size: int = 16,
                 max_tokens_per_round: int = 256, max_running: int = 16, policy: SchedulingPolicy | None = None,
                 enable_prefix_caching: bool = True, assistant=None, num_draft_tokens: int | None = None,
                 fast_forward: bool | None = None, draft_lengths: str = "goodput"):
        for name, value in (("block_size", block_size), ("max_tokens_per_round", max_tokens_per_round),
                            ("max_running", max_running)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        register_ragged_attention()
        self.model, self.tokenizer = model, tokenizer
        num_blocks = RaggedPagedCache.blocks_for(model.config, kv_budget, block_size, model.dtype, model.device)
        self.cache = RaggedPagedCache(model.config, num_blocks, block_size, enable_prefix_caching, model.dtype)
        self.scheduler = Scheduler(self.cache, policy or SchedulingPolicy(), max_tokens_per_round, max_running)
        self.runner = ForwardRunner(model, self.cache, fast_forward=fast_forward)
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        self._lock = threading.RLock()  # public methods take turns (``_locked``); reentrant for ``stream``
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._next_id = 0
        self._cancelled: list[RequestDelta] = []
        self.failed_round: tuple[int, ...] = ()  # request ids of the last round that raised (a server fails them)
        self._max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        check_draft_lengths(draft_lengths)
        self.drafts = None if assistant is None else RoundDrafts(  # speculation, if any
            model, self.cache, self.runner, assistant, num_draft_tokens, draft_lengths)

    @property
    def vocab_size(self) -> int:
        """Token ids a request may hold: ``0 .. vocab_size - 1`` (the model's input embedding rows)."""
        return self._vocab_size

    # ---- requests ------------------------------------------------------------------------------------------
    @_locked
    def add_request(self, prompt: Prompt, *, max_new_tokens: int = 32, do_sample: bool = False,
                    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                    stop_strings: str | Sequence[str] | None = None, eos_token_id: int | Sequence[int] | None = None,
                    logits_processor: Sequence | None = None, logprobs: int | None = None, salt: str | None = None,
                    fork_of: int | None = None) -> int:
        """Queue a request; returns its id. ``prompt``: token ids, chat messages or text. ``seed``: a per-request
        generator for ``do_sample``. ``eos_token_id``: default the model's ``generation_config``'s. ``salt``: a
        tenant salt; prefix blocks are shared only between requests with the same salt. ``fork_of``: a request
        with the same prompt (e.g. another choice of an ``n > 1`` request); if it is running when this one is
        admitted, this one shares its stored prefix copy-on-write instead of computing it. ``logprobs``: each
        output token's log-probability and its ``logprobs`` (0..20) most likely alternatives, in
        ``RequestOutput.logprobs`` and each ``RequestDelta`` — the target's distribution after the request's
        processors and warpers, exact under speculation too (``logprobs.py``).

        Every argument is checked here, so that a request that would fail inside a round is refused before it
        is queued: ``ValueError`` naming the argument (prompt or ``eos_token_id`` ids outside the vocabulary, a
        seed outside ``0 .. 2**64 - 1``, a non-callable processor, an empty stop string, ...);
        ``RequestTooLongError`` when the prompt plus ``max_new_tokens`` can never fit the KV budget or the
        model's positions. A sampled request with ``temperature`` below ``GREEDY_BELOW_TEMPERATURE`` (1e-5)
        decodes greedily (dividing by less would overflow the scores)."""
        settings = make_settings(self.model.generation_config, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                 stop_strings=stop_strings, eos_token_id=eos_token_id,
                                 logits_processor=logits_processor, logprobs=logprobs)
        if settings.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: build Engine(model, tokenizer, ...).")
        check_vocabulary("eos_token_id", settings.eos_token_id, self._vocab_size)
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt must be a string (a tenant's name or secret) or None, got {salt!r}.")
        if fork_of is not None and (isinstance(fork_of, bool) or not isinstance(fork_of, int)):
            raise ValueError(f"fork_of must be a request id (int) or None, got {fork_of!r}.")
        ids = prompt_ids(prompt, self.tokenizer, self._vocab_size)
        self._check_fits(len(ids), settings.max_new_tokens)
        return self._queue(Request(self._next_id, ids, settings, salt), fork_of)

    def _queue(self, request: Request, fork_of: int | None) -> int:
        request.fork_of = fork_of
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

    def _request(self, request_id: int) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            known = "" if isinstance(request_id, int) else " (ids are the ints add_request returns)"
            raise KeyError(f"No request {request_id!r} in this engine{known}: it was never added, or its finished "
                           "output was already taken with get_output(forget=True).")
        return request

    @_locked
    def cancel(self, request_id: int) -> None:
        """Stop a request now: it leaves the queue, its blocks are freed; the next ``step()`` reports it (a
        ``stream`` of it yields its last delta, ``finish_reason`` CANCELLED). Cancelling a finished request is a
        no-op; an unknown id is a ``KeyError`` naming it."""
        request = self._request(request_id)
        if request.finished:
            return
        self.scheduler.remove(request)
        self._forget_drafts(request)
        request.finish(FinishReason.CANCELLED, time.perf_counter())
        self._cancelled.append(RequestDelta(request_id, (), True, FinishReason.CANCELLED))

    @_locked
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @_locked
    def get_output(self, request_id: int, forget: bool = True) -> RequestOutput:
        """A request's output so far (all of it once finished); ``forget`` drops a finished request's record.
        A request that failed on its own has ``finish_reason`` ERROR and ``error`` set."""
        request = self._request(request_id)
        if forget and request.finished:
            del self._requests[request_id]
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True) if self.tokenizer else None
        error = None if request.error is None else f"{type(request.error).__name__}: {request.error}"
        logprobs = None if request.settings.logprobs is None else list(request.output_logprobs)
        return RequestOutput(request_id, list(request.prompt_ids), list(request.output_ids), request.finish_reason,
                             request.metrics, text, error, logprobs)

    # ---- rounds --------------------------------------------------------------------------------------------
    @_locked
    def step(self) -> list[RequestDelta]:
        """Run one round; returns what it did for each request (cancellations since the last step included).

        A round that raises is undone and run again one request at a time (``_isolate``): a request whose round
        fails alone ends with finish reason ERROR, every other one advances as it would have. Only a failure
        before any request was scheduled propagates (``failed_round`` is then empty)."""
        deltas, self._cancelled = self._cancelled, []
        self.failed_round = ()
        try:
            return deltas + self._round()
        except Exception:
            if not self.failed_round:
                self._cancelled = deltas + self._cancelled  # reported by the next step
                raise
            return deltas + self._isolate(self.failed_round)

    def _round(self, only: set[int] | None = None) -> list[RequestDelta]:
        """One round (of the requests in ``only``, if given): run it, commit it, record it."""
        started = time.perf_counter()
        plan, results = self._run_round(only)
        if not plan.rows:
            return []
        new = self._commit(plan, results, time.perf_counter())
        self._record(plan, results, sum(len(d.new_token_ids) for d in new), time.perf_counter() - started)
        return new

    def _isolate(self, suspects: tuple[int, ...]) -> list[RequestDelta]:
        """The round of ``suspects`` raised and was undone (nothing committed, blocks and generators restored):
        run it again one request at a time. A request whose round fails alone is a culprit: it ends (ERROR) and
        frees its blocks. Each other request advances by its own round, exactly as in the shared one (outputs
        never depend on who shares a round), so bystanders lose nothing."""
        deltas = []
        for request_id in suspects:
            request = self._requests.get(request_id)
            if request is None or request.finished:
                continue
            try:
                deltas += self._round(only={request_id})
            except Exception as error:
                deltas.append(self._fail(request, error))
        return deltas

    def _fail(self, request: Request, error: Exception) -> RequestDelta:
        """End a request that failed on its own: it leaves the scheduler, its blocks and drafter state go."""
        self.scheduler.remove(request)
        self._forget_drafts(request)
        request.error = error
        request.finish(FinishReason.ERROR, time.perf_counter())
        return RequestDelta(request.request_id, (), True, FinishReason.ERROR)

    def _run_round(self, only: set[int] | None = None) -> tuple[RoundPlan, list[RowResult]]:
        """Schedule, draft, forward and choose tokens; on any exception, undo the round's reservations and samples
        (and drop the drafter states of the requests with verify rows in it; a draft model's cache also sheds what an
        undone round left at the next draft: ``model_drafting.py``)."""
        generators, verify, plan = [], {}, None
        try:
            if self.drafts is not None:
                self.drafts.set_limits(self.scheduler.running)
            plan = self.scheduler.schedule(only)
            for request in plan.preempted:
                self._forget_drafts(request)
            if not plan.rows:
                return plan, []
            sampling = [row.request for row in plan.rows if row.samples]
            generators = [(r.generator, r.generator.get_state()) for r in sampling if r.generator is not None]
            verify = self.drafts.draft(plan) if self.drafts is not None else {}
            return plan, self._forward_and_choose(plan, verify)
        except BaseException:
            self.failed_round = () if plan is None else tuple(row.request.request_id for row in plan.rows)
            self.cache.end_forward(ok=False)
            for generator, state in generators:
                generator.set_state(state)
            for row in verify.values():
                self._forget_drafts(row.request)
            raise

    def _forward_and_choose(self, plan: RoundPlan, verify: dict[int, VerifyRow]) -> list[RowResult]:
        """The packed forward (features too, when the assistant reads them) and every row's new tokens."""
        rows = [verify[i].forward_row() if i in verify else ForwardRow.scheduled(row) for i, row in enumerate(plan.rows)]
        layers = self.drafts.feature_layers if self.drafts else None
        started = time.perf_counter()
        logits, features = self.runner.forward_with_features(rows, layers)  # [K, V], [T, F] | None
        if self.drafts is not None:
            self.drafts.record_forward(sum(len(row.token_ids) for row in rows), time.perf_counter() - started)
        results, at, column = [], 0, 0
        for index, (row, forward_row) in enumerate(zip(plan.rows, rows)):
            count, width = len(forward_row.logits_at), len(forward_row.token_ids)
            row_features = None if features is None else features[column: column + width]  # [width, F]
            if index in verify:
                results.append(RowResult(self.drafts.accept(verify[index], logits[at: at + count]), row_features,
                                         width))
            elif row.samples:
                token, logprobs = choose(row.request, logits[at])
                results.append(RowResult(Verdict([token], 0, 0, None, None, logprobs), row_features, width,
                                         verified=False))
            else:
                results.append(RowResult(None, row_features, width))
            at, column = at + count, column + width
        return results

    def _commit(self, plan: RoundPlan, results: list[RowResult], now: float) -> list[RequestDelta]:
        self.cache.end_forward(ok=True)
        deltas, admitted = [], {id(r) for r in plan.admitted}
        for row, result in zip(plan.rows, results):
            try:
                delta = self._commit_row(row, result, id(row.request) in admitted, now)
            except Exception as error:  # past the commit point only this request's own bookkeeping is at stake
                delta = self._fail(row.request, error)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _commit_row(self, row: ScheduledRow, result: RowResult, admitted: bool, now: float) -> RequestDelta | None:
        request = row.request
        if admitted:
            self._on_admitted(request, cached_tokens=row.start)
        request.num_computed += row.num_tokens
        if result.verdict is None:  # a prefill chunk that does not reach the end of the prompt
            self._gather_features(request, result.features)
            return None
        new, reason = self._append(request, result.verdict, now)
        if result.verified:
            self.drafts.record_verdict(request, result.verdict, len(new))
        if reason is not None:
            request.finish(reason, now)
            self.scheduler.remove(request)
            self._forget_drafts(request)
        else:
            self._keep(request, row, result)
            self.cache.record_tokens(request.request_id, request.tokens)
        return RequestDelta(request.request_id, tuple(new), reason is not None, reason,
                            result.verdict.logprobs[: len(new)])

    def _append(self, request: Request, verdict: Verdict, now: float) -> tuple[list[int], FinishReason | None]:
        """Append the round's tokens (and their log-probabilities, if asked) one by one up to the first that
        ends the request (it is kept, as in ``generate``); returns the appended tokens and the finish reason."""
        tokens, logprobs = verdict.tokens, verdict.logprobs or (None,) * len(verdict.tokens)
        for count, (token, logprob) in enumerate(zip(tokens, logprobs), start=1):
            request.append_token(token, now, logprob)
            reason = finish_reason(request, self.tokenizer)
            if reason is not None:
                return tokens[:count], reason
        return tokens, None

    def _keep(self, request: Request, row: ScheduledRow, result: RowResult) -> None:
        """A request that goes on: its verified path stays in the cache; its drafter sees the round."""
        if self.drafts is not None:
            self.drafts.keep(request, row, result.verdict, result.verified, result.features)

    def _gather_features(self, request: Request, features) -> None:
        if self.drafts is not None:
            self.drafts.gather(request, features)

    def _forget_drafts(self, request: Request) -> None:
        if self.drafts is not None:
            self.drafts.forget(request)

    def _on_admitted(self, request: Request, cached_tokens: int) -> None:
        """Prefix-reuse figures of an admission (a recompute after preemption counts too)."""
        block = self.cache.block_size
        self.stats.record_admission((request.num_tokens - 1) // block, cached_tokens // block)
        if request.metrics.num_preemptions == 0:
            request.metrics.cached_prompt_tokens = cached_tokens

    def _record(self, plan: RoundPlan, results: list[RowResult], output_tokens: int, seconds: float) -> None:
        decode = sum(1 for row in plan.rows if row.num_tokens == 1 and row.samples)
        verdicts = [r.verdict for r in results if r.verdict is not None]
        self.stats.record(RoundStats(
            num_tokens=sum(r.width for r in results), num_rows=len(plan.rows), num_decode_rows=decode,
            num_sampled=len(verdicts), num_draft_tokens=sum(v.num_draft for v in verdicts),
            num_accepted=sum(v.num_accepted for v in verdicts),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            used_blocks=self.cache.num_total_blocks() - self.cache.num_free_blocks(),
            total_blocks=self.cache.num_total_blocks(), slot_utilization=self.cache.utilization(),
            preempted=len(plan.preempted), seconds=seconds, num_output_tokens=output_tokens))

    # ---- convenience ---------------------------------------------------------------------------------------
    def stream(self, request_id: int) -> Iterator[RequestDelta]:
        """Yield ``request_id``'s new tokens as rounds produce them (running rounds as needed) until it finishes.
        Other requests advance too; their tokens wait for their own ``stream`` / ``get_output``. Cancelled
        meanwhile (even from inside the loop), it yields a last delta with ``finish_reason`` CANCELLED; failed on
        its own, it raises ``RequestFailedError``. An unknown id raises ``KeyError`` here, not at the first
        ``next``."""
        return self._stream(self._request(request_id))

    def _stream(self, request: Request) -> Iterator[RequestDelta]:
        request_id = request.request_id
        while True:
            with self._lock:
                new = request.output_ids[request.read_cursor:]
                logprobs = tuple(request.output_logprobs[request.read_cursor:])
                request.read_cursor += len(new)
                finished, reason = request.finished, request.finish_reason
            if reason is FinishReason.ERROR:
                raise RequestFailedError(f"Request {request_id} failed: {type(request.error).__name__}: "
                                         f"{request.error}") from request.error
            if new or finished:
                yield RequestDelta(request_id, tuple(new), finished, reason, logprobs)
            if finished:
                return
            with self._lock:
                if not request.finished:
                    self.step()

    @_locked
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
                self.hold_rounds():
            while pending:
                finished = [d.request_id for d in self.step() if d.finished and d.request_id in pending]
                pending.difference_update(finished)
                bar.update(len(finished))
        errors = [self._requests[request_id].error for request_id in ids]
        outputs = [self.get_output(request_id) for request_id in ids]
        failed = [i for i, output in enumerate(outputs) if output.finish_reason is FinishReason.ERROR]
        if failed:
            raise RequestFailedError(f"{len(failed)} of {len(ids)} prompts failed (first: prompt {failed[0]}: "
                                     f"{outputs[failed[0]].error}); the others finished. Run them with "
                                     "add_request / step to keep the others' outputs.") from errors[failed[0]]
        return outputs

    def hold_rounds(self):
        """The runner's set-up held across the rounds of a serving loop (``ForwardRunner.held_across_rounds``); with
        an assistant only the decode kernels are held, since drafting may run the target outside the engine's
        attention."""
        return self.runner.held_across_rounds(attention=self.drafts is None or not self.drafts.runs_target_outside)

    @_locked
    def telemetry(self) -> dict:
        """Engine-wide figures now: running / waiting counts, block use, tokens per forward, preemptions, prefix
        hits (per-request figures are in each output's ``metrics``)."""
        used = self.cache.num_total_blocks() - self.cache.num_free_blocks()
        return {**self.stats.summary(), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "used_blocks": used,
                "total_blocks": self.cache.num_total_blocks(),
                "block_utilization": used / self.cache.num_total_blocks(),
                "slot_utilization": self.cache.utilization(),
                **(self.drafts.telemetry() if self.drafts is not None else {})}
