"""Long-context self-speculation (SparseKVAssistant) vs plain generate, prefill and decode measured apart.

    python scripts/benchmark.py longctx [--contexts 4096,8192] [--batch-sizes 1,4] [--new-tokens 48,256]
                                        [--methods plain,streaming,quantized,auto] [--max-load 1.5]

Prompts are the first ``context`` tokens of the longest documents of the offline ``python-docs`` corpus (row r: the
r-th longest document, continuous text). The model is loaded as a new user loads it (``sdpa``); every run is greedy,
``max_new_tokens = min_new_tokens = max(--new-tokens)``, timed by a streamer that stamps every new column.

Per (context, batch) cell:
    prefill   the ``plain`` run is ``generate`` from an empty ``DynamicCache``: its time to first token (TTFT) is
              the prefill. The prefill is the same target forward for every method (the speculative loop's
              prefill is one target forward over the prompt), so it is measured once: the plain run's cache,
              cropped back to the prompt minus its last token, is deep-copied for every other method, which
              then feeds the last prompt token only.
    decode    time per output token (TPOT) = (time of the last new column - time of the first) / (n - 1), per
              method; ``ratio_decode`` = plain TPOT / the method's.
    e2e(n)    for each n of ``--new-tokens``: plain: its time to the n-th column; other methods: plain's TTFT +
              their time from the first to the n-th column. The first n columns of a greedy run do not depend on
              how many follow, so the smaller n are read from the same run.
Speculative telemetry: tau (tokens per target forward), mean draft length, acceptance per position.

Bytes per step beside each ratio (``hf_kvspec.speculative.drafters.view_costs``): weights W, the target's K/V
(B x S columns) and the K/V a draft step reads (the view), and the byte bound ``tau / (1 + K * c_d_bytes)`` with
``c_d_bytes = (W + view) / (W + 3 * target K/V)``: a ``DynamicCache`` step reads its K/V in attention and copies it
(read + write) when ``update`` concatenates. Beside it the measured bound ``tau / (c_v + K * c_d)``: c_v = a
(K + 1)-token forward over the cell's cache / a one-token step, c_d = a draft step over the streaming view / a
one-token step as plain ``generate`` runs it (medians of 3, interleaved); the verify and draft forwards run as
the speculative call runs them (``kvspec_gqa``, the decode kernels where several rows share a forward).

Load: the 1-minute load average before and after every run; before each run the benchmark waits (up to
``--load-wait`` seconds) for it to fall below ``--max-load``, and records what it saw.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

import hf_kvspec
from bench.harness import Report, load_average, wait_until_quiet
from hf_kvspec.cache.views import StreamingView
from hf_kvspec.memory import kv_cache_bytes, quantized_view_bytes, sparse_view_bytes
from hf_kvspec.speculative.drafters.view_costs import ViewBytes, model_weight_bytes

METHODS = ("plain", "streaming", "quantized", "auto")
MB = 2**20


def add_arguments(parser) -> None:
    parser.add_argument("--contexts", default="4096,8192")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--new-tokens", default="48,256", help="comma list; one run decodes the largest")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round of the fixed-K methods")
    parser.add_argument("--max-load", type=float, default=1.5, help="wait for the 1-minute load to fall below this")
    parser.add_argument("--load-wait", type=float, default=300, help="seconds to wait for --max-load at most")
    parser.add_argument("--results-name", default="longctx")
    parser.add_argument("--validate-e2e", action="store_true",
                        help="also run `auto` end to end from an empty cache, to check the prefill accounting")


# ---------------------------------------------------------------------------------------------------- timing
class ColumnTimer(BaseStreamer):
    """Stamps every new column: plain ``generate`` puts the prompt (2-D) first, then one column per step (1-D
    [B]); the speculative loop puts, at batch 1, one or more new tokens at once, at batch > 1 one column that
    every row has completed per put. ``times[n - 1]`` is when the n-th new column arrived."""

    def __init__(self, batch: int):
        self.batch, self.times = batch, []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if value.dim() > 1:  # the prompt
            return
        self.times += [now] * (value.numel() if self.batch == 1 else 1)

    def end(self) -> None:
        pass

    def time_to(self, n: int, start: float) -> float:
        return self.times[n - 1] - start


# ---------------------------------------------------------------------------------------------------- runs
def _prompts(tokenizer, context: int, batch: int) -> torch.Tensor:
    """[batch, context] ids: the first ``context`` tokens of the ``batch`` longest python-docs documents."""
    from hf_kvspec.corpus import corpus_files

    files = sorted(corpus_files("python-docs", "all"), key=lambda p: (-p.stat().st_size, str(p)))[:batch]
    rows = [tokenizer(p.read_text(errors="replace"))["input_ids"][:context] for p in files]
    if min(map(len, rows)) < context:
        raise SystemExit(f"the corpus' documents are shorter than {context} tokens")
    return torch.tensor(rows)


def _assistant(method: str, args):
    """The assistant of ``method`` (None for plain): fixed K for streaming/quantized; ``auto`` is the drafter a
    new user would pick for long contexts, with the benchmark's view settings."""
    view = dict(sink_tokens=args.sink_tokens)
    if method == "streaming":
        return hf_kvspec.SparseKVAssistant(view="streaming", window=args.window, num_draft_tokens=args.k, **view)
    if method == "quantized":
        return hf_kvspec.SparseKVAssistant(view="quantized", num_draft_tokens=args.k, **view)
    if method == "auto":
        return hf_kvspec.SparseKVAssistant(view="streaming", window=args.window, num_draft_tokens="auto", **view)
    return None


