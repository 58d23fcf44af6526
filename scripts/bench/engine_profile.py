"""Where an engine round goes, beside a plain ``generate`` step on the same model (issue: the engine round at one
request against the fast step).

    python scripts/benchmark.py engine --profile-rounds 1,4,16 [--num-requests 16] [--max-new-tokens 64]

Per concurrency C (C chat requests decoding together, greedy, one torch thread, rounds held as a serving loop holds
them), the mean milliseconds per decode round of: scheduling (``Scheduler.schedule``, block reservations), the
packed forward (``ForwardRunner.forward_with_features``: input packing, the cache's layout, the program over packed
weights, ragged attention), choosing tokens (sampling or acceptance, everything else in ``_forward_and_choose``),
committing (K/V kept, stop checks, requests advanced) and the rest of ``step`` (telemetry, Python). Beside it, a
plain ``generate`` step of one request on the same forward (``speculative_generate`` without an assistant, its
per-token time at the same output length). Results: ``benchmarks/results/<out-name>.profile.{json,md}``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from bench.harness import Report, load_average

COLUMNS = ["concurrency", "rounds", "schedule_ms", "forward_ms", "choose_ms", "commit_ms", "other_ms", "round_ms",
           "per_token_ms", "generate_step_ms", "round_vs_step", "load_before", "load_after"]


class _Timed:
    """Wraps an engine's (or its parts') methods with wall-clock accumulators; restored by ``undo``."""

    def __init__(self):
        self.seconds, self.undo_list = defaultdict(float), []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started

        setattr(owner, name, timed)
        self.undo_list.append((owner, name))

    def undo(self) -> None:
        for owner, name in reversed(self.undo_list):
            delattr(owner, name)  # the instance attribute goes; the class's method shows through again


def profile_engine(model, tokenizer, prompts, concurrency: int, max_new_tokens: int) -> dict:
    from hf_kvspec import Engine

    engine = Engine(model, tokenizer, max_running=concurrency, max_tokens_per_round=256)
    for prompt in prompts[:2]:  # first-call costs
        engine.add_request(prompt, max_new_tokens=4)
    while engine.has_unfinished():
        engine.step()
    for prompt in prompts[:concurrency]:
        engine.add_request(prompt, max_new_tokens=max_new_tokens)
    with engine.hold_rounds():
        while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill first: the profile is of decode rounds
        timed = _Timed()
        timed.wrap(engine.scheduler, "schedule", "schedule")
        timed.wrap(engine.runner, "forward_with_features", "forward")
        timed.wrap(engine, "_forward_and_choose", "forward_and_choose")
        timed.wrap(engine, "_commit", "commit")
        rounds, tokens, started = 0, 0, time.perf_counter()
        try:
            while engine.has_unfinished():
                tokens += sum(len(d.new_token_ids) for d in engine.step())
                rounds += 1
        finally:
            timed.undo()
        total = time.perf_counter() - started
    s = timed.seconds
    parts = {"schedule_ms": s["schedule"], "forward_ms": s["forward"],
             "choose_ms": s["forward_and_choose"] - s["forward"], "commit_ms": s["commit"]}
    row = {key: round(1e3 * value / rounds, 2) for key, value in parts.items()}
    row["other_ms"] = round(1e3 * (total - sum(parts.values())) / rounds, 2)
    row.update(concurrency=concurrency, rounds=rounds, round_ms=round(1e3 * total / rounds, 2),
               per_token_ms=round(1e3 * total / max(tokens, 1), 2))
    return row


def generate_step_ms(model, prompt: list[int], max_new_tokens: int) -> float:
    """Milliseconds per token of plain decoding through ``speculative_generate`` (the fast forward), prefill left
    out (a 1-token call's time subtracted)."""
    import hf_kvspec

    ids = torch.tensor([prompt])

    def call(n: int) -> float:
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       custom_generate=hf_kvspec.speculative_generate)
        return time.perf_counter() - started

    call(4)
    return 1e3 * min(call(max_new_tokens) - call(1) for _ in range(2)) / (max_new_tokens - 1)


def run(args) -> None:
    from bench.engine_load import workload
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    model.eval()
    levels = [int(c) for c in args.profile_rounds.split(",")]
    prompts = workload(tokenizer, "chat", max(max(levels), 2))
    report = Report(f"{args.out_name}.profile", "Where an engine round goes (decode rounds, bundled model, 1 thread)",
                    COLUMNS, settings={k: v for k, v in vars(args).items() if k != "func"})
    step = generate_step_ms(model, prompts[0], args.max_new_tokens)
    for concurrency in levels:
        before = load_average()
        row = profile_engine(model, tokenizer, prompts, concurrency, args.max_new_tokens)
        row.update(generate_step_ms=round(step, 2), round_vs_step=round(row["round_ms"] / step, 3),
                   load_before=round(before, 2), load_after=round(load_average(), 2))
        report.add(**row)
    report.notes += [
        "Mean ms per decode round (prefill excluded). forward: packing, the cache layout and the packed forward; "
        "choose: sampling / acceptance; commit: K/V kept, stop checks; other: the rest of step().",
        "generate_step_ms: plain decoding of one request through speculative_generate on the same fast forward "
        "(per token, prefill subtracted); round_vs_step: an engine round over it.",
    ]
    report.write()
