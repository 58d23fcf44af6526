"""Decode at the machine's limit: where a step's time goes, the cost of T-token forwards, plain decoding and the
default assistants on the fast forward, and the first call's cost.

    python scripts/benchmark.py --threads 1 step [--parts profile,curve,plain,assistants,first-call]
        [--assistants eagle,ngram,self-int8] [--prompt-sets chat,summarize] [--num-prompts 8]
        [--new-tokens 256] [--name step]

Parts (each a table of benchmarks/results/<name>.{json,md}):
    profile      one forward of T = 1 and T = 8 tokens after a 128-token prompt, per op category (torch.profiler
                 self CPU time), for the model's own forward (stock linears), the same with the decode kernels
                 routing every linear call, and the fast forward; "python & dispatch" = wall time of the forward
                 without the profiler minus the ops' self time (what the interpreter and dispatcher cost)
    curve        a T-token forward's wall time for T = 1..32 on the three forwards, and c_v(T) = t(T) / t_fast(1)
    plain        greedy answers: transformers' stock ``generate``, hf_kvspec's loop on the model's forward, and on
                 the fast forward (the default); tokens/s, identical output
    assistants   each assistant at the defaults ``hf-kvspec generate --assistant`` gives it, against plain decoding
                 on the fast forward, same answers: speed-up, tau, draft cost d (draft seconds per round over a
                 plain step) and the bound tau / (c_v(N + 1) + d) (c_v from the curve part, or measured here)
    first-call   fresh processes: the first answer's extra seconds over later ones (packing the weight copies)
                 in a first and a second process

Every timed method runs per prompt in an order rotated per prompt; tokens/s = new tokens (EOS included) over the
call's wall seconds (prefill included); the load average is recorded before and after each part.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import Report, load_averages
from bench.spec_defaults import load_prompts
from bench.spec_inputs import chat_inputs, new_tokens

PARTS = ("profile", "curve", "plain", "assistants", "first-call")
CURVE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
FORWARDS = ("reference", "reference+kernels", "fast")


def add_arguments(parser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--assistants", default="eagle,ngram,self-int8",
                        help="comma list of --assistant specs (each at hf-kvspec generate's defaults)")
    parser.add_argument("--prompt-sets", default="chat,summarize")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--name", default="step")


def run(args) -> None:
    from hf_kvspec.models import load_bundled_model

    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {PARTS}")
    model, tokenizer = load_bundled_model()
    report = Report(args.name, "Decode at the machine's limit (bundled SmolLM2-135M fp32)",
                    ["part", "case", "method", "value", "unit", "detail"], settings=vars(args))
    curve = {}
    for part in parts:
        before = load_averages()
        if part == "profile":
            _profile(model, report)
        elif part == "curve":
            curve = _curve(model, report)
        elif part == "plain":
            _plain(model, tokenizer, args, report)
        elif part == "assistants":
            _assistants(model, tokenizer, args, report, curve or _curve(model, None))
        else:
            _first_call(report)
        report.notes.append(f"{part}: load average {before} before, {load_averages()} after")
    report.write()


# ------------------------------------------------------------------------------------------------ forwards
def _forward_fn(model, kind: str, cache, ids):
    """One forward of ``ids`` [1, T] on ``cache`` by forward ``kind`` (the cache is cropped back after)."""
    from hf_kvspec.forward.runner import EagerForward, FastForward

    forward = FastForward(model) if kind == "fast" else EagerForward(model)
    inputs = dict(input_ids=ids, logits_to_keep=ids.shape[1])

    def call():
        forward(inputs, cache)
        cache.crop(-ids.shape[1])

    return call


def _with_forward(model, kind: str):
    """A context in which ``kind`` runs: the decode kernels route every linear call for reference+kernels."""
    import contextlib

    if kind != "reference+kernels":
        return contextlib.nullcontext()
    from hf_kvspec.kernels.linear import DecodeKernels, default_plans_file

    return DecodeKernels(model, plans_file=default_plans_file())


def _prefilled(model, length: int = 128):
    from transformers import DynamicCache

    torch.manual_seed(0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.randint(100, 20000, (1, length)), cache=cache, use_cache=True)
    return cache


def _time(call, repeats: int = 12) -> float:
    """Fastest of ``repeats`` calls after two warm-ups (noise only ever adds)."""
    with torch.inference_mode():
        for _ in range(2):
            call()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
    return min(samples)


LINEAR_EVENT = "hf_kvspec::packed_linear"  # the fast forward's projections (C kernels the profiler cannot see)
CATEGORIES = (("linear", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise",
                          "aten::bmm", LINEAR_EVENT)),
              ("attention", ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                             "aten::_scaled_dot_product_attention_math")),
              ("KV append (cat)", ("aten::cat",)))


def _profile(model, report) -> None:
    from torch.profiler import ProfilerActivity, profile

    for tokens in (1, 8):
        for kind in FORWARDS:
            cache = _prefilled(model)
            ids = torch.randint(100, 20000, (1, tokens))
            with _with_forward(model, kind):
                call = _forward_fn(model, kind, cache, ids)
                wall = _time(call)
                with torch.inference_mode(), _projections_recorded(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(10):
                        call()
            split = _categories(prof.key_averages(), 10)
            split["python & dispatch"] = max(wall * 1e3 - sum(split.values()), 0.0)
            for category, ms in split.items():
                report.add(part="profile", case=f"T={tokens}", method=kind, value=round(ms, 2), unit="ms",
                           detail=category)
            report.add(part="profile", case=f"T={tokens}", method=kind, value=round(wall * 1e3, 2), unit="ms",
                       detail="wall (no profiler)")


@contextlib.contextmanager
def _projections_recorded():
    """The fast forward's projections as one profiler event each (their C kernels run outside torch's ops)."""
    from hf_kvspec.forward import packed

    originals = {cls: cls.__call__ for cls in (packed.PanelLinear, packed.PackedLinear)}

    def recorded(original):
        def call(self, x):
            with torch.profiler.record_function(LINEAR_EVENT):
                return original(self, x)
        return call

    try:
        for cls, original in originals.items():
            cls.__call__ = recorded(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.__call__ = original


def _categories(events, calls: int) -> dict[str, float]:
    """Self CPU ms per forward by category; every other op is a 'small op' (norms, rotary, casts, views)."""
    split = {name: 0.0 for name, _ in CATEGORIES} | {"small ops": 0.0}
    for event in events:
        name = next((cat for cat, ops in CATEGORIES if event.key in ops), "small ops")
        split[name] += event.self_cpu_time_total / 1e3 / calls
    return split


def _curve(model, report) -> dict[int, float]:
    """{T: c_v(T)} of the fast forward (its T-token forward over its one-token forward)."""
    seconds = {}
    for kind in FORWARDS:
        with _with_forward(model, kind):
            for tokens in CURVE_TOKENS:
                cache = _prefilled(model)
                seconds[kind, tokens] = _time(_forward_fn(model, kind, cache, torch.randint(100, 20000, (1, tokens))))
    base = seconds["fast", 1]
    for kind in FORWARDS:
        for tokens in CURVE_TOKENS:
            if report is not None:
                report.add(part="curve", case=f"T={tokens}", method=kind, value=round(seconds[kind, tokens] * 1e3, 2),
                           unit="ms", detail=f"c_v {seconds[kind, tokens] / base:.2f} (vs fast T=1)")
    return {tokens: seconds["fast", tokens] / base for tokens in CURVE_TOKENS}


# ------------------------------------------------------------------------------------------------ answers
def _answer(model, inputs, max_new: int, **kwargs):
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, return_dict_in_generate=True,
                             **kwargs)
    return out, time.perf_counter() - start


def _plain_methods():
    from hf_kvspec.speculative.loop import speculative_generate

    return {"generate (stock)": {},
            "loop, reference forward": {"custom_generate": speculative_generate, "fast_forward": False},
            "loop, fast forward": {"custom_generate": speculative_generate}}


def _plain(model, tokenizer, args, report) -> None:
    methods = _plain_methods()
    for kind in args.prompt_sets.split(","):
        totals = {name: [0, 0.0] for name in methods}
        same = {name: 0 for name in methods}
        prompts = load_prompts(kind, args.num_prompts)
        for index, prompt in enumerate(prompts):
            inputs = chat_inputs(tokenizer, [prompt])
            names = list(methods)
            names = names[index % len(names):] + names[:index % len(names)]  # rotate the order per prompt
            outs = {}
            for name in names:
                out, seconds = _answer(model, inputs, args.new_tokens, **methods[name])
                outs[name] = out.sequences
                totals[name][0] += new_tokens(out.sequences, inputs["input_ids"].shape[1], tokenizer.eos_token_id)
                totals[name][1] += seconds
            for name in methods:
                same[name] += torch.equal(outs[name], outs["generate (stock)"])
        stock = totals["generate (stock)"][0] / totals["generate (stock)"][1]
        for name, (count, seconds) in totals.items():
            rate = count / seconds
            report.add(part="plain", case=kind, method=name, value=round(rate, 2), unit="tokens/s",
                       detail=f"{rate / stock:.2f}x stock generate; identical to it on {same[name]}/{len(prompts)}")


def _assistants(model, tokenizer, args, report, curve: dict[int, float]) -> None:
    from hf_kvspec.speculative.assistants import default_assistant
    from hf_kvspec.speculative.loop import speculative_generate

    specs = args.assistants.split(",")
    for kind in args.prompt_sets.split(","):
        prompts = load_prompts(kind, args.num_prompts)
        rows = {spec: dict(tokens=0, seconds=0.0, same=0, stats=[]) for spec in ["plain", *specs]}
        for index, prompt in enumerate(prompts):
            inputs = chat_inputs(tokenizer, [prompt])
            order = ["plain", *specs]
            order = order[index % len(order):] + order[:index % len(order)]
            outs = {}
            for spec in order:
                assistant = None if spec == "plain" else default_assistant(spec, model)
                out, seconds = _answer(model, inputs, args.new_tokens, custom_generate=speculative_generate,
                                       assistant=assistant)
                outs[spec] = out.sequences
                row = rows[spec]
                row["tokens"] += new_tokens(out.sequences, inputs["input_ids"].shape[1], tokenizer.eos_token_id)
                row["seconds"] += seconds
                row["stats"].append(out.acceptance)
            for spec in specs:
                rows[spec]["same"] += torch.equal(outs[spec], outs["plain"])
        _assistant_rows(report, kind, rows, len(prompts), curve)


def _assistant_rows(report, kind: str, rows: dict, count: int, curve: dict[int, float]) -> None:
    plain = rows["plain"]
    plain_rate = plain["tokens"] / plain["seconds"]
    step = statistics.median(s.verify_time_s / max(s.rounds, 1) for s in plain["stats"])  # one plain round
    report.add(part="assistants", case=kind, method="plain (fast forward)", value=round(plain_rate, 2),
               unit="tokens/s", detail=f"step {step * 1e3:.1f} ms")
    for spec, row in rows.items():
        if spec == "plain":
            continue
        stats = row["stats"]
        rate = row["tokens"] / row["seconds"]
        rounds = sum(s.rounds for s in stats)
        tau = sum(s.emitted_tokens for s in stats) / max(sum(s.row_rounds for s in stats), 1)
        nodes = statistics.median(n for s in stats for n in s.draft_lengths) if rounds else 0
        draft = sum(s.draft_time_s for s in stats) / max(rounds, 1) / step
        c_v = _interpolate(curve, int(nodes) + 1)
        bound = tau / (c_v + draft)
        report.add(part="assistants", case=kind, method=spec, value=round(rate / plain_rate, 3), unit="x plain",
                   detail=f"{rate:.2f} tokens/s; tau {tau:.2f}; N {nodes:g}; d {draft:.2f}; c_v(N+1) {c_v:.2f}; "
                          f"bound {bound:.2f}x; identical {row['same']}/{count}")


def _interpolate(curve: dict[int, float], tokens: int) -> float:
    points = sorted(curve)
    if tokens <= points[0]:
        return curve[points[0]]
    for low, high in itertools.pairwise(points):
        if tokens <= high:
            return curve[low] + (curve[high] - curve[low]) * (tokens - low) / (high - low)
    return curve[points[-1]] * tokens / points[-1]


# ------------------------------------------------------------------------------------------------ first call
_FIRST_CALL = """
import sys, time, torch, hf_kvspec
torch.set_num_threads(1)
model, tokenizer = hf_kvspec.load_bundled_model()
ids = tokenizer("The capital of France is", return_tensors="pt")
times = []
for _ in range(3):
    start = time.perf_counter()
    model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                   custom_generate=hf_kvspec.speculative_generate)
    times.append(time.perf_counter() - start)
print(" ".join(f"{t:.3f}" for t in times))
"""


def _first_call(report) -> None:
    for process in ("first process", "second process"):
        line = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[2]).stdout.split()
        first, *later = (float(x) for x in line)
        report.add(part="first-call", case=process, method="fast forward", value=round(first - min(later), 3),
                   unit="s extra", detail=f"first answer {first:.2f} s, later {min(later):.2f} s (16 tokens)")