def _generate(model, ids, cache, assistant, new_tokens: int):
    """One greedy call timed column by column: (sequences [B, P + n], timer, start, output or None)."""
    timer = ColumnTimer(ids.shape[0])
    extra = dict(custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                 return_dict_in_generate=True) if assistant is not None else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=timer, **extra)
    sequences = out.sequences if assistant is not None else out
    return sequences, timer, start, out if assistant is not None else None


def _warm_up(model, ids: torch.Tensor) -> None:
    """Short speculative calls at this batch size (the last 96 columns of ``ids`` [B, P]) with 1, 3 and 4 drafts,
    and a plain one: the decode kernels time a row count's kernel once (then remembered in their plans file) and
    pack weight copies once per process; verify forwards of B (K + 1) rows reach every bucket the runs use. Those
    one-time costs are not what a long run's decode costs."""
    ids = ids[:, -96:]
    for k in (1, 3, 4):
        _generate(model, ids, None, hf_kvspec.SparseKVAssistant(window=32, num_draft_tokens=k), 12)
    _generate(model, ids, None, None, 4)


def _step_costs(model, cache, ids, args) -> dict:
    """Medians of 3 interleaved, over ``cache``: a one-token target step as plain ``generate`` runs it (stock
    kernels), and as the speculative call runs them (``kvspec_gqa``, the decode kernels wherever several rows
    share a forward) a (K + 1)-token verify forward (cropped after) and a draft step over the streaming view."""
    from hf_kvspec.kernels.linear import DecodeKernels, default_plans_file

    batch, length = ids.shape[0], cache.get_seq_length()
    times = {"step": [], "verify": [], "draft": []}
    root, positions = ids[:, -1:], torch.full((batch, 1), length)

    def routed(rows: int):
        return kernels.routing() if rows > 1 else contextlib.nullcontext()

    with torch.inference_mode(), DecodeKernels(model, route_on_enter=False, plans_file=default_plans_file()) as kernels:
        for _ in range(3):
            for name, count in (("step", 1), ("verify", args.k + 1)):
                with contextlib.ExitStack() as scope:
                    if name == "verify":
                        scope.enter_context(hf_kvspec.enable_gqa(model))
                        scope.enter_context(routed(count * batch))
                    start = time.perf_counter()
                    model(input_ids=root.expand(-1, count), position_ids=positions + torch.arange(count),
                          cache=cache, use_cache=True, logits_to_keep=count)
                    times[name].append(time.perf_counter() - start)
                cache.crop(-count)
            view = StreamingView(cache, torch.ones(batch, length, dtype=torch.long), args.sink_tokens, args.window)
            with hf_kvspec.enable_gqa(model), routed(batch):
                start = time.perf_counter()
                model(input_ids=root, attention_mask=view.attention_mask(1, model.dtype), position_ids=positions,
                      cache=view, use_cache=True, logits_to_keep=1)
                times["draft"].append(time.perf_counter() - start)
    step = statistics.median(times["step"])
    return {"step_ms": 1000 * step, "c_v": statistics.median(times["verify"]) / step,
            "c_d": statistics.median(times["draft"]) / step}


