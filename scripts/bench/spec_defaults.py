"""Each assistant as a new user builds it (its defaults) against plain ``generate``, with and without the decode
kernels, plus the verify-cost table c_v(T): stock, the decode kernels, and the fast forward the loop runs. Writes
``spec.defaults.{json,md}``.

    python scripts/benchmark.py spec --defaults [--num-prompts 35] [--repeats 3] [--new-tokens 64]

Rows (bs=1 unless ``--batch``): ``plain`` = stock ``generate`` (the baseline of every ratio); ``plain+kernels`` =
``generate`` inside ``hf_kvspec.DecodeKernels(model)``; ``ours-plain`` = ``speculative_generate`` without an
assistant (the fast forward every assistant's loop runs, so ``vs_ours_plain`` is speculation's own gain); one row
per assistant built with its defaults, run through
``speculative_generate`` as shipped (decode kernels on). Methods rotate per prompt and repeat (interleaved), each
timed whole (``generate`` call, tokens emitted until EOS or the limit); speed = total tokens / total seconds.
``bound`` = tau / (c_v(N + 1) + draft) from this run's c_v(T) table of the fast forward, in its own one-token
steps, and the loop's draft time (``spec_bounds.speedup_bound``: c_v averaged over the rounds' node counts; for B
rows c_v(B (N + 1)) / c_v(B)): a bound on ``vs_ours_plain``, where the fast forward applies (the loop runs it for
every forward, one-token steps included).
The load average is recorded before and after.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_kvspec
from bench.harness import Report, load_averages
from bench.spec_bounds import speedup_bound
from bench.spec_inputs import BATCH_SUMMARIES, PROMPTS, chat_inputs, new_tokens

PROMPT_FILES = {"chat": "scripts/train_configs/chat_prompts_heldout.jsonl"}
COLUMNS = ["prompts", "method", "batch", "temperature", "tokens", "tok_per_s", "vs_plain", "vs_plain_kernels",
           "vs_ours_plain", "tau",
           "nodes", "c_v", "draft_steps", "bound", "fallback_rounds", "identical"]
CV_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
_CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle]
'''
#: code-edit prompts: the answer repeats most of the code it is given (where n-gram lookup drafts well)
CODE_PROMPTS = [f"Add type hints to these Python functions and return the full code.\n\n{_CODE}",
                f"Rename the parameter `values` to `data` in this code and return the full code.\n\n{_CODE}",
                f"Add a one-line docstring to each function and return the full code.\n\n{_CODE}"]


def assistants(model) -> dict:
    """Each assistant with its defaults (fresh per call: nothing learned carries over between prompts)."""
    from hf_kvspec.heads.bundled import load_bundled_heads

    heads = {kind: load_bundled_heads(kind) for kind in ("eagle", "medusa", "early_exit")}
    return {
        "eagle": lambda: hf_kvspec.EagleAssistant(heads["eagle"]),
        "medusa": lambda: hf_kvspec.MedusaAssistant(heads["medusa"]),
        "early_exit+adapter": lambda: hf_kvspec.EarlyExitAssistant(None, adapter=heads["early_exit"]),
        "ngram": lambda: hf_kvspec.NgramAssistant(),
        "ngram-auto": lambda: hf_kvspec.NgramAssistant(num_draft_tokens="auto"),
    }


def load_prompts(kind: str, count: int) -> list[str]:
    if kind == "chat":
        rows = [json.loads(line) for line in Path(PROMPT_FILES["chat"]).read_text().splitlines() if line.strip()]
        prompts = [row["prompt"] for row in rows]
    elif kind == "code":
        prompts = [*CODE_PROMPTS, PROMPTS["code"]]
    elif kind == "summarize":
        prompts = list(BATCH_SUMMARIES)  # the spec benchmark's summarization prompts
    else:
        raise ValueError(f"prompt sets are chat, code, summarize; got {kind!r}")
    step = max(len(prompts) // count, 1)
    return prompts[::step][:count]


def _call(method: str, model, inputs: dict, settings: dict, build: dict):
    if method == "plain":
        return model.generate(**inputs, **settings, return_dict_in_generate=True), None
    if method == "plain+kernels":
        with hf_kvspec.DecodeKernels(model, plans_file=_plans_file()):
            return model.generate(**inputs, **settings, return_dict_in_generate=True), None
    if method == "ours-plain":  # the loop without an assistant: the same fast forward the assistants' rows run
        return model.generate(**inputs, **settings, custom_generate=hf_kvspec.speculative_generate,
                              return_dict_in_generate=True), None
    out = model.generate(**inputs, **settings, custom_generate=hf_kvspec.speculative_generate,
                         assistant=build[method](), return_dict_in_generate=True)
    return out, out.acceptance


def _plans_file():
    from hf_kvspec.kernels.linear import default_plans_file

    return default_plans_file()


def cost_table(model, context: int = 200, repeats: int = 7) -> dict:
    """{T: (stock, ours, fast)} forward time over T new tokens (logits at every one, as a verify forward) / stock
    1-token step, warm cache of ``context``: the model's own forward, inside the decode kernels, and the fast forward
    (``hf_kvspec.forward``, what ``speculative_generate`` runs)."""
    from hf_kvspec.forward.runner import choose_forward

    ids = torch.randint(100, 20000, (1, context))
    kernels = hf_kvspec.DecodeKernels(model, plans_file=_plans_file())
    fast = choose_forward(model, None)
    times = {t: {"stock": [], "ours": [], "fast": []} for t in CV_TOKENS}

    def forward(name: str, x: torch.Tensor, cache) -> None:
        if name == "fast":
            positions = torch.arange(context, context + x.shape[1])[None]
            fast(dict(input_ids=x, attention_mask=None, position_ids=positions, logits_to_keep=x.shape[1]), cache)
            return
        with kernels if name == "ours" else contextlib.nullcontext():
            model(x, cache=cache, logits_to_keep=x.shape[1])

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache)
        for t in CV_TOKENS:  # calibrate every bucket (and pack the fast forward's weights) before timing
            for name in ("ours", "fast"):
                forward(name, torch.randint(100, 20000, (1, t)), cache)
                cache.crop(-t)
        for _ in range(repeats):
            for t in CV_TOKENS:
                for name in ("stock", "ours", "fast"):
                    x = torch.randint(100, 20000, (1, t))
                    start = time.perf_counter()
                    forward(name, x, cache)
                    times[t][name].append(time.perf_counter() - start)
                    cache.crop(-t)
    step = statistics.median(times[1]["stock"])
    return {"step_s": step, "c_v": {t: {k: statistics.median(v) / step for k, v in d.items()} for t, d in times.items()},
            "kernels": kernels.report(), "forward": fast.name}


def run(args) -> None:
    model, tokenizer = hf_kvspec.load_bundled_model()
    eos_id = model.generation_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    load_before = load_averages()
    costs = cost_table(model)
    # what the loop runs: the fast forward for every forward (one-token steps included), so c_v and the bound are
    # in its own one-token steps (the bound is one on vs_ours_plain)
    ours_cv = {t: v["fast"] / costs["c_v"][1]["fast"] for t, v in costs["c_v"].items()}
    costs["loop_step_s"] = costs["step_s"] * costs["c_v"][1]["fast"]
    report = Report("spec.defaults" + (f".{args.part}" if args.part else ""), "Assistants with their defaults vs plain generate (bundled SmolLM2-135M, CPU)",
                    COLUMNS, settings={"threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
                                       "repeats": args.repeats, "prompts_per_set": args.num_prompts,
                                       "model": "smollm2-135m-instruct fp32"})
    build = assistants(model)
    methods = ["plain", "plain+kernels", "ours-plain", *[m for m in build if m in args.default_methods.split(",")]]
    for kind in args.prompt_sets.split(","):
        prompts = load_prompts(kind, args.num_prompts)
        for batch, temperature in _cases(args):
            _bench_case(report, model, tokenizer, eos_id, build, methods, kind, prompts, batch, temperature,
                        args, costs, ours_cv)
    report.notes += [
        f"One stock 1-token forward (warm 200-token cache): {costs['step_s'] * 1e3:.1f} ms. c_v(T) = forward over T "
        "new tokens (logits at each) / that step: " + ", ".join(
            f"T={t}: stock {v['stock']:.2f}, kernels {v['ours']:.2f}, fast {v['fast']:.2f}"
            for t, v in costs["c_v"].items()) + f" (fast = {costs['forward']} forward, what the loop runs).",
        f"Decode kernels: {costs['kernels']['bytes_held'] / 2**20:.0f} MiB of weight copies held; kernel per shape "
        f"and row bucket: {json.dumps(next(iter(costs['kernels']['plans'].values()), {}))}.",
        f"Load average (1, 5, 15 min) before: {load_before}; after: "
        + load_averages() + ".",
        "vs_plain = speed / stock plain generate; vs_plain_kernels = speed / plain generate inside DecodeKernels; "
        "vs_ours_plain = speed / speculative_generate without an assistant (ours-plain: the fast forward every "
        "assistant's loop runs, so this ratio is speculation's own gain); "
        "nodes = mean drafts verified per round; c_v = mean c_v(N + 1) over the rounds (the fast forward's, over its "
        "own one-token step; bs B: c_v(B (N + 1)) / c_v(B)); draft_steps = draft seconds per round / that step; "
        "bound = tau / (c_v + draft_steps), a bound on vs_ours_plain; fallback_rounds = share of rounds that drafted nothing "
        "(auto chose plain decoding); identical = output equal to plain greedy on every prompt (greedy rows).",
    ]
    report.write()


def _cases(args) -> list[tuple[int, float]]:
    cases = [(1, 0.0)]
    if args.temperature:
        cases.append((1, args.temperature))
    if args.batch > 1:
        cases.append((args.batch, 0.0))
    return cases


def _bench_case(report, model, tokenizer, eos_id, build, methods, kind, prompts, batch, temperature, args, costs,
                ours_cv) -> None:
    settings = {"max_new_tokens": args.new_tokens, "pad_token_id": eos_id}
    settings |= {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    totals = {m: {"s": 0.0, "tokens": 0, "stats": [], "same": True} for m in methods}
    reference = {}
    with torch.inference_mode():
        _call("plain+kernels", model, chat_inputs(tokenizer, ["Hi"]), {"max_new_tokens": 4}, build)  # warm
        for repeat in range(args.repeats):
            for index, group in enumerate(groups):
                inputs = chat_inputs(tokenizer, group)
                rotated = methods[(index + repeat) % len(methods):] + methods[:(index + repeat) % len(methods)]
                for method in rotated:
                    torch.manual_seed(repeat)
                    start = time.perf_counter()
                    out, stats = _call(method, model, inputs, settings, build)
                    seconds = time.perf_counter() - start
                    entry = totals[method]
                    entry["s"] += seconds
                    entry["tokens"] += new_tokens(out.sequences, inputs["input_ids"].shape[1], eos_id)
                    if stats is not None:
                        entry["stats"].append(stats)
                    key = (repeat, index)
                    if method == "plain":
                        reference[key] = out.sequences
                    elif not temperature and key in reference:
                        entry["same"] &= torch.equal(out.sequences, reference[key])
    _add_rows(report, totals, kind, batch, temperature, costs, ours_cv, len(prompts))


def _add_rows(report, totals, kind, batch, temperature, costs, ours_cv, count) -> None:
    speed = {m: t["tokens"] / t["s"] for m, t in totals.items()}
    for method, entry in totals.items():
        row = {"prompts": f"{kind} x{count}", "method": method, "batch": batch, "temperature": temperature,
               "tokens": entry["tokens"], "tok_per_s": round(speed[method], 2),
               "vs_plain": round(speed[method] / speed["plain"], 3),
               "vs_plain_kernels": round(speed[method] / speed["plain+kernels"], 3),
               "vs_ours_plain": round(speed[method] / speed["ours-plain"], 3)}
        if entry["stats"]:
            merged = hf_kvspec.AcceptanceStats()
            for stats in entry["stats"]:
                merged.merge(stats)
            lengths = [n for s in entry["stats"] for n in s.draft_lengths] or [0]
            tau = merged.tokens_per_target_forward
            bound, cv, draft = speedup_bound(tau, lengths, merged.draft_time_s / max(merged.rounds, 1),
                                             costs["loop_step_s"], ours_cv, batch)
            row |= {"tau": round(tau, 2), "nodes": round(statistics.mean(lengths), 2), "c_v": round(cv, 2),
                    "draft_steps": round(draft, 2), "bound": round(bound, 2),
                    "fallback_rounds": round(merged.fallback_rounds / max(merged.rounds, 1), 2),
                    "identical": "-" if temperature else entry["same"]}
        report.add(**row)
