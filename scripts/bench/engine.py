"""Serving throughput and latency: transformers' continuous batching, static ``generate()`` batches and
``hf_kvspec.Engine`` (without and with an assistant) on the same requests and arrival times, in one run.

    python scripts/benchmark.py engine [--num-requests 64] [--rates 0.25,0.5,1,all] [--max-new-tokens 64]
        [--systems hf,static,engine] [--assistant ngram|eagle] [--static-batch-size 16] [--seed 0]

Workload (``build_workload``): held-out chat prompts (the ``spec --defaults`` chat set), a shared long system
prompt on every other request, and every 16th request a long document to summarise (the ``spec`` benchmark's).
Arrivals (``arrival_times``): Poisson at each rate (requests/s), or ``all`` at once. Greedy, one torch thread.

Systems, each fed the requests at their arrival times:
    hf        transformers' continuous batching: the manager ``model.generate_batch`` runs on
              (``continuous_batching_context_manager``), set to the engine's KV bytes, token budget and running
              requests; its start-up (which every ``generate_batch`` call pays) is left out and shown as ``setup_s``
    static    ``model.generate`` on FIFO batches of up to ``--static-batch-size`` arrived requests, left-padded;
              a batch runs until its longest row ends, the next waits for it
    engine    ``hf_kvspec.Engine``, stepped in a loop that adds each request at its arrival time
    engine+A  the same with ``assistant=A`` (``--assistant``)

Per system and rate: throughput (output tokens / seconds from the first arrival to the last token), p50/p99
time to first token (from arrival), p50/p99 inter-token latency (all gaps between a request's tokens), block
utilisation (engine), requests completed, how many outputs equal the engine's (greedy: all should), and the load
average before and after. Results: ``benchmarks/results/engine.{json,md,png}``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.harness import Report, load_average, save_plot

COLUMNS = ["rate", "system", "completed", "output_tokens", "seconds", "tok_per_s", "vs_hf", "vs_static",
           "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "block_util", "slot_util", "setup_s", "same_as_engine", "load_before", "load_after"]
SYSTEM_PROMPT = (
    "You are a careful, friendly assistant working for a small company that builds software for language models. "
    "Answer in plain words and short sentences. When a question has a number for an answer, give the number first "
    "and then explain it in one sentence. When you do not know something, say so instead of guessing. Do not "
    "repeat the question. Prefer concrete examples over general advice, and keep every answer under one hundred "
    "words unless the user asks for more detail. If the user writes in another language, answer in that language.")


@dataclass
class Trace:
    """One request's run under one system: when it arrived, its output tokens and when each came out."""

    arrival: float
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)


# ---- workload ---------------------------------------------------------------------------------------------
def build_workload(tokenizer, num_requests: int, seed: int = 0) -> list[list[int]]:
    """Prompt ids of ``num_requests`` requests (see the module docstring), in arrival order."""
    from bench.spec_defaults import load_prompts
    from bench.spec_inputs import BATCH_SUMMARIES

    chats = load_prompts("chat", num_requests)
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        if i % 16 == 15:
            messages = [{"role": "user", "content": BATCH_SUMMARIES[(i // 16) % len(BATCH_SUMMARIES)]}]
        else:
            messages = [{"role": "user", "content": chats[rng.randrange(len(chats))]}]
            if i % 2 == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


def arrival_times(num_requests: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the start: Poisson arrivals at ``rate`` requests/s (exponential gaps), or all at 0 (None)."""
    if rate is None:
        return [0.0] * num_requests
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# ---- the systems --------------------------------------------------------------------------------------------
def _wait_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(make_engine: Callable, prompts, arrivals, max_new_tokens: int) -> tuple[list[Trace], dict]:
    """Our engine, stepped in a loop that adds each request once its arrival time has passed."""
    engine = make_engine()
    start = time.perf_counter()
    traces = [Trace(start + a) for a in arrivals]
    ids: dict[int, int] = {}  # engine request id -> index
    pending = 0
    with engine.hold_rounds():
        while pending < len(prompts) or engine.has_unfinished():
            while pending < len(prompts) and traces[pending].arrival <= time.perf_counter():
                ids[engine.add_request(prompts[pending], max_new_tokens=max_new_tokens)] = pending
                pending += 1
            if not engine.has_unfinished():
                _wait_until(traces[pending].arrival)
                continue
            deltas = engine.step()
            now = time.perf_counter()
            for delta in deltas:
                trace = traces[ids[delta.request_id]]
                trace.output_ids += delta.new_token_ids
                trace.token_times += [now] * len(delta.new_token_ids)
    rounds = engine.stats.rounds
    return traces, {"block_util": engine.telemetry()["mean_block_utilization"],
                    "slot_util": sum(r.slot_utilization for r in rounds) / len(rounds) if rounds else None}


class _StepClock:
    """A stopping criterion that stops nothing and stamps the time each generated token came out."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_static(model, prompts, arrivals, max_new_tokens: int, batch_size: int, pad_id: int,
               eos_ids: set[int]) -> tuple[list[Trace], dict]:
    """FIFO batches of arrived requests through ``model.generate``, left-padded; one batch at a time."""
    from transformers import StoppingCriteriaList

    start = time.perf_counter()
    traces = [Trace(start + a) for a in arrivals]
    served = 0
    while served < len(prompts):
        _wait_until(traces[served].arrival)
        batch = [i for i in range(served, min(served + batch_size, len(prompts)))
                 if traces[i].arrival <= time.perf_counter()]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad_id] * (width - len(prompts[i])) + prompts[i] for i in batch])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
        clock = _StepClock()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]))
        for row, i in enumerate(batch):
            tokens = _until_eos(out[row, width:].tolist(), eos_ids)
            traces[i].output_ids, traces[i].token_times = tokens, clock.times[: len(tokens)]
        served += len(batch)
    return traces, {}


