"""The client of ``benchmark.py serve``: streamed chat completions against any OpenAI-compatible server, in a closed
loop at a given concurrency, and the figures drawn from them.

Boundary: the standard library only (asyncio streams speak HTTP/1.1 themselves: no ``openai``, ``httpx`` or
``aiohttp`` needed, and nothing between the socket and the clock); loopback servers; no server is started here
(``serve_servers.py`` does that).

    closed_loop(url, prompts, concurrency, max_tokens)   C workers, each sending the next prompt when its last
                                                         finished, until every prompt was answered once
    summarise(loop)                                      output tokens/s, TTFT and TPOT p50/p99 (ms)

Per request: TTFT = time from sending the request to the first chunk with text; TPOT = (time of the last text
chunk - time of the first) / (output tokens - 1), as vLLM's own serving benchmark defines it; output tokens =
``usage.completion_tokens`` of the stream's usage chunk (asked for with ``stream_options.include_usage``), or, where
a server sends none, the number of text chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Answer:
    """One streamed request: its text, output tokens, when it was sent and when each text chunk came."""

    index: int
    text: str = ""
    tokens: int = 0
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)


@dataclass
class Loop:
    """One closed loop: the answers in prompt order, its concurrency and its wall seconds."""

    concurrency: int
    answers: list[Answer]
    seconds: float


def chat_body(prompt: str, max_tokens: int, model: str = "served") -> dict:
    """A greedy streamed chat request: the server applies the chat template."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(url: str, body: dict, index: int = 0, timeout: float = 600.0) -> Answer:
    """POST ``body`` to ``url`` (``http://host:port/v1/chat/completions``) and read its server-sent events."""
    answer = Answer(index)
    parsed = urlparse(url)
    if parsed.hostname not in LOOPBACK:
        raise ValueError(f"loopback servers only, got {url!r}")
    payload = json.dumps(body).encode()
    request = (f"POST {parsed.path or '/'} HTTP/1.1\r\nHost: {parsed.netloc}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port or 80)
    except OSError as err:
        answer.error = f"connect: {err}"
        return answer
    try:
        answer.sent = time.perf_counter()
        writer.write(request + payload)
        await writer.drain()
        await asyncio.wait_for(_read_response(reader, answer), timeout)
    except (asyncio.TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as err:
        answer.error = answer.error or f"{type(err).__name__}: {err}"
    finally:
        writer.close()
    return answer


async def _read_response(reader: asyncio.StreamReader, answer: Answer) -> None:
    status_line = (await reader.readline()).decode("latin-1").strip()
    headers = {}
    while (line := (await reader.readline()).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    if status != 200:
        body = await _body(reader, chunked, headers)
        answer.error = f"HTTP {status}: {body[:300].decode(errors='replace')}"
        return
    text_chunks = 0
    usage = None
    pending = b""
    async for piece in _pieces(reader, chunked):
        pending += piece
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    answer.tokens = usage if usage is not None else text_chunks
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    answer.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        answer.chunk_times.append(time.perf_counter())
                        answer.text += content
                        text_chunks += 1
                    if choice.get("finish_reason"):
                        answer.finish_reason = choice["finish_reason"]
    answer.error = "the stream ended without [DONE]"
    answer.tokens = usage if usage is not None else text_chunks


async def _pieces(reader: asyncio.StreamReader, chunked: bool):
    """The response body as it arrives (chunked transfer encoding decoded)."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk


async def _body(reader: asyncio.StreamReader, chunked: bool, headers: dict) -> bytes:
    if "content-length" in headers and not chunked:
        return await reader.readexactly(int(headers["content-length"]))
    return b"".join([piece async for piece in _pieces(reader, chunked)])


async def closed_loop_async(url: str, prompts: list[str], concurrency: int, max_tokens: int, model: str = "served",
                            timeout: float = 600.0) -> Loop:
    """``concurrency`` workers share the prompts in order: each sends the next one when its last answer ended."""
    answers: list[Answer | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def worker() -> None:
        for index in next_index:  # one shared iterator: each index is taken once
            answers[index] = await stream_chat(url, chat_body(prompts[index], max_tokens, model), index, timeout)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Loop(concurrency, answers, time.perf_counter() - start)


def closed_loop(url: str, prompts: list[str], concurrency: int, max_tokens: int, model: str = "served",
                timeout: float = 600.0) -> Loop:
    return asyncio.run(closed_loop_async(url, prompts, concurrency, max_tokens, model, timeout))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile by linear interpolation between order statistics (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def summarise(loop: Loop) -> dict:
    """Output tokens/s over the loop's wall time, and TTFT / TPOT p50 and p99 in ms over its completed answers."""
    done = [a for a in loop.answers if not a.error]
    tokens = sum(a.tokens for a in done)
    ttfts = [a.ttft for a in done if a.ttft is not None]
    tpots = [a.tpot for a in done if a.tpot is not None]
    return {"concurrency": loop.concurrency, "completed": len(done), "errors": len(loop.answers) - len(done),
            "output_tokens": tokens, "seconds": round(loop.seconds, 2),
            "tok_per_s": round(tokens / loop.seconds, 2) if loop.seconds else None,
            "ttft_p50_ms": _ms(percentile(ttfts, 0.5)), "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
            "tpot_p50_ms": _ms(percentile(tpots, 0.5)), "tpot_p99_ms": _ms(percentile(tpots, 0.99))}


def agreement(texts: list[str], reference: list[str]) -> tuple[int, float]:
    """(answers equal to the reference's, the mean share of each reference text reproduced before the first
    differing character)."""
    identical, shares = 0, []
    for text, ref in zip(texts, reference, strict=True):
        identical += text == ref
        common = 0
        for a, b in zip(text, ref):
            if a != b:
                break
            common += 1
        shares.append(common / len(ref) if ref else float(text == ref))
    return identical, (sum(shares) / len(shares) if shares else 1.0)
