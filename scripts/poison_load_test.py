"""Poisoned load: one bad request never fails another (issue 40). Honest streaming clients beside poisoned
requests — token ids outside the vocabulary and underflowing temperatures over HTTP, logits processors that raise
sent through the Python API (``Engine.add_request`` from another thread, beside the server's own loop) — against
``hf-kvspec serve``'s app run in this process on loopback.

Checks: every honest request completes with output equal to its own ``generate(do_sample=False)``; every
poisoned one gets its own outcome (400 naming ``prompt`` for bad ids, a greedy 200 equal to ``generate`` for an
underflowing temperature, finish reason ``error`` for a raising processor); no other failure; the KV block pool
back to full. Exit status 1 if a check fails.

    python scripts/poison_load_test.py --honest 32 --poison-fraction 0.1 --max-tokens 8 \\
        --out benchmarks/results/poison_load_test.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load_test, when run as a script

POISONS = ("bad_ids", "underflowing_temperature", "raising_processor")


class Poison(RuntimeError):
    """What the poisoned logits processors raise."""


def raising_processor(input_ids, scores):
    raise Poison("a poisoned logits processor")


def start_server(engine):
    """``create_app(engine)`` under uvicorn on a free loopback port, in a daemon thread; returns (server, url)."""
    import uvicorn

    from hf_kvspec.serving.server import ServerConfig, create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig(model_name="served")),
                                           log_level="warning", lifespan="on"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def honest(client, prompt: str, max_tokens: int) -> dict:
    from load_test import one_request

    outcome = await one_request(client, prompt, max_tokens, stream=True, disconnect_after=0)
    return {"kind": "honest", "prompt": prompt, "status": outcome.status, "token_ids": outcome.token_ids,
            "error": outcome.error}


async def bad_ids(client, vocab_size: int) -> dict:
    import openai

    try:
        await client.completions.create(model="served", prompt=[5, vocab_size + 7], max_tokens=4)
    except openai.BadRequestError as err:
        return {"kind": "bad_ids", "status": 400, "param": err.body.get("param") if err.body else None}
    return {"kind": "bad_ids", "status": 200, "param": None}


async def underflowing(client, prompt: str, max_tokens: int) -> dict:
    response = await client.chat.completions.create(model="served", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=1e-40)
    return {"kind": "underflowing_temperature", "prompt": prompt, "status": 200,
            "token_ids": response.kvspec["choices"][0]["token_ids"]}


def python_api_poison(engine, prompt_ids: list[int], max_tokens: int) -> dict:
    """A raising processor through ``Engine.add_request``, while the server's worker steps the same engine."""
    request_id = engine.add_request(prompt_ids, max_new_tokens=max_tokens, logits_processor=[raising_processor])
    while not (output := engine.get_output(request_id, forget=False)).finish_reason:
        time.sleep(0.01)
    engine.get_output(request_id)  # forget its record
    return {"kind": "raising_processor", "finish_reason": output.finish_reason.value, "error": output.error}


def plan(honest_count: int, fraction: float) -> list[str]:
    """Kinds of the poisoned requests: ``fraction`` of all requests, cycling through ``POISONS``."""
    count = max(len(POISONS), math.ceil(honest_count * fraction / (1 - fraction) - 1e-9))  # 1e-9: float noise
    return [POISONS[i % len(POISONS)] for i in range(count)]


async def run_load(engine, url: str, prompts: list[str], args) -> list[dict]:
    import openai

    from hf_kvspec.serving.prompts import prompt_ids

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=args.max_seconds)
    tasks = [honest(client, prompts[i % len(prompts)], args.max_tokens) for i in range(args.honest)]
    for i, kind in enumerate(plan(args.honest, args.poison_fraction)):
        prompt = prompts[i % len(prompts)]
        if kind == "bad_ids":
            tasks.insert(2 * i + 1, bad_ids(client, engine.vocab_size))
        elif kind == "underflowing_temperature":
            tasks.insert(2 * i + 1, underflowing(client, prompt, args.max_tokens))
        else:
            ids = prompt_ids([{"role": "user", "content": prompt}], engine.tokenizer)
            tasks.insert(2 * i + 1, asyncio.to_thread(python_api_poison, engine, ids, args.max_tokens))
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.max_seconds)
    finally:
        await client.close()


