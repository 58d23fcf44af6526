"""``hf-kvspec serve``: an OpenAI-compatible HTTP server (Starlette on uvicorn) over one continuous-batching
``Engine`` per process.

Boundary: HTTP only — routes, status codes, server-sent events, the drain on SIGTERM. Request bodies are
``server_protocol.py``'s, output text ``server_text.py``'s, the engine loop ``server_worker.py``'s, the metrics
``server_metrics.py``'s. Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``, ``GET /metrics`` (docs/serve.md).

Status codes (every error an OpenAI error body): 400 for a bad body, token ids outside the vocabulary or a
request that can never fit (naming the field), 404 for an unknown path, 405 for a wrong method, 413 for a body
over ``max_body_bytes``, 429 with ``Retry-After`` when ``max_queue`` choices are already in the server, 500 when
the engine failed the request (the server keeps serving the others), 503 while draining after SIGTERM (to
requests on connections already open: uvicorn closes the listening socket, so new connections are refused). A
stream that fails after its first chunk ends with an ``error`` event instead (the status line is already sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .prompts import prompt_ids
from .request import RequestTooLongError
from .server_metrics import ServerMetrics
from .server_protocol import (
    BadRequest,
    GenerationParams,
    chunk_body,
    error_body,
    finish_reason_name,
    logprobs_body,
    new_response_id,
    parse_request,
    response_body,
    sse,
    usage,
    usage_chunk,
)
from .server_text import ChoiceLogprobs, ChoiceText
from .server_worker import Choice, EngineWorker

logger = logging.getLogger("hf_kvspec.serve")
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServerConfig:
    """Server settings (the engine's are the ``Engine``'s own)."""

    model_name: str = "model"  # the id ``/v1/models`` lists and responses carry
    max_queue: int = 256  # choices in the server at once (running + waiting); more get 429
    retry_after_s: int = 1  # the 429's Retry-After
    drain_timeout_s: float = 300.0  # after SIGTERM, running requests get this long to finish
    max_body_bytes: int = 4 * 2**20  # a larger request body gets 413 (a 128k-token prompt is well under)

    def __post_init__(self):
        for name in ("max_queue", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerConfig.{name} must be a positive integer, got {value!r}.")


class ServerState:
    """What the handlers share: the engine worker, the tokenizer, the config and the draining flag."""

    def __init__(self, engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(engine, self.metrics)
        self.draining = False


def create_app(engine, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving ``engine`` (an ``Engine`` built with a tokenizer); its lifespan runs the worker."""
    if engine.tokenizer is None:
        raise ValueError("The server needs the engine's tokenizer: build Engine(model, tokenizer, ...).")
    state = ServerState(engine, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(state.worker.run())
        task.add_done_callback(_log_crash)
        try:
            yield
        finally:
            state.worker.stop()
            await task

    routes = [Route("/v1/models", _models, methods=["GET"]), Route("/health", _health, methods=["GET"]),
              Route("/metrics", _metrics, methods=["GET"]),
              Route("/v1/completions", _completions, methods=["POST"]),
              Route("/v1/chat/completions", _chat_completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.server = state
    return app


async def _http_error(request: HttpRequest, exc: HTTPException) -> Response:
    """Starlette's own refusals (404 unknown path, 405 wrong method) as OpenAI error bodies."""
    kinds = {404: ("not_found_error", "unknown_url"), 405: ("invalid_request_error", "method_not_allowed")}
    kind, code = kinds.get(exc.status_code, ("invalid_request_error", None))
    message = {404: f"Unknown path {request.url.path}; the server has /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health and /metrics.",
               405: f"{request.method} is not allowed on {request.url.path}."}.get(exc.status_code, str(exc.detail))
    return _error(exc.status_code, message, kind, code=code, headers=exc.headers)


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.critical("The engine loop stopped", exc_info=task.exception())


def _state(request: HttpRequest) -> ServerState:
    return request.app.state.server


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


# ---- small endpoints ---------------------------------------------------------------------------------------
async def _models(request: HttpRequest) -> Response:
    name = _state(request).config.model_name
    return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                     "owned_by": "hf_kvspec"}]})


async def _health(request: HttpRequest) -> Response:
    if _state(request).draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(request: HttpRequest) -> Response:
    state = _state(request)
    text = state.metrics.render(state.worker.telemetry, state.draining)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# ---- generation ----------------------------------------------------------------------------------------------