def run_hf(model, prompts, arrivals, max_new_tokens: int, eos_ids: set[int], cb_config) -> tuple[list[Trace], dict]:
    """transformers' continuous batching through its manager (what ``generate_batch`` runs on), started before the
    clock (its setup, paid by every ``generate_batch`` call, is reported as ``setup_s``); requests are added at their
    arrival times and come back with per-token timestamps."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_ids),
                              pad_token_id=model.generation_config.pad_token_id or 0)
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                   block=True, timeout=5) as manager:
        start = time.perf_counter()
        traces = [Trace(start + a) for a in arrivals]
        for i, prompt in enumerate(prompts):
            _wait_until(traces[i].arrival)
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=max_new_tokens, record_timestamps=True)
        done = 0
        while done < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                break
            if result is not None and result.is_finished():
                trace = traces[int(result.request_id[1:])]
                trace.output_ids, trace.token_times = list(result.generated_tokens), list(result.timestamps or [])
                done += 1
    return traces, {"setup_s": round(start - setup, 3)}


def hf_config(model, args):
    """transformers' continuous-batching settings matched to the engine's: the same KV bytes, token budget per
    forward and running requests (its pages hold ``page_size`` tokens of every layer)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from hf_kvspec.cache.ragged import RaggedPagedCache

    page = 256
    tokens = RaggedPagedCache.blocks_for(model.config, args.kv_budget, page, model.dtype) * page
    return ContinuousBatchingConfig(page_size=page, num_blocks=max(tokens // page, 1),
                                    max_batch_tokens=args.max_tokens_per_round,
                                    max_requests_per_batch=args.max_running)


def _until_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    for k, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: k + 1]
    return tokens


# ---- figures ------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(traces: list[Trace]) -> dict:
    """Throughput and latency figures of one run (see the module docstring)."""
    done = [t for t in traces if t.token_times]
    tokens = sum(len(t.output_ids) for t in traces)
    seconds = max(t.token_times[-1] for t in done) - min(t.arrival for t in traces) if done else 0.0
    ttft = [t.token_times[0] - t.arrival for t in done]
    itl = [b - a for t in done for a, b in itertools.pairwise(t.token_times)]
    return {"completed": len(done), "output_tokens": tokens, "seconds": seconds,
            "tok_per_s": round(tokens / seconds, 2) if seconds else None,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99)}


# ---- the run ------------------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rates", default="0.25,0.5,1,all", help="Poisson arrival rates (requests/s) and/or 'all'")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--systems", default="hf,static,engine", help="comma-separated: hf, static, engine")
    parser.add_argument("--assistant", default="",
                        help="also run the engine with these assistants, comma-separated (ngram, suffix, eagle, "
                             "medusa, self-int8, self-int4, draft:<dir>, suffix+eagle); with --kinds, <spec>@k0 "
                             "holds every request at K = 0 (what an assistant costs when nobody drafts)")
    parser.add_argument("--kinds", default=None,
                        help="speculation under load (bench/engine_load.py): prompt kinds, from chat,code,summarize")
    parser.add_argument("--workload", dest="kinds",
                        help="the same with the committed workloads (bench/workloads.py): extraction, multiturn, "
                             "code_edit, chat")
    parser.add_argument("--concurrency", default="1,2,4,8,16,all",
                        help="with --kinds: closed-loop concurrency values (and 'all')")
    parser.add_argument("--profile-rounds", default=None,
                        help="where an engine round goes at these concurrencies (bench/engine_profile.py), e.g. 1,4,16")
    parser.add_argument("--paired", action="store_true",
                        help="with --kinds: run the plain engine right before every other system's run; speedup = "
                             "the median of the pairs' ratios (robust to a machine whose speed drifts)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="with --kinds: runs per system and cell, alternating order; the fastest counts")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--max-tokens-per-round", type=int, default=256)
    parser.add_argument("--kv-budget", default="256MB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-name", default="engine", help="results file stem under benchmarks/results")


def parse_rates(text: str) -> list[float | None]:
    """``"0.5,1,all"`` -> ``[0.5, 1.0, None]`` (None: all at once)."""
    rates = []
    for item in text.split(","):
        if item.strip() == "all":
            rates.append(None)
            continue
        rate = float(item)
        if rate <= 0:
            raise ValueError(f"--rates: {item} is not a positive rate (requests/s) or 'all'")
        rates.append(rate)
    return rates


