"""The one task that drives the engine of ``hf-kvspec serve``: requests and cancellations reach it through an
asyncio queue, it runs ``Engine.step()`` in a worker thread (the forward blocks) and hands each choice's new
tokens to that choice's own asyncio queue.

Boundary: between the HTTP handlers and the engine. Handlers never touch the engine: they ``submit`` and
``cancel`` and read ``Event``s. The engine is only ever used by this task — between rounds on the event loop
(``add_request``, ``cancel``, ``get_output``), during a round in the worker thread — never by two threads at once.
Scoring a prompt for ``echo`` (one plain forward of the model) runs in the same worker thread, between rounds.

Under trouble:
    * a cancelled choice (a client that went away) leaves the engine at once, freeing its blocks;
    * a request that fails on its own (the engine re-runs a raising round request by request and ends only the
      culprits, finish reason ERROR) fails its choice with an ``Event(error=...)``; the others go on untouched;
    * a round that raises out of ``Engine.step`` (only before any request was scheduled) fails every open choice:
      retrying would raise again.

``n > 1``: the first choice is added alone; when its first event arrives (its prompt is computed) the other
choices are added with ``fork_of`` it, so they share its prompt blocks copy-on-write instead of prefilling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .request import FinishReason, RequestOutput
from .server_metrics import ServerMetrics

logger = logging.getLogger("hf_kvspec.serve")


@dataclass(frozen=True)
class Event:
    """What a choice's queue receives: new tokens, then (once) the finished output or an error."""

    token_ids: tuple[int, ...] = ()
    output: RequestOutput | None = None  # set when the choice finished
    error: str | None = None  # set when its round failed: the choice is over
    logprobs: tuple = ()  # ``TokenLogprob`` per new token, when the choice asked for them


class Choice:
    """One engine request as the server sees it (one of a request's ``n`` choices)."""

    def __init__(self, index: int, settings: dict):
        self.index, self.settings = index, settings
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.request_id: int | None = None  # set once added to the engine
        self.arrival = time.monotonic()
        self.got_first_token = False
        self.closed = False  # finished, failed or cancelled


