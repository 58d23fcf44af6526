"""Speculation under load: the plain engine, the engine with each assistant, and transformers' ``generate_batch``
(its continuous batching) on the same requests, over concurrency and arrival rates, per prompt kind.

    python scripts/benchmark.py engine --kinds chat,code,summarize --concurrency 1,2,4,8,16,all \\
        --rates 0.5,1,2 --assistant ngram,eagle,medusa,self-int8 --num-requests 16 --max-new-tokens 64

A load is either a concurrency C (every request queued at t = 0 and at most C running: a closed loop at C; ``all``
runs every request at once) or a Poisson arrival rate (requests/s) with the default ``--max-running``. Each cell
(kind x load) runs every system one after another on the same prompts, greedy, one torch thread:

    engine      ``hf_kvspec.Engine`` without an assistant (the baseline of every ratio)
    engine+A    the same with ``assistant=A``; the draft length per request and round is the engine's own choice
                (``draft_lengths="goodput"``): ``k_mean`` is the mean drafts per decode row, ``tau`` the tokens a
                decode row emits per round, ``drafting`` the share of decode rows that drafted
    hf          transformers' continuous batching (what ``model.generate_batch`` runs on), matched KV bytes, token
                budget and running requests (C)

Figures per system: output tokens/s (``speedup`` against ``engine``, ``vs_hf`` against ``hf``), TTFT and TPOT
p50/p99 (TPOT: a request's (last token - first token) / (tokens - 1)), how many outputs equal the plain engine's,
and the load average before and after. Results: ``benchmarks/results/<out-name>.{json,md,png}`` (the plot: speedup
over the plain engine against concurrency, one panel per prompt kind).
"""

from __future__ import annotations

import itertools
import statistics

from bench.engine import Trace, arrival_times, hf_config, percentile, run_engine, run_hf, summarize
from bench.harness import Report, load_average, save_plot

COLUMNS = ["kind", "load", "system", "completed", "output_tokens", "tok_per_s", "speedup", "vs_hf", "k_mean",
           "tau", "drafting", "pool_kib", "hit_rate", "by_pool", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "same_as_engine", "load_before",
           "load_after"]
KINDS = ("chat", "code", "summarize")


def workload(tokenizer, kind: str, count: int) -> list[list[int]]:
    """``count`` chat-templated prompts of ``kind``: a prompt set (cycled when smaller) or a committed workload
    (``bench/workloads.py``: extraction, multiturn, code_edit, chat)."""
    from bench import workloads
    from bench.spec_defaults import load_prompts

    if kind in workloads.WORKLOADS:
        conversations = workloads.load(kind, count)
    else:
        conversations = [[{"role": "user", "content": text}]
                         for text in itertools.islice(itertools.cycle(load_prompts(kind, 1000)), count)]
    prompts = []
    for messages in conversations:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def parse_loads(concurrency: str, rates: str) -> list[tuple[str, int | None, float | None]]:
    """``(label, max_running or None, rate or None)`` per load: concurrency values first, then Poisson rates."""
    loads = []
    for item in filter(None, concurrency.split(",")):
        loads.append(("C=all", None, None) if item == "all" else (f"C={int(item)}", int(item), None))
    for item in filter(None, rates.split(",")):
        if item != "all":
            loads.append((f"{float(item):g}/s", None, float(item)))
    return loads


def tpot(trace: Trace) -> float | None:
    if len(trace.token_times) < 2:
        return None
    return (trace.token_times[-1] - trace.token_times[0]) / (len(trace.token_times) - 1)


def figures(traces: list[Trace]) -> dict:
    """``engine.summarize``'s throughput and TTFT, with TPOT p50/p99 in place of the inter-token gaps."""
    per_token = [p for p in map(tpot, traces) if p is not None]
    summary = {k: v for k, v in summarize(traces).items() if not k.startswith("itl")}
    return {**summary, "tpot_p50": percentile(per_token, 0.5), "tpot_p99": percentile(per_token, 0.99)}