async def _completions(request: HttpRequest) -> Response:
    return await _generate(request, "completion")


async def _chat_completions(request: HttpRequest) -> Response:
    return await _generate(request, "chat")


async def _generate(request: HttpRequest, kind: str) -> Response:
    state = _state(request)
    if state.draining:
        return _error(503, "The server is shutting down; retry on another instance.", "server_shutting_down")
    body = await _body(request, state.config.max_body_bytes)
    if body is None:
        return _error(413, f"The request body exceeds {state.config.max_body_bytes:,} bytes (serve "
                      "--max-body-bytes).", "invalid_request_error", code="request_too_large")
    try:
        params = parse_request(body, kind)
        ids = [_prompt_ids(params, prompt, state.engine.tokenizer, state.engine.vocab_size)
               for prompt in params.prompts]
    except BadRequest as err:
        return _error(400, str(err), "invalid_request_error", err.param, err.code)
    if state.worker.open_choices + params.n * len(ids) > state.config.max_queue:
        return _error(429, f"The server holds {state.worker.open_choices} requests (limit {state.config.max_queue});"
                      " retry later.", "rate_limit_exceeded", headers={"Retry-After": str(state.config.retry_after_s)})
    echoes = [await _echo(state, params, p, i) for p, i in zip(params.prompts, ids)] if params.echo else None
    prompts = Prompts(ids, echoes, params.n)
    if params.max_tokens == 0:  # echo only: the prompts scored, nothing generated
        return _echo_only(state, params, prompts)
    choices: list[Choice] = []
    for index, prompt in enumerate(ids):
        try:
            choices += await state.worker.submit(prompt, [_engine_kwargs(state, params, i) for i in range(params.n)],
                                                 first_index=index * params.n)
        except (RequestTooLongError, ValueError) as err:
            state.worker.cancel(choices)  # the batch's earlier prompts
            if isinstance(err, RequestTooLongError):
                return _error(400, str(err), "invalid_request_error", _too_long_field(state.engine, params, prompt),
                              "context_length_exceeded")
            return _error(400, str(err), "invalid_request_error")
    if params.stream:
        return await _start_stream(state, params, prompts, choices, request)
    return await _whole(state, params, prompts, choices, request)


def _engine_kwargs(state: ServerState, params: GenerationParams, choice: int) -> dict:
    """``Engine.add_request`` keywords of one choice: its own grammar processor under ``response_format``."""
    kwargs = params.engine_kwargs(choice)
    if params.grammar is not None:
        from hf_kvspec.grammar import GrammarLogitsProcessor

        kwargs["logits_processor"] = [GrammarLogitsProcessor(state.engine.tokenizer, grammar=params.grammar)]
    return kwargs


async def _body(request: HttpRequest, limit: int) -> bytes | None:
    """The request body, or None once it is longer than ``limit`` (by its Content-Length or as it streams in)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_ids(params: GenerationParams, prompt, tokenizer, vocab_size: int) -> list[int]:
    try:
        return prompt_ids(prompt, tokenizer, vocab_size)
    except Exception as err:  # a template that rejects the messages, ids outside the vocabulary, ...
        raise BadRequest(f"The {params.prompt_field} could not be tokenized: {err}", param=params.prompt_field,
                         code="invalid_value") from None


def _too_long_field(engine, params: GenerationParams, ids: list[int]) -> str:
    """Which field to blame: the prompt if it cannot fit even with one new token, else ``max_tokens``."""
    try:
        engine._check_fits(len(ids), 1)
    except RequestTooLongError:
        return params.prompt_field
    return "max_tokens"


async def _unless_disconnected(awaitable, request: HttpRequest):
    """Await ``awaitable``; None (and it is cancelled) if the client goes away first."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return None
    return task.result()


@dataclass(frozen=True)
class Echo:
    """Completions' ``echo``: the prompt's ids and text, and (with ``logprobs``) each prompt token's
    ``TokenLogprob`` given the ones before it (None for the first)."""

    ids: list[int]
    text: str
    logprobs: tuple | None

    def start(self, logprobs: ChoiceLogprobs) -> list:
        """The prompt's decoded entries, advancing ``logprobs``' offsets past them (empty without logprobs)."""
        return [] if self.logprobs is None else logprobs.add_prompt(self.ids, self.logprobs)


