"""Load test for ``hf-kvspec serve``: many concurrent clients over loopback, some of which disconnect
mid-stream; reports p50/p99 time to first token and tokens/s, and checks zero 5xx, greedy outputs equal to an
isolated ``generate()`` (with ``--reference``), and the KV block pool back to full at the end.

Run (the server in one shell, the load in another):

    hf-kvspec serve --bundled --port 8000
    python scripts/load_test.py --base-url http://127.0.0.1:8000/v1 --requests 200 --concurrency 32 \\
        --disconnect-fraction 0.1 --max-tokens 64 --reference bundled

Bounded: ``--requests`` requests, at most ``--max-seconds`` of wall time (requests still running then are
abandoned and counted). Loopback only: any other host is refused. Every request is greedy (``temperature 0``);
half are streamed, half not; a disconnecting client streams, reads one to three chunks, and hangs up. Time to
first token is measured by the client, on the streamed requests that completed.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TOPICS = ["a KV cache", "speculative decoding", "paged attention", "the French revolution", "photosynthesis",
          "a binary search", "the moon landing", "compound interest", "a hash table", "volcanoes", "jazz",
          "the water cycle", "prime numbers", "a sourdough starter", "plate tectonics", "the TCP handshake"]
ASKS = ["Explain {} in two sentences.", "Write a short poem about {}.", "List three facts about {}.",
        "What is the most common misconception about {}?", "Describe {} to a ten-year-old."]


@dataclass
class Outcome:
    status: int = 200
    disconnected: bool = False
    ttft: float | None = None
    tokens: int = 0
    token_ids: list[int] | None = None
    prompt: str = ""
    error: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    abandoned: int = 0


def default_prompts() -> list[str]:
    return [ask.format(topic) for topic in TOPICS for ask in ASKS]


async def one_request(client, prompt: str, max_tokens: int, stream: bool, disconnect_after: int) -> Outcome:
    import openai

    outcome, started = Outcome(prompt=prompt), time.perf_counter()
    messages = [{"role": "user", "content": prompt}]
    try:
        if not stream:
            response = await client.chat.completions.create(model="served", messages=messages, max_tokens=max_tokens,
                                                            temperature=0)
            outcome.token_ids = response.kvspec["choices"][0]["token_ids"]
            outcome.tokens = response.usage.completion_tokens
            return outcome
        chunks = await client.chat.completions.create(model="served", messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True)
        seen = 0
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content and outcome.ttft is None:
                outcome.ttft = time.perf_counter() - started
            seen += 1
            extension = getattr(chunk, "kvspec", None)
            if extension:
                outcome.token_ids = extension["token_ids"]
                outcome.tokens = len(outcome.token_ids)
            if disconnect_after and seen >= disconnect_after:
                await chunks.close()
                outcome.disconnected = True
                break
    except openai.APIStatusError as err:
        outcome.status, outcome.error = err.status_code, str(err)[:200]
    except openai.APIConnectionError as err:
        outcome.status, outcome.error = 0, str(err)[:200]
    except openai.APIError as err:  # an error event inside a stream: the server failed it after the first chunk
        outcome.status, outcome.error = 500, str(err)[:200]
    return outcome


async def run_load(args, prompts: list[str]) -> Report:
    import openai

    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=args.max_seconds)
    gate, report, started = asyncio.Semaphore(args.concurrency), Report(), time.perf_counter()
    plans = [(rng.choice(prompts), rng.random() < 0.5, rng.randint(1, 3) if rng.random() < args.disconnect_fraction
              else 0) for _ in range(args.requests)]

    async def limited(plan):
        async with gate:
            prompt, stream, disconnect_after = plan
            return await one_request(client, prompt, args.max_tokens, stream or disconnect_after > 0, disconnect_after)

    tasks = [asyncio.create_task(limited(plan)) for plan in plans]
    done, pending = await asyncio.wait(tasks, timeout=args.max_seconds)
    for task in pending:
        task.cancel()
    report.outcomes = [task.result() for task in done]
    report.abandoned = len(pending)
    report.seconds = time.perf_counter() - started
    await client.close()
    return report


def metrics(base_url: str) -> dict[str, float]:
    root = base_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def pool_back_to_full(base_url: str, timeout: float = 30.0) -> bool:
    """Wait (bounded) until nothing runs or waits, then check no KV block is in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sample = metrics(base_url)
        if sample["kvspec_requests_running"] == 0 and sample["kvspec_requests_waiting"] == 0:
            return sample["kvspec_kv_blocks_used"] == 0
        time.sleep(0.2)
    return False


def greedy_mismatches(outcomes: list[Outcome], reference: str, max_tokens: int) -> int:
    """Completed responses whose token ids differ from ``generate(do_sample=False)`` on the prompt alone."""
    import torch

    from hf_kvspec.serving.prompts import prompt_ids

    if reference == "bundled" or reference.startswith("bundled:"):
        from hf_kvspec.models import DEFAULT_MODEL, load_bundled_model

        model, tokenizer = load_bundled_model(reference.partition(":")[2] or DEFAULT_MODEL)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(reference).eval(), AutoTokenizer.from_pretrained(reference)
    expected: dict[str, list[int]] = {}
    mismatches = 0
    for outcome in outcomes:
        if outcome.token_ids is None:
            continue
        if outcome.prompt not in expected:
            ids = prompt_ids([{"role": "user", "content": outcome.prompt}], tokenizer)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens)
            expected[outcome.prompt] = out[0, len(ids):].tolist()
        mismatches += outcome.token_ids != expected[outcome.prompt]
    return mismatches


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(report: Report, args, mismatches: int | None, pool_full: bool) -> dict:
    completed = [o for o in report.outcomes if o.status == 200 and not o.disconnected]
    ttfts = [o.ttft for o in completed if o.ttft is not None]
    tokens = sum(o.tokens for o in completed)
    return {
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "completed": len(completed), "disconnected": sum(o.disconnected for o in report.outcomes),
        "abandoned": report.abandoned, "status_5xx": sum(o.status >= 500 for o in report.outcomes),
        "status_4xx": sum(400 <= o.status < 500 for o in report.outcomes),
        "connection_errors": sum(o.status == 0 for o in report.outcomes),
        "seconds": round(report.seconds, 2), "output_tokens": tokens,
        "tokens_per_s": round(tokens / report.seconds, 2) if report.seconds else None,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "greedy_mismatches": mismatches, "pool_back_to_full": pool_full,
        "errors": sorted({o.error for o in report.outcomes if o.error})[:5],
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="wall-time bound of the whole load")
    parser.add_argument("--prompts", default=None, help="a JSON list of prompt strings (default: built-in)")
    parser.add_argument("--reference", default=None,
                        help="check greedy outputs against generate() on this model: 'bundled[:NAME]' or a path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the summary JSON here")
    args = parser.parse_args(argv)
    if urlparse(args.base_url).hostname not in LOOPBACK:
        parser.error(f"--base-url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {args.base_url!r}.")
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if not 0 <= args.disconnect_fraction <= 1 or not args.max_seconds > 0:
        parser.error("--disconnect-fraction must be in [0, 1] and --max-seconds positive.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = default_prompts() if args.prompts is None else json.loads(Path(args.prompts).read_text())
    report = asyncio.run(run_load(args, prompts))
    pool_full = pool_back_to_full(args.base_url)
    mismatches = None if args.reference is None else greedy_mismatches(report.outcomes, args.reference,
                                                                       args.max_tokens)
    summary = summarise(report, args, mismatches, pool_full)
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=2)
    ok = summary["status_5xx"] == 0 and not mismatches and pool_full and not report.abandoned
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