def speculation(engine) -> dict:
    """The draft lengths the engine chose and what they gave: mean drafts per decode row, tokens per decode row,
    the share of decode rows that drafted."""
    rounds = [r for r in engine.stats.rounds if r.num_decode_rows]
    rows = sum(r.num_decode_rows for r in rounds)
    if not rows:
        return {}
    drafted = sum(r.num_draft_tokens for r in rounds)
    emitted = sum(r.num_output_tokens for r in rounds)
    drafting_rows = sum(min(r.num_decode_rows, r.num_draft_tokens) for r in rounds if r.num_draft_tokens)
    return {"k_mean": round(drafted / rows, 2), "tau": round(emitted / rows, 2),
            "drafting": round(drafting_rows / rows, 2)}


def engine_assistant(spec: str | None):
    """The engine's ``assistant`` for a benchmark spec: the suffix pool shares the requests' text (a workload is
    one user's traffic, one tenant); other specs as given."""
    if spec is None or "suffix" not in spec.split("+"):
        return spec
    from hf_kvspec import SuffixAssistant, SuffixPool

    parts = [SuffixAssistant(pool=SuffixPool(share_unsalted=True)) if p == "suffix" else p for p in spec.split("+")]
    return parts[0] if len(parts) == 1 else parts


def _engine_run(model, tokenizer, spec, max_running: int, args, prompts, arrivals):
    """The engine with ``spec``'s assistant (none for None). ``<spec>@k0``: the assistant with every request held
    at K = 0 (``num_draft_tokens=0``): what having an assistant costs when nobody drafts (features captured, the
    plan and the drafter's bookkeeping run every round)."""
    from hf_kvspec import Engine

    made = []
    spec, _, held = (spec or "").partition("@")
    assistant = engine_assistant(spec or None)
    sizes = {"num_draft_tokens": 0} if held == "k0" else {}

    def make():
        made.append(Engine(model, tokenizer, kv_budget=args.kv_budget, max_tokens_per_round=args.max_tokens_per_round,
                           max_running=max_running, assistant=assistant, **sizes))
        return made[-1]

    traces, _ = run_engine(make, prompts, arrivals, args.max_new_tokens)
    return traces, {**(speculation(made[-1]) if assistant else {}), **pool_figures(made[-1])}


def pool_figures(engine) -> dict:
    """The suffix pool's bytes and hit rate, and the share of drafting rows the pool drafted when mixed."""
    telemetry = engine.telemetry()
    pool, drafted_by = telemetry.get("suffix_pool"), telemetry.get("drafted_by")
    out = {} if pool is None else {"pool_kib": round(pool["bytes"] / 1024, 1), "hit_rate": round(pool["hit_rate"], 2)}
    if drafted_by:
        out["by_pool"] = round(drafted_by["suffix"] / max(sum(drafted_by.values()), 1), 2)
    return out


def _hf_run(model, max_running: int, args, prompts, arrivals, eos_ids):
    import copy

    settings = copy.copy(args)
    settings.max_running = max_running
    traces, _ = run_hf(model, prompts, arrivals, args.max_new_tokens, eos_ids, hf_config(model, settings))
    return traces, {}


def systems(model, tokenizer, args, eos_ids) -> dict:
    """``name -> run(max_running, prompts, arrivals) -> (traces, extra)``."""
    runs = {"engine": lambda c, p, a: _engine_run(model, tokenizer, None, c, args, p, a)}
    for spec in filter(None, args.assistant.split(",")):
        runs[f"engine+{spec}"] = lambda c, p, a, spec=spec: _engine_run(model, tokenizer, spec, c, args, p, a)
    if "hf" in args.systems.split(","):
        runs["hf"] = lambda c, p, a: _hf_run(model, c, args, p, a, eos_ids)
    return runs