def make_assistant(name: str | None):
    """The engine's assistant for one ``--assistant`` spec: the spec itself (``Engine`` resolves it)."""
    return name or None


def build_runners(model, tokenizer, args, eos_ids: set[int], pad_id: int) -> dict[str, Callable]:
    """``name -> run(prompts, arrivals) -> (traces, extra figures)`` for the systems ``args`` asks for."""
    from hf_kvspec import Engine

    systems = args.systems.split(",")
    unknown = set(systems) - {"hf", "static", "engine"}
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from hf, static, engine")
    engine_kwargs = dict(kv_budget=args.kv_budget, max_tokens_per_round=args.max_tokens_per_round,
                         max_running=args.max_running)
    new_tokens = args.max_new_tokens
    runners = {}
    if "hf" in systems:
        cb_config = hf_config(model, args)
        runners["hf"] = lambda ps, arr: run_hf(model, ps, arr, new_tokens, eos_ids, cb_config)
    if "static" in systems:
        runners["static"] = lambda ps, arr: run_static(model, ps, arr, new_tokens, args.static_batch_size, pad_id,
                                                       eos_ids)
    if "engine" in systems:
        runners["engine"] = lambda ps, arr: run_engine(lambda: Engine(model, tokenizer, **engine_kwargs), ps, arr,
                                                       new_tokens)
    for spec in filter(None, args.assistant.split(",")):
        runners[f"engine+{spec}"] = lambda ps, arr, spec=spec: run_engine(
            lambda: Engine(model, tokenizer, assistant=make_assistant(spec), **engine_kwargs), ps, arr, new_tokens)
    return runners


def run_all(model, prompts, args, eos_ids: set[int], pad_id: int, tokenizer=None) -> Report:
    """Every system on every rate (after an untimed warm-up of each); returns the report (not yet written)."""
    runners = build_runners(model, tokenizer, args, eos_ids, pad_id)
    for run in runners.values():  # first-call costs: kernel choices, allocations
        run(prompts[:2], arrival_times(min(2, len(prompts)), None))
    report = Report(args.out_name, "Serving: throughput and latency under arrivals (bundled model, 1 thread)",
                    COLUMNS, settings={k: v for k, v in vars(args).items() if k != "func"})
    for rate in parse_rates(args.rates):
        arrivals = arrival_times(len(prompts), rate, args.seed)
        rows = {}
        for name, run in runners.items():
            load_before = load_average()
            traces, extra = run(prompts, arrivals)
            rows[name] = {"rate": "all" if rate is None else rate, "system": name, **summarize(traces), **extra,
                          "load_before": round(load_before, 2), "load_after": round(load_average(), 2),
                          "_outputs": [t.output_ids for t in traces]}
        for row in rows.values():
            _add_ratios(row, rows)
            report.add(**{k: v for k, v in row.items() if not k.startswith("_")})
    return report


def _add_ratios(row: dict, rows: dict) -> None:
    for base in ("hf", "static"):
        other = rows.get(base, {}).get("tok_per_s")
        row[f"vs_{base}"] = round(row["tok_per_s"] / other, 3) if other and row["tok_per_s"] else None
    if "engine" in rows:
        row["same_as_engine"] = sum(a == b for a, b in zip(row["_outputs"], rows["engine"]["_outputs"]))


def run(args) -> None:
    if args.profile_rounds:  # where an engine round goes
        from bench import engine_profile

        engine_profile.run(args)
        return
    if args.kinds:  # speculation under load: the sweep over kinds and concurrency
        from bench import engine_load

        engine_load.run(args)
        return
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    model.eval()
    prompts = build_workload(tokenizer, args.num_requests, args.seed)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(eos_ids)[0]
    report = run_all(model, prompts, args, eos_ids, pad_id, tokenizer)
    report.notes += [
        f"{len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, greedy, "
        f"max_new_tokens={args.max_new_tokens}; rates in requests/s ('all': every request at t=0).",
        "tok_per_s: output tokens / (last token - first arrival); ttft from arrival; itl: gaps between a request's "
        "tokens (seconds). vs_hf / vs_static: throughput ratios in the same rate.",
        "same_as_engine: requests whose greedy output equals the engine's (fp32 near-ties can differ between "
        "batch shapes); load_before/after: 1-minute load average around each configuration.",
    ]
    report.write()
    save_plot(args.out_name, lambda fig: _draw(fig, report.rows))


def _draw(fig, rows: list[dict]) -> None:
    systems = sorted({r["system"] for r in rows})
    rates = list(dict.fromkeys(str(r["rate"]) for r in rows))
    for k, (metric, label) in enumerate((("tok_per_s", "output tokens/s"), ("ttft_p99", "p99 TTFT (s)"))):
        ax = fig.add_subplot(1, 2, k + 1)
        for s, system in enumerate(systems):
            values = [next((r[metric] or 0 for r in rows if r["system"] == system and str(r["rate"]) == rate), 0)
                      for rate in rates]
            ax.bar([i + s / (len(systems) + 1) for i in range(len(rates))], values, 1 / (len(systems) + 1),
                   label=system)
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        if k == 0:
            ax.legend(fontsize=7)