@dataclass(frozen=True)
class Prompts:
    """A request's prompts as the engine takes them: token ids per prompt and, with ``echo``, each one's
    ``Echo``. Choice ``p * n + i`` is prompt p's choice i (OpenAI's indexing of a completions batch)."""

    ids: list[list[int]]
    echoes: list[Echo] | None
    n: int

    @property
    def tokens(self) -> int:
        """``usage.prompt_tokens``: each prompt once, whatever ``n``."""
        return sum(len(ids) for ids in self.ids)

    def echo(self, index: int) -> Echo | None:
        return None if self.echoes is None else self.echoes[index // self.n]


async def _echo(state: ServerState, params: GenerationParams, prompt, ids: list[int]) -> Echo:
    text = prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(ids)
    scored = None if params.logprobs is None else await state.worker.score(ids, params.logprobs)
    return Echo(ids, text, scored)


def _echo_only(state: ServerState, params: GenerationParams, prompts: Prompts) -> Response:
    """``max_tokens: 0`` with ``echo``: each choice is its prompt (finish reason ``length``), no engine request."""
    response_id, model = new_response_id(params.kind), state.config.model_name
    choices = []
    for index in range(len(prompts.ids) * params.n):
        echo = prompts.echo(index)
        decoded = echo.start(ChoiceLogprobs(state.engine.tokenizer))
        body = None if params.logprobs is None else logprobs_body(params.kind, decoded)
        choices.append({"index": index, "text": echo.text, "logprobs": body, "finish_reason": "length"})
    if not params.stream:
        return JSONResponse(response_body(params, response_id, model, choices, usage(prompts.tokens, 0), []))

    async def events():
        for choice in choices:
            yield sse(chunk_body(params, response_id, model, choice["index"], choice["text"], "length",
                                 logprobs=choice["logprobs"]))
        if params.include_usage:
            yield sse(usage_chunk(params, response_id, model, usage(prompts.tokens, 0)))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def _whole(state: ServerState, params: GenerationParams, prompts: Prompts, choices: list[Choice],
                 request: HttpRequest) -> Response:
    """A non-streamed response: wait for every choice, cancelling them if the client goes away."""
    try:
        results = await _unless_disconnected(
            asyncio.gather(*(_collect(state, params, c, prompts.echo(c.index)) for c in choices)), request)
    finally:
        state.worker.cancel(choices)  # no-op for choices that ended
    if results is None:
        return Response(status_code=499)  # nobody reads it
    errors = [r for r in results if "error" in r]
    if errors:
        return _error(500, errors[0]["error"], "server_error", code="round_failed")
    body = response_body(params, new_response_id(params.kind), state.config.model_name,
                         [r["choice"] for r in results], usage(prompts.tokens, sum(r["tokens"] for r in results)),
                         [r["extension"] for r in results])
    return JSONResponse(body)


async def _collect(state: ServerState, params: GenerationParams, choice: Choice, echo: Echo | None) -> dict:
    text, logprobs = ChoiceText(state.engine.tokenizer, params.stop), ChoiceLogprobs(state.engine.tokenizer)
    decoded = [] if echo is None else echo.start(logprobs)
    while True:
        event = await choice.events.get()
        if event.error is not None:
            return {"error": event.error}
        text.token_ids += event.token_ids
        decoded += logprobs.add(event.logprobs)
        if event.output is not None:
            output = event.output
            body = None if params.logprobs is None else logprobs_body(params.kind, decoded)
            prefix = "" if echo is None else echo.text
            return {"choice": {"index": choice.index, "text": prefix + text.finish(), "logprobs": body,
                               "finish_reason": finish_reason_name(output.finish_reason)},
                    "tokens": len(output.output_ids), "extension": _extension(choice.index, output)}


def _extension(index: int, output) -> dict:
    """The ``kvspec`` field of a choice: speculation and latency figures, and the output token ids."""
    metrics = output.metrics
    return {"index": index, "tau": metrics.tau, "acceptance_rate": metrics.acceptance_rate,
            "ttft_s": metrics.ttft, "cached_prompt_tokens": metrics.cached_prompt_tokens,
            "preemptions": metrics.num_preemptions, "token_ids": list(output.output_ids)}


async def _start_stream(state: ServerState, params: GenerationParams, prompts: Prompts, choices: list[Choice],
                        request: HttpRequest) -> Response:
    """Wait for the first choice's first event before sending the status line, so that a round failing
    before the first token is still a 500."""
    first = await _unless_disconnected(choices[0].events.get(), request)
    if first is None or first.error is not None:
        state.worker.cancel(choices)
        if first is None:
            return Response(status_code=499)
        return _error(500, first.error, "server_error", code="round_failed")
    return StreamingResponse(_stream(state, params, prompts, choices, first), media_type="text/event-stream")


async def _stream(state: ServerState, params: GenerationParams, prompts: Prompts, choices: list[Choice], first):
    """Server-sent events: (with ``echo``) a chunk per choice with the prompt, one chunk per choice per round with
    new text, a last chunk per choice with its finish reason, the usage chunk if asked, then ``[DONE]``. A
    client that goes away cancels the choices."""
    response_id, model = new_response_id(params.kind), state.config.model_name
    merged: asyncio.Queue = asyncio.Queue()
    merged.put_nowait((choices[0], first))
    pumps = [asyncio.create_task(_pump(choice, merged)) for choice in choices]
    texts = [ChoiceText(state.engine.tokenizer, params.stop) for _ in choices]
    logprobs = [ChoiceLogprobs(state.engine.tokenizer) for _ in choices]
    completion_tokens, streamed, open_choices = 0, 0, len(choices)
    so_far = lambda: usage(prompts.tokens, streamed) if params.continuous_usage else None  # noqa: E731

    try:
        for body in _opening_chunks(params, prompts, choices, logprobs, (response_id, model), so_far):
            yield sse(body)
        while open_choices:
            choice, event = await merged.get()
            if event.error is not None:
                yield sse(error_body(event.error, "server_error", code="round_failed"))
                return
            delta = texts[choice.index].add(event.token_ids)
            decoded = logprobs[choice.index].add(event.logprobs)
            streamed += len(event.token_ids)
            if delta or decoded:  # tokens whose text is held back still report their log-probabilities
                yield sse(chunk_body(params, response_id, model, choice.index, delta or None, usage_=so_far(),
                                     logprobs=logprobs_body(params.kind, decoded) if decoded else None))
            if event.output is not None:
                open_choices -= 1
                completion_tokens += len(event.output.output_ids)
                yield sse(chunk_body(params, response_id, model, choice.index, texts[choice.index].finish() or None,
                                     finish_reason_name(event.output.finish_reason), usage_=so_far(),
                                     extension=_extension(choice.index, event.output)))
        if params.include_usage:
            yield sse(usage_chunk(params, response_id, model, usage(prompts.tokens, completion_tokens)))
        yield sse("[DONE]")
    finally:
        state.worker.cancel(choices)  # a disconnect lands here too (the response task is cancelled)
        for pump in pumps:
            pump.cancel()


def _opening_chunks(params: GenerationParams, prompts: Prompts, choices: list[Choice], logprobs: list, ids: tuple,
                    so_far):
    """A stream's first chunk bodies: the chat role per choice, then (``echo``) each choice's prompt text.
    ``ids``: (response id, model name)."""
    if params.kind == "chat":
        for choice in choices:
            yield chunk_body(params, *ids, choice.index, None, first=True, usage_=so_far())
    for choice in choices if prompts.echoes is not None else ():
        echo = prompts.echo(choice.index)
        decoded = echo.start(logprobs[choice.index])
        yield chunk_body(params, *ids, choice.index, echo.text, usage_=so_far(),
                         logprobs=logprobs_body(params.kind, decoded) if params.logprobs is not None else None)


async def _pump(choice: Choice, merged: asyncio.Queue) -> None:
    while True:
        merged.put_nowait((choice, await choice.events.get()))


# ---- running it ------------------------------------------------------------------------------------------------
class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also marks the app as draining on the first exit signal (new requests get 503;
    uvicorn closes the listening socket and waits for the responses in flight)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame) -> None:
        if not self._state.draining:
            self._state.draining = True
            logger.info("Draining: %d request(s) in flight; new ones are refused.", self._state.worker.open_choices)
        super().handle_exit(sig, frame)


def run_server(engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> None:
    """Serve until SIGTERM / SIGINT. The first signal drains: the listening socket closes (new connections are
    refused), requests on open connections get 503, running ones finish (at most ``drain_timeout_s``), then the
    process exits with status 0."""
    app = create_app(engine, config)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=config.drain_timeout_s)
    server = DrainingServer(uv_config, app.state.server)
    previous = signal.signal(signal.SIGTERM, _exit_normally)  # uvicorn re-raises the signal after its drain
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_normally(signum, frame) -> None:
    raise SystemExit(0)
