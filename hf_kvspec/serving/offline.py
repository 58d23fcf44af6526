"""Offline batches from JSON Lines: read requests, run them through an ``Engine``, write one result per line.

Boundary: the file format and the loop that drains the engine; ``hf-kvspec batch`` (``cli.py``) only parses
arguments and calls ``check_paths`` / ``read_requests`` / ``finished_ids`` / ``run_requests``.

Nothing finished is ever lost: every line is checked before the model loads (all problems reported at once,
each with its line number), every request is checked by ``Engine.add_request`` before the first round, and each
result is appended to the output file (and flushed) as soon as its request finishes — so an interrupted run keeps
what finished, and ``resume`` (``--resume``) runs only the lines whose ids the output does not hold yet.

Input, one JSON object per line, exactly one of:
    {"prompt": "text"}                       a user turn (rendered with the chat template unless chat=False)
    {"messages": [{"role": ..., "content": ...}, ...]}
    {"input_ids": [1, 2, 3]}
and optionally "id" (echoed back; default: the line number), "max_new_tokens", "temperature" (0 = greedy),
"top_p", "top_k", "seed", "stop" (a string or a list), "salt" — each overriding the run's default.
Output, one JSON object per input line, in the order the requests finish: "id", "output" (text), "output_ids",
"finish_reason", "prompt_tokens", "cached_prompt_tokens", "ttft_s", "time_per_output_token_s", "preemptions", "tau",
"acceptance_rate" (None without an assistant); a request that failed on its own (``FinishReason.ERROR``) has
"finish_reason": "error" and "error".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from .engine import Engine
from .prompts import make_settings
from .request import FinishReason

_PROMPT_KEYS = ("prompt", "messages", "input_ids")
_SETTING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "salt")
MAX_REPORTED = 20  # problems listed in one error


def check_paths(prompts: str | Path, out: str | Path, resume: bool) -> None:
    """Before anything loads: the prompts file is readable, ``out`` is not the prompts file, its directory exists,
    and an existing ``out`` is only continued with ``resume`` (never overwritten)."""
    prompts, out = Path(prompts), Path(out)
    if not prompts.is_file():
        raise ValueError(f"{prompts}: no such prompts file.")
    if out.exists() and out.resolve() == prompts.resolve():
        raise ValueError(f"--out {out} is the prompts file itself; writing results there would destroy the input.")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: directory {out.parent} does not exist; create it first.")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file path.")
    if out.exists() and not resume:
        raise ValueError(f"--out {out} exists; pass --resume to run only the lines it does not hold yet, or remove "
                         "it.")


def read_requests(path: str | Path, defaults: dict | None = None) -> list[dict]:
    """The requests of a JSON Lines file (blank lines skipped), each checked — one prompt field, known fields,
    settings of the right type and range (with ``defaults`` filled in) — and ids unique. Every bad line is
    reported, with its number, in one ``ValueError``."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the prompts file ({err}).") from None
    requests, problems, seen = [], [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _check_line(line, number, defaults or {})
            if record["id"] in seen:
                raise ValueError(f"id {record['id']!r} is also line {seen[record['id']]}'s; ids must be unique.")
            seen[record["id"]] = number
            requests.append(record)
        except ValueError as err:
            problems.append(f"{path}:{number}: {err}")
    _raise_problems(problems, "line")
    return requests


def _raise_problems(problems: list[str], what: str) -> None:
    if problems:
        more = f"\n... and {len(problems) - MAX_REPORTED} more bad {what}s" if len(problems) > MAX_REPORTED else ""
        raise ValueError("\n".join(problems[:MAX_REPORTED]) + more)


def _check_line(line: str, number: int, defaults: dict) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg}).") from None
    given = [key for key in _PROMPT_KEYS if key in record] if isinstance(record, dict) else []
    if len(given) != 1:
        raise ValueError(f"each line needs exactly one of {', '.join(_PROMPT_KEYS)}.")
    unknown = sorted(set(record) - {*_PROMPT_KEYS, *_SETTING_KEYS, "id"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; known: {[*_SETTING_KEYS, 'id']}.")
    record = {"id": number, **record}
    _check_prompt(given[0], record[given[0]])
    if isinstance(record["id"], bool) or not isinstance(record["id"], (int, str)):
        raise ValueError(f'"id" must be a string or an integer, got {json.dumps(record["id"])}.')
    make_settings(None, **_settings(record, defaults))  # the engine's own checks, naming the field
    return record


def _check_prompt(key: str, value) -> None:
    if key == "prompt":
        ok = isinstance(value, str) and value != ""
    elif key == "messages":
        ok = isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    else:
        ok = isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    if not ok:
        expected = {"prompt": "a non-empty string", "messages": "a non-empty list of {role, content} strings",
                    "input_ids": "a non-empty list of non-negative integers"}[key]
        raise ValueError(f'"{key}" must be {expected}.')


def _settings(record: dict, defaults: dict) -> dict:
    """``Engine.add_request`` keywords of a line (its prompt and salt aside)."""
    settings = {**defaults, **{k: record[k] for k in _SETTING_KEYS if k in record}}
    settings.pop("salt", None)
    temperature = settings.pop("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f'"temperature" must be a finite number >= 0 (0 = greedy), got {json.dumps(temperature)}.')
    stop = settings.pop("stop", None)
    if stop is not None and not ((isinstance(stop, str) and stop) or (isinstance(stop, list) and all(
            isinstance(s, str) and s for s in stop))):
        raise ValueError(f'"stop" must be a non-empty string or a list of them, got {json.dumps(stop)}.')
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return {**settings, **sampling, "stop_strings": stop}


def _add(engine: Engine, record: dict, defaults: dict, chat: bool) -> int:
    if "prompt" in record:
        prompt = [{"role": "user", "content": record["prompt"]}] if chat else record["prompt"]
    else:
        prompt = record.get("messages", record.get("input_ids"))
    return engine.add_request(prompt, salt=record.get("salt"), **_settings(record, defaults))


def finished_ids(path: str | Path) -> set:
    """Ids of the results already in an output file, for ``--resume``. A last line cut short by an interrupted
    write is removed from the file (its request runs again); a bad line before it is an error."""
    path = Path(path)
    if not path.exists():
        return set()
    lines = path.read_text().splitlines(keepends=True)
    done, kept = set(), []
    for number, line in enumerate(lines, start=1):
        try:
            if line.strip():
                done.add(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a result line; --resume continues only files that "
                                 "hf-kvspec batch wrote.") from None
            break  # a half-written last line: dropped, its request runs again
        kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        path.write_text("".join(kept))
    return done


def run_requests(engine: Engine, requests: list[dict], defaults: dict | None = None, chat: bool = True,
                 progress_bar: bool = True, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every request to completion; returns the results in the order they finished, handing each to
    ``on_result`` as soon as it is there. Every request is added (checked) before any round runs: a refused one
    raises ``ValueError`` naming its line, with nothing run."""
    from tqdm.auto import tqdm

    ids, problems = {}, []
    for record in requests:
        try:
            ids[_add(engine, record, defaults or {}, chat)] = record["id"]
        except ValueError as err:
            problems.append(f"line with id {record['id']!r}: {err}")
    if problems:
        for request_id in ids:
            engine.cancel(request_id)
        engine.step()
        _raise_problems(problems, "request")
    results = []
    with tqdm(total=len(ids), disable=not progress_bar, desc="hf-kvspec batch") as bar:
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.finished and delta.request_id in ids:
                    results.append(_result(engine, delta.request_id, ids[delta.request_id]))
                    if on_result is not None:
                        on_result(results[-1])
                    bar.update(1)
    return results


def _result(engine: Engine, request_id: int, user_id) -> dict:
    out = engine.get_output(request_id)
    result = {
        "id": user_id, "output": out.text, "output_ids": out.output_ids,
        "finish_reason": out.finish_reason.value if out.finish_reason else None,
        "prompt_tokens": len(out.prompt_ids), "cached_prompt_tokens": out.metrics.cached_prompt_tokens,
        "ttft_s": out.metrics.ttft, "time_per_output_token_s": out.metrics.time_per_output_token,
        "preemptions": out.metrics.num_preemptions, "tau": out.metrics.tau,
        "acceptance_rate": out.metrics.acceptance_rate,
    }
    return {**result, "error": out.error} if out.finish_reason is FinishReason.ERROR else result


class ResultWriter:
    """Appends each result to a JSON Lines file as one line, flushed at once (a crash or Ctrl-C keeps every
    finished result)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.count = 0

    def __enter__(self) -> ResultWriter:
        self._file = self.path.open("a")
        return self

    def __call__(self, result: dict) -> None:
        self._file.write(json.dumps(result) + "\n")
        self._file.flush()
        self.count += 1

    def __exit__(self, *exc) -> None:
        self._file.close()


def write_results(path: str | Path, results: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(result) + "\n" for result in results))