def _bytes(model, method: str, context: int, batch: int, args) -> ViewBytes:
    """Bytes per forward of ``method`` at this cell (fp32 weights and K/V; view_costs' model)."""
    config, dtype = model.config, torch.float32
    target = kv_cache_bytes(config, context, batch, dtype)
    if method == "quantized":
        view = quantized_view_bytes(config, context, batch, dtype, sink_tokens=args.sink_tokens)
    elif method in ("streaming", "auto"):
        view = sparse_view_bytes(config, batch, args.sink_tokens, args.window, args.k, dtype)
    else:
        view = 0
    return ViewBytes(model_weight_bytes(model), target, view, touches=3)


# ---------------------------------------------------------------------------------------------------- a cell
def _measure(model, ids: torch.Tensor, args, report: Report) -> list[dict]:
    """One cell, prompts ``ids`` [B, P]: adds (and returns) a row per method (+ the validation row)."""
    batch, context = ids.shape
    counts = sorted(map(int, args.new_tokens.split(",")))
    new_tokens = counts[-1]
    methods = [m.strip() for m in args.methods.split(",")]
    _warm_up(model, ids)
    rows = []

    load_before = wait_until_quiet(args.max_load, args.load_wait)
    cache = DynamicCache(config=model.config)
    plain_ids, timer, start, _ = _generate(model, ids, cache, None, new_tokens)
    prefill_s = timer.time_to(1, start)
    plain = _phase_times(timer, start, counts, prefill_s, own_prefill=True)
    plain_load = f"{load_before:.2f} -> {load_average():.2f}"
    cache.crop(ids.shape[1] - 1 - cache.get_seq_length())  # the prompt minus its last token: every other method's start
    costs = _step_costs(model, cache, ids, args)
    print(f"  prefill {prefill_s:.1f} s; step {costs['step_ms']:.0f} ms, c_v {costs['c_v']:.2f}, "
          f"c_d {costs['c_d']:.2f}", flush=True)

    for method in methods:
        if method == "plain":
            times, load, out, same = plain, plain_load, None, True
        else:
            load_before = wait_until_quiet(args.max_load, args.load_wait)
            sequences, timer, start, out = _generate(model, ids, copy.deepcopy(cache), _assistant(method, args),
                                                     new_tokens)
            times = _phase_times(timer, start, counts, prefill_s, own_prefill=False)
            load, same = f"{load_before:.2f} -> {load_average():.2f}", torch.equal(sequences, plain_ids)
            if not same:
                print(f"  WARNING: {method} differs from plain greedy at {context} x {batch}", flush=True)
        rows.append(_row(model, method, context, batch, args, times, plain, out, costs, same, load, prefill_s))
        report.add(**rows[-1])
    if args.validate_e2e:
        rows.append(_validate(model, ids, args, new_tokens, counts, plain))
        report.add(**rows[-1])
    return rows


def _phase_times(timer: ColumnTimer, start: float, counts: list[int], prefill_s: float, own_prefill: bool) -> dict:
    """TPOT over the decode phase and e2e(n) for each n (module docstring)."""
    first = timer.time_to(1, start)
    last = timer.time_to(counts[-1], start)
    e2e = {n: timer.time_to(n, start) if own_prefill else prefill_s + timer.time_to(n, start) - first
           for n in counts}
    return {"tpot_ms": 1000 * (last - first) / (counts[-1] - 1), "e2e": e2e}


def _row(model, method, context, batch, args, times, plain, out, costs, same, load, prefill_s) -> dict:
    row = dict(context=context, batch=batch, method=method, tpot_ms=times["tpot_ms"],
               ratio_decode=plain["tpot_ms"] / times["tpot_ms"], prefill_s=prefill_s)
    for n, seconds in times["e2e"].items():
        row[f"e2e_{n}_s"] = seconds
        row[f"ratio_e2e_{n}"] = plain["e2e"][n] / seconds
    read = _bytes(model, method, context, batch, args)
    row.update(weights_mb=read.weights / MB, target_kv_mb=read.target_kv / MB, draft_kv_mb=read.view_kv / MB)
    if out is not None:
        acc = out.acceptance
        lengths = acc.draft_lengths or [0]
        mean_k = sum(lengths) / len(lengths)
        tau = acc.tokens_per_target_forward
        row.update(tau=tau, mean_k=mean_k, acceptance=[round(a, 2) for a in acc.acceptance_rate[:6]],
                   bound=tau / (costs["c_v"] + mean_k * costs["c_d"]), bound_bytes=read.bound(tau, mean_k),
                   draft_s=acc.draft_time_s, verify_s=acc.verify_time_s)
    row.update(c_v=costs["c_v"], c_d=costs["c_d"], step_ms=costs["step_ms"], same_as_plain=same, load=load)
    return row