def references(model, tokenizer, results: list[dict], max_tokens: int) -> dict[str, list[int]]:
    """Each distinct prompt's own ``generate(do_sample=False)`` on its chat-template ids."""
    import torch

    from hf_kvspec.serving.prompts import prompt_ids

    expected = {}
    for prompt in {r["prompt"] for r in results if "prompt" in r}:
        ids = prompt_ids([{"role": "user", "content": prompt}], tokenizer)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_tokens)
        expected[prompt] = out[0, len(ids):].tolist()
    return expected


def wait_pool_full(engine, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished():
            return engine.cache.num_free_blocks() == engine.cache.num_total_blocks()
        time.sleep(0.05)
    return False


def summarise(results: list[dict], expected: dict, pool_full: bool, seconds: float) -> dict:
    honest_ = [r for r in results if r["kind"] == "honest"]
    by_kind = {kind: [r for r in results if r["kind"] == kind] for kind in POISONS}
    return {
        "honest": len(honest_), "honest_completed": sum(r["status"] == 200 and r["token_ids"] is not None
                                                        for r in honest_),
        "honest_mismatches": sum(r["token_ids"] != expected[r["prompt"]] for r in honest_),
        "poisoned": sum(map(len, by_kind.values())),
        "bad_ids_400_naming_prompt": sum(r["status"] == 400 and r["param"] == "prompt" for r in by_kind["bad_ids"]),
        "bad_ids": len(by_kind["bad_ids"]),
        "underflowing_greedy_exact": sum(r["token_ids"] == expected[r["prompt"]]
                                         for r in by_kind["underflowing_temperature"]),
        "underflowing": len(by_kind["underflowing_temperature"]),
        "raising_processor_errors": sum(r["finish_reason"] == "error" and "Poison" in (r["error"] or "")
                                        for r in by_kind["raising_processor"]),
        "raising_processor": len(by_kind["raising_processor"]),
        "other_failures": sum(r["status"] != 200 for r in honest_), "pool_back_to_full": pool_full,
        "seconds": round(seconds, 2), "errors": sorted({r.get("error") or "" for r in honest_} - {""})[:5],
    }


def passed(summary: dict) -> bool:
    return (summary["honest_completed"] == summary["honest"] and summary["honest_mismatches"] == 0
            and summary["bad_ids_400_naming_prompt"] == summary["bad_ids"]
            and summary["underflowing_greedy_exact"] == summary["underflowing"]
            and summary["raising_processor_errors"] == summary["raising_processor"]
            and summary["other_failures"] == 0 and summary["pool_back_to_full"])


def run(engine, model, prompts: list[str], args) -> dict:
    """The whole test against ``engine`` (built with ``model`` and a tokenizer); returns the summary."""
    server, url = start_server(engine)
    started = time.perf_counter()
    try:
        results = asyncio.run(run_load(engine, url, prompts, args))
        seconds = time.perf_counter() - started
        pool_full = wait_pool_full(engine)
    finally:
        server.should_exit = True
    return summarise(results, references(model, engine.tokenizer, results, args.max_tokens), pool_full, seconds)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--honest", type=int, default=32, help="honest streaming clients (one request each)")
    parser.add_argument("--poison-fraction", type=float, default=0.1, help="share of all requests poisoned")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--kv-budget", default="64MB")
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the summary JSON here")
    args = parser.parse_args(argv)
    if args.honest < 1 or not 0 < args.poison_fraction < 1 or args.max_tokens < 1:
        parser.error("--honest and --max-tokens must be >= 1 and --poison-fraction in (0, 1).")
    return args


def main(argv=None) -> int:
    import torch
    from load_test import default_prompts

    from hf_kvspec.models import load_bundled_model
    from hf_kvspec.serving.engine import Engine

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_bundled_model()
    engine = Engine(model, tokenizer, kv_budget=args.kv_budget, max_running=args.max_running)
    summary = run(engine, model, default_prompts(), args)
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