class EngineWorker:
    """Owns the engine (see the module docstring). ``open_choices``: submitted and not yet over."""

    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.open_choices = 0
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._live: dict[int, Choice] = {}  # request id -> choice, while in the engine
        self._forks: dict[int, tuple[list[int], list[Choice]]] = {}  # first choice's id -> (prompt, other choices)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvspec-engine")
        self.telemetry = engine.telemetry()  # the engine's figures between rounds (never read mid-round)

    # ---- the handlers' side ---------------------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], settings: list[dict], first_index: int = 0) -> list[Choice]:
        """Queue one prompt with ``len(settings)`` choices (indexed from ``first_index``); returns when the engine
        accepted the first (or raises what ``Engine.add_request`` raised, e.g. ``RequestTooLongError``)."""
        choices = [Choice(first_index + i, s) for i, s in enumerate(settings)]
        self.open_choices += len(choices)
        accepted = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(("add", prompt_ids, choices, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.cancel(choices)
            raise
        return choices

    async def score(self, prompt_ids: list[int], top: int) -> tuple:
        """Each prompt token's ``TokenLogprob`` given the ones before it (None for the first): one plain forward,
        on the engine's thread between rounds (the executor runs one thing at a time)."""
        from .logprobs import prompt_logprobs

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, prompt_logprobs, self.engine.model, prompt_ids, top)

    def cancel(self, choices: list[Choice]) -> None:
        """The client is gone: end these choices, freeing their blocks (no-op for ended ones)."""
        self._inbox.put_nowait(("cancel", choices))

    def stop(self) -> None:
        """End ``run`` after the commands already queued."""
        self._inbox.put_nowait(("stop",))

    # ---- the loop ---------------------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.engine.has_unfinished() and not self._handle(await self._inbox.get()):
                    return
                while not self._inbox.empty():
                    if not self._handle(self._inbox.get_nowait()):
                        return
                if self.engine.has_unfinished():
                    try:
                        deltas = await loop.run_in_executor(self._executor, self.engine.step)
                    except Exception as err:
                        self._fail_round(err)
                    else:
                        self._dispatch(deltas)
                self.telemetry = self.engine.telemetry()
        finally:
            self._executor.shutdown(wait=True)

    def _handle(self, command: tuple) -> bool:
        """Apply one inbox command between rounds; False for ``stop``."""
        if command[0] == "add":
            self._add(*command[1:])
        elif command[0] == "cancel":
            for choice in command[1]:
                self._end(choice, "cancelled", cancel=True)
        return command[0] != "stop"

    def _add(self, prompt_ids: list[int], choices: list[Choice], accepted: asyncio.Future) -> None:
        first = choices[0]
        if first.closed:  # cancelled before it reached the engine
            return
        try:
            first.request_id = self.engine.add_request(prompt_ids, **first.settings)
        except Exception as err:
            for choice in choices:
                self._end(choice, "rejected")
            if not accepted.done():
                accepted.set_exception(err)
            return
        self._live[first.request_id] = first
        if len(choices) > 1:
            self._forks[first.request_id] = (prompt_ids, choices[1:])
        if not accepted.done():
            accepted.set_result(None)

    def _add_forks(self, first_id: int) -> None:
        """The first choice's prompt is computed: add the other choices, sharing its blocks."""
        prompt_ids, others = self._forks.pop(first_id, (None, []))
        for choice in others:
            if choice.closed:
                continue
            try:
                choice.request_id = self.engine.add_request(prompt_ids, fork_of=first_id, **choice.settings)
            except Exception as err:  # the first choice with the same settings was accepted: not expected
                self._end(choice, "rejected", error=f"{type(err).__name__}: {err}")
                continue
            self._live[choice.request_id] = choice

    def _dispatch(self, deltas) -> None:
        now = time.monotonic()
        for delta in deltas:
            choice = self._live.get(delta.request_id)
            if choice is None:  # cancelled or failed already
                continue
            if delta.finish_reason is FinishReason.ERROR:
                self._end(choice, "failed", error=f"The engine failed this request: "
                                                  f"{self.engine.get_output(delta.request_id).error}")
                continue
            self._add_forks(delta.request_id)
            if delta.new_token_ids:
                self.metrics.record_tokens(len(delta.new_token_ids), now)
                if not choice.got_first_token:
                    choice.got_first_token = True
                    self.metrics.record_ttft(now - choice.arrival)
            output = None
            if delta.finished:
                output = self.engine.get_output(delta.request_id)
                self._end(choice, "finished", metrics=output.metrics)
            choice.events.put_nowait(Event(tuple(delta.new_token_ids), output, logprobs=tuple(delta.logprobs)))

    def _fail_round(self, err: Exception) -> None:
        failed = [rid for rid in self.engine.failed_round if rid in self._live] or list(self._live)
        logger.error("A round failed; failing its %d request(s): %s", len(failed), err,
                     exc_info=(type(err), err, err.__traceback__))
        message = f"The engine round serving this request failed: {type(err).__name__}: {err}"
        for request_id in failed:
            self._end(self._live[request_id], "failed", cancel=True, error=message)

    def _end(self, choice: Choice, outcome: str, cancel: bool = False, metrics=None, error: str | None = None):
        """Close a choice once: count it, send ``error`` if any, leave the engine (``cancel``: freeing its blocks
        now); choices still waiting to fork from it end the same way."""
        if choice.closed:
            return
        choice.closed = True
        self.open_choices -= 1
        self.metrics.record_end(outcome, metrics)
        if error is not None:
            choice.events.put_nowait(Event(error=error))
        if choice.request_id is None:
            return
        if self._live.pop(choice.request_id, None) is not None and cancel:
            self.engine.cancel(choice.request_id)
            self.engine.get_output(choice.request_id)  # forget its record
        for other in self._forks.pop(choice.request_id, (None, []))[1]:
            self._end(other, outcome, error=error)