def _validate(model, ids, args, new_tokens, counts, plain) -> dict:
    """``auto`` end to end from an empty cache (its own prefill): checks the shared-prefill accounting."""
    load_before = wait_until_quiet(args.max_load, args.load_wait)
    _, timer, start, out = _generate(model, ids, None, _assistant("auto", args), new_tokens)
    times = _phase_times(timer, start, counts, 0.0, own_prefill=True)
    row = dict(context=ids.shape[1], batch=ids.shape[0], method="auto (own prefill)", tpot_ms=times["tpot_ms"],
               ratio_decode=plain["tpot_ms"] / times["tpot_ms"], prefill_s=timer.time_to(1, start),
               tau=out.acceptance.tokens_per_target_forward, load=f"{load_before:.2f} -> {load_average():.2f}")
    for n in counts:
        row[f"e2e_{n}_s"] = times["e2e"][n]
        row[f"ratio_e2e_{n}"] = plain["e2e"][n] / times["e2e"][n]
    return row


def _check(args) -> list[int]:
    """The sorted ``--new-tokens``; refuses unknown methods or fewer than 2 new tokens."""
    counts = sorted(map(int, args.new_tokens.split(",")))
    unknown = set(m.strip() for m in args.methods.split(",")) - set(METHODS)
    if unknown or counts[0] < 2:
        raise SystemExit(f"--methods takes {', '.join(METHODS)} (got {sorted(unknown)}); --new-tokens >= 2")
    return counts


def make_report(args) -> Report:
    counts = _check(args)
    e2e_columns = [c for n in counts for c in (f"e2e_{n}_s", f"ratio_e2e_{n}")]
    report = Report(
        args.results_name, "Long-context self-speculation vs plain generate: prefill and decode (fp32, greedy)",
        ["context", "batch", "method", "prefill_s", "tpot_ms", "ratio_decode", *e2e_columns, "tau", "mean_k",
         "acceptance", "bound", "bound_bytes", "c_v", "c_d", "weights_mb", "target_kv_mb", "draft_kv_mb",
         "same_as_plain", "load"],
        settings={k: v for k, v in vars(args).items() if k != "func"})
    report.notes += [
        "prefill_s = plain generate's time to first token (one target forward over the prompt, the same for every "
        "method: measured once per cell; the other methods decode from a copy of that cache)",
        "tpot_ms = decode-phase time per output token (first new column to the last); ratio_decode = plain tpot / "
        "this tpot",
        f"e2e_n_s = prefill + time from the first to the n-th new column (n in {counts}, all read from one "
        f"{counts[-1]}-token run); ratio_e2e_n = plain / this; 'auto (own prefill)' runs auto from an empty cache",
        "bound = tau / (c_v + K c_d) with c_v, c_d measured in this cell (K = mean draft length); bound_bytes = tau "
        "/ (1 + K c_d_bytes), c_d_bytes = (W + draft_kv) / (W + 3 target_kv) (DynamicCache: attention read + "
        "append copy); MB = 2^20 bytes",
        "load = 1-minute load average before the run -> after it (2 cores; runs wait for it to fall below "
        f"{args.max_load})",
        "plain = generate as loaded (sdpa, stock kernels); speculative calls switch to kvspec_gqa for the call "
        "(call_attention) and run several-row forwards through the decode kernels, so auto with K = 0 can beat plain",
    ]
    return report


def run(args) -> None:
    report = make_report(args)
    model, tokenizer = hf_kvspec.load_bundled_model(attn_implementation="sdpa")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            print(f"context {context}, batch {batch}", flush=True)
            _measure(model, _prompts(tokenizer, context, batch), args, report)
            report.write()  # after each cell: a partial run still leaves results
