"""A tiny OpenAI-compatible chat server for the tests of ``benchmark.py serve`` (Starlette + uvicorn, no model).

    python tests/scripts/fake_openai_server.py --port N [--delay 0.01] [--prefix ""]

``POST /v1/chat/completions`` (streamed) answers the last message's words in order, prefixed by ``--prefix`` words,
one word (= one token) per chunk, ``--delay`` seconds apart, capped at ``max_tokens``; a usage chunk when asked.
Prompts steer it: one containing ``nousage`` gets no usage chunk, ``fail`` a 400, ``streamfail`` an error event
after its first chunk. ``GET /stats`` returns the most requests it ever had in flight at once; ``GET /health``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def make_app(delay: float = 0.01, prefix: str = "") -> Starlette:
    state = {"in_flight": 0, "max_in_flight": 0, "requests": 0}

    async def health(_request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def stats(_request: Request) -> JSONResponse:
        return JSONResponse(state)

    async def chat(request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        if "fail" in prompt.split():
            return JSONResponse({"error": {"message": "refused", "type": "invalid_request_error"}}, status_code=400)
        words = (prefix.split() + prompt.split())[:body.get("max_tokens", 16)]
        usage = (body.get("stream_options") or {}).get("include_usage") and "nousage" not in prompt

        async def events():
            state["in_flight"] += 1
            state["requests"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i, word in enumerate(words):
                    await asyncio.sleep(delay)
                    yield _event({"choices": [{"index": 0, "delta": {"content": (" " if i else "") + word}}]})
                    if "streamfail" in prompt:
                        yield _event({"error": {"message": "round failed", "type": "server_error"}})
                        return
                yield _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
                if usage:
                    yield _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(words)}})
                yield b"data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/stats", stats),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.01)
    parser.add_argument("--prefix", default="")
    args = parser.parse_args()
    uvicorn.run(make_app(args.delay, args.prefix), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