def run_cell(runs: dict, kind: str, label: str, max_running: int, prompts, arrivals, repeats: int = 1,
             paired: bool = False) -> list[dict]:
    """Every system on the cell, ``repeats`` times in alternating order; a system's fastest run counts (timer and
    scheduler noise only ever slow a run down). ``paired``: each run of another system right after a run of the
    plain engine, and its speedup the median over the repeats of the pair's ratio (a machine whose speed drifts
    over minutes shifts both runs of a pair alike)."""
    rows, outputs, ratios = {}, {}, {}

    def measure(name: str) -> float:
        before = load_average()
        traces, extra = runs[name](max_running, prompts, arrivals)
        row = {"kind": kind, "load": label, "system": name, **figures(traces), **extra,
               "load_before": round(before, 2), "load_after": round(load_average(), 2)}
        if name not in rows or (row["tok_per_s"] or 0) > (rows[name]["tok_per_s"] or 0):
            rows[name], outputs[name] = row, [t.output_ids for t in traces]
        return row["tok_per_s"] or 0.0

    for repeat in range(repeats):
        for name in (runs if repeat % 2 == 0 else list(reversed(runs))):
            if name == "hf" and repeat:  # the slow baseline once: its ratio to ours is far from any threshold
                continue
            if paired and name != "engine":
                base = measure("engine")
                ratios.setdefault(name, []).append(measure(name) / base if base else 0.0)
            elif not paired:
                measure(name)
    base, hf = rows["engine"]["tok_per_s"], rows.get("hf", {}).get("tok_per_s")
    for name, row in rows.items():
        row["speedup"] = round(row["tok_per_s"] / base, 3) if base and row["tok_per_s"] else None
        if name in ratios:
            row["speedup"] = round(statistics.median(ratios[name]), 3)
        row["vs_hf"] = round(row["tok_per_s"] / hf, 3) if hf and row["tok_per_s"] else None
        row["same_as_engine"] = sum(a == b for a, b in zip(outputs[name], outputs["engine"]))
    return list(rows.values())


def run(args) -> None:
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    model.eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    runs = systems(model, tokenizer, args, eos_ids)
    warm = workload(tokenizer, "chat", 2)
    for run_system in runs.values():  # first-call costs (kernel builds, packing, allocations) are not a cell's
        run_system(2, warm, arrival_times(2, None))
    report = Report(args.out_name, "Speculation under load: engine, engine + assistant, transformers' generate_batch",
                    COLUMNS, settings={k: v for k, v in vars(args).items() if k != "func"})
    for kind in args.kinds.split(","):
        prompts = workload(tokenizer, kind, args.num_requests)
        for label, max_running, rate in parse_loads(args.concurrency, args.rates):
            arrivals = arrival_times(len(prompts), rate, args.seed)
            running = max_running or (len(prompts) if rate is None else args.max_running)
            for row in run_cell(runs, kind, label, running, prompts, arrivals, args.repeats, args.paired):
                report.add(**row)
    report.notes += run_notes(args)
    report.write()
    save_plot(args.out_name, lambda fig: draw(fig, report.rows))


def run_notes(args) -> list[str]:
    """The results file's notes: how each cell was run and what its columns mean."""
    protocol = (f"each system run {args.repeats} times, each run right after a run of the plain engine; speedup = "
                "the median of those pairs' ratios (tok_per_s: each system's fastest run; transformers' once)"
                if getattr(args, "paired", False) else
                f"each system's fastest of {args.repeats} runs in alternating order (transformers' once)")
    return [
        f"{args.num_requests} requests per cell, greedy, max_new_tokens={args.max_new_tokens}, 1 torch thread; "
        f"{protocol}; C=n: all queued at t=0, at most n running (a closed loop); r/s: Poisson arrivals, "
        f"max_running={args.max_running}.",
        "speedup: tok/s over the plain engine in the same cell; k_mean: drafts per decode row (the engine's goodput "
        "choice, 0 where drafting does not pay); tau: tokens per decode row and round; drafting: share of decode "
        "rows that drafted.",
    ]


def draw(fig, rows: list[dict]) -> None:
    """Speedup over the plain engine against concurrency, one panel per kind, a line per assistant."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for k, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), k + 1)
        cells = [r for r in rows if r["kind"] == kind and r["load"].startswith("C=")]
        loads = list(dict.fromkeys(r["load"] for r in cells))
        for system in dict.fromkeys(r["system"] for r in cells):
            if system == "engine":
                continue
            values = [next((r["speedup"] or 0 for r in cells if r["system"] == system and r["load"] == load), 0)
                      for load in loads]
            ax.plot(range(len(loads)), values, marker="o", label=system)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(loads)), [load[2:] for load in loads])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tok/s over the plain engine")
        ax.set_title(kind)
        if k == 0:
            ax.legend(fontsize=7)
