"""Offline batches from JSON Lines: read requests, run them through an ``Engine``, write one result per line.

Boundary: the file format and the loop that drains the engine; ``hf-kvspec batch`` (``cli.py``) only parses
arguments and calls ``read_requests`` / ``run_requests`` / ``write_results``.

Input, one JSON object per line, exactly one of:
    {"prompt": "text"}                       a user turn (rendered with the chat template unless chat=False)
    {"messages": [{"role": ..., "content": ...}, ...]}
    {"input_ids": [1, 2, 3]}
and optionally "id" (echoed back; default: the line number), "max_new_tokens", "temperature" (0 = greedy),
"top_p", "top_k", "seed", "stop" (a string or a list), "salt" — each overriding the run's default.
Output, one JSON object per input line and in the same order: "id", "output" (text), "output_ids",
"finish_reason", "prompt_tokens", "cached_prompt_tokens", "ttft_s", "time_per_output_token_s", "preemptions", "tau",
"acceptance_rate" (None without an assistant).
"""

from __future__ import annotations

import json
from pathlib import Path

from .engine import Engine

_PROMPT_KEYS = ("prompt", "messages", "input_ids")
_SETTING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "salt")


def read_requests(path: str | Path) -> list[dict]:
    """The requests of a JSON Lines file (blank lines skipped), each checked for one prompt field."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}).") from None
        given = [key for key in _PROMPT_KEYS if key in record] if isinstance(record, dict) else []
        if len(given) != 1:
            raise ValueError(f"{path}:{number}: each line needs exactly one of {', '.join(_PROMPT_KEYS)}.")
        unknown = sorted(set(record) - {*_PROMPT_KEYS, *_SETTING_KEYS, "id"})
        if unknown:
            raise ValueError(f"{path}:{number}: unknown field(s) {unknown}; known: {[*_SETTING_KEYS, 'id']}.")
        requests.append({"id": number, **record})
    return requests


def _add(engine: Engine, record: dict, defaults: dict, chat: bool) -> int:
    settings = {**defaults, **{k: record[k] for k in _SETTING_KEYS if k in record}}
    temperature = settings.pop("temperature", 0.0)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    stop = settings.pop("stop", None)
    if "prompt" in record:
        prompt = [{"role": "user", "content": record["prompt"]}] if chat else record["prompt"]
    else:
        prompt = record.get("messages", record.get("input_ids"))
    return engine.add_request(prompt, stop_strings=stop, **sampling, **settings)


def run_requests(engine: Engine, requests: list[dict], defaults: dict | None = None, chat: bool = True,
                 progress_bar: bool = True) -> list[dict]:
    """Run every request to completion; results in input order (every request is checked before any runs)."""
    from tqdm.auto import tqdm

    ids = [_add(engine, record, defaults or {}, chat) for record in requests]
    pending = set(ids)
    with tqdm(total=len(ids), disable=not progress_bar, desc="hf-kvspec batch") as bar:
        while pending:
            done = [d.request_id for d in engine.step() if d.finished and d.request_id in pending]
            pending.difference_update(done)
            bar.update(len(done))
    return [_result(engine, request_id, record["id"]) for request_id, record in zip(ids, requests)]


def _result(engine: Engine, request_id: int, user_id) -> dict:
    out = engine.get_output(request_id)
    return {
        "id": user_id, "output": out.text, "output_ids": out.output_ids,
        "finish_reason": out.finish_reason.value if out.finish_reason else None,
        "prompt_tokens": len(out.prompt_ids), "cached_prompt_tokens": out.metrics.cached_prompt_tokens,
        "ttft_s": out.metrics.ttft, "time_per_output_token_s": out.metrics.time_per_output_token,
        "preemptions": out.metrics.num_preemptions, "tau": out.metrics.tau,
        "acceptance_rate": out.metrics.acceptance_rate,
    }


def write_results(path: str | Path, results: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(result) + "\n" for result in results))
