"""Long-context self-speculation (SparseKVAssistant) vs plain generate on the same cache, per context and batch.

    python scripts/benchmark.py longctx [--contexts 1024,4096] [--batch-sizes 1,4] [--new-tokens 32]

Prompts are the first ``context`` tokens of the longest documents of the offline ``python-docs`` corpus (row r: the
r-th longest document, continuous text). Each (context, batch) is prefilled once into a DynamicCache; every run
decodes from a copy of it, so prefill time is excluded and plain and speculative runs start from the same state.
Runs are interleaved across repeats (medians). Per configuration: tau (tokens per target forward), acceptance per
draft position, decode ratio vs plain generate, and the bound tau / (c_v(K+1) + K * c_d) with c_v(T) = target
forward of T tokens over this cache / one-token step and c_d = one draft step over the view / one-token step, both
measured in the same run; KV bytes from the formula (``kv_cache_bytes`` + the view's) and measured.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time

import torch
from transformers import DynamicCache

import hf_kvspec
from bench.harness import Report
from hf_kvspec.cache.views import StreamingView
from hf_kvspec.memory import kv_cache_bytes, quantized_view_bytes, sparse_view_bytes


def add_arguments(parser) -> None:
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (fixed-K runs)")
    parser.add_argument("--attention", choices=("kvspec_gqa", "sdpa"), default="kvspec_gqa",
                        help="the target's attention for plain and streaming runs (quantized runs use kvspec_quant). "
                             "sdpa copies K/V per query head (repeat_kv) whenever a mask comes with more than one "
                             "query, which makes every verify forward pay for it at long context")


def _prompts(tokenizer, context: int, batch: int) -> torch.Tensor:
    from hf_kvspec.corpus import corpus_files

    files = sorted(corpus_files("python-docs", "all"), key=lambda p: (-p.stat().st_size, str(p)))[:batch]
    rows = [tokenizer(p.read_text(errors="replace"))["input_ids"][:context] for p in files]
    if min(map(len, rows)) < context:
        raise SystemExit(f"the corpus' documents are shorter than {context} tokens")
    return torch.tensor(rows)


def _prefill(model, ids: torch.Tensor, chunk: int = 512) -> DynamicCache:
    """Cache of ``ids[:, :-1]`` (generate feeds the last prompt token itself), in chunks (bounded score memory)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for start in range(0, ids.shape[1] - 1, chunk):
            end = min(start + chunk, ids.shape[1] - 1)
            model(input_ids=ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"  # 1-minute load average (2 cores shared)


def _runs(args) -> dict:
    """name -> (assistant factory or None, sampling kwargs, quantized attention?)"""
    greedy, sample = dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=0)
    stream = dict(view="streaming", sink_tokens=args.sink_tokens, window=args.window)
    return {
        "plain/greedy": (None, greedy, False),
        "plain/sample": (None, sample, False),
        f"streaming/K={args.k}/greedy": (lambda: hf_kvspec.SparseKVAssistant(**stream, num_draft_tokens=args.k),
                                         greedy, False),
        "streaming/auto/greedy": (lambda: hf_kvspec.SparseKVAssistant(**stream, num_draft_tokens="auto"), greedy,
                                  False),
        f"streaming/K={args.k}/sample": (lambda: hf_kvspec.SparseKVAssistant(**stream, num_draft_tokens=args.k),
                                         sample, False),
        f"quantized/K={args.k}/greedy": (lambda: hf_kvspec.SparseKVAssistant(view="quantized", num_draft_tokens=args.k,
                                                                             sink_tokens=args.sink_tokens),
                                         greedy, True),
    }


def _decode(model, ids, cache, factory, sampling, new_tokens):
    assistant = factory() if factory else None
    extra = dict(custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                 return_dict_in_generate=True) if assistant else {}
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, **sampling, **extra)
    return time.perf_counter() - start, assistant, out.acceptance if assistant else None


def _step_costs(model, cache, ids, args, repeats: int = 5) -> dict:
    """Medians of a 1-token target step, a (K+1)-token verify forward (cropped after) and a draft step over the
    streaming view, interleaved, over this cache."""
    batch, length = ids.shape[0], cache.get_seq_length()
    times = {"step": [], "verify": [], "draft": []}
    root, positions = ids[:, -1:], torch.full((batch, 1), length)
    with torch.inference_mode():
        for _ in range(repeats):
            for name, count in (("step", 1), ("verify", args.k + 1)):
                start = time.perf_counter()
                model(input_ids=root.expand(-1, count), position_ids=positions + torch.arange(count), cache=cache,
                      use_cache=True, logits_to_keep=count)
                times[name].append(time.perf_counter() - start)
                cache.crop(-count)
            view = StreamingView(cache, torch.ones(batch, length, dtype=torch.long), args.sink_tokens, args.window)
            start = time.perf_counter()
            model(input_ids=root, attention_mask=view.attention_mask(1, model.dtype), position_ids=positions,
                  cache=view, use_cache=True, logits_to_keep=1)
            times["draft"].append(time.perf_counter() - start)
    step = statistics.median(times["step"])
    return {"step_s": step, "c_v": statistics.median(times["verify"]) / step,
            "c_d": statistics.median(times["draft"]) / step}


@contextlib.contextmanager
def _attention(model, name: str):
    """The model on attention ``name`` for the block (``sdpa``: as loaded), switched back afterwards."""
    enable = {"kvspec_gqa": hf_kvspec.enable_gqa, "kvspec_quant": hf_kvspec.enable_quantized_attention}.get(name)
    patch = enable(model) if enable is not None else None
    try:
        yield
    finally:
        if patch is not None:
            patch.remove()


def _measure(model, tokenizer, context, batch, args, report) -> None:
    ids = _prompts(tokenizer, context, batch)
    load_before = _load()
    base = _prefill(model, ids)
    with _attention(model, args.attention):
        costs = _step_costs(model, base, ids, args)
    runs, samples, stats = _runs(args), {}, {}
    for _ in range(args.repeats):
        for name, (factory, sampling, quantized) in runs.items():
            cache = copy.deepcopy(base)
            with _attention(model, "kvspec_quant" if quantized else args.attention):
                seconds, assistant, acc = _decode(model, ids, cache, factory, sampling, args.new_tokens)
            samples.setdefault(name, []).append(seconds)
            stats[name] = (assistant, acc, _cache_bytes(cache))
    config = model.config
    for name, seconds in samples.items():
        assistant, acc, measured = stats[name]
        plain = statistics.median(samples["plain/sample" if name.endswith("sample") else "plain/greedy"])
        row = dict(context=context, batch=batch, run=name, seconds=statistics.median(seconds),
                   ratio=plain / statistics.median(seconds), kv_formula=kv_cache_bytes(
                       config, context + args.new_tokens - 1, batch, torch.float32), kv_measured=measured)
        if assistant is not None:
            k = args.k
            row.update(tau=acc.tokens_per_target_forward, acceptance=[round(a, 2) for a in acc.acceptance_rate],
                       mean_k=sum(acc.draft_lengths) / max(len(acc.draft_lengths), 1),
                       bound=acc.tokens_per_target_forward / (costs["c_v"] + k * costs["c_d"]) if "K=" in name
                       else None)
            if name.startswith("quantized"):
                row.update(view_formula=quantized_view_bytes(config, context + args.new_tokens - 1, batch,
                                                             torch.float32, sink_tokens=args.sink_tokens),
                           view_measured=assistant.view_bytes())
            else:
                row.update(view_formula=sparse_view_bytes(config, batch, args.sink_tokens, args.window, k,
                                                          torch.float32))
        row.update(c_v=costs["c_v"], c_d=costs["c_d"], step_ms=1000 * costs["step_s"], load=f"{load_before} -> "
                   f"{_load()}")
        report.add(**row)


def run(args) -> None:
    model, tokenizer = hf_kvspec.load_bundled_model(attn_implementation="sdpa")
    report = Report(
        "longctx", "Long-context self-speculation: SparseKVAssistant vs plain generate (DynamicCache, fp32)",
        ["context", "batch", "run", "ratio", "tau", "acceptance", "bound", "c_v", "c_d", "step_ms",
         "kv_formula", "kv_measured", "view_formula", "view_measured", "load"],
        settings={k: v for k, v in vars(args).items() if k != "func"})
    report.notes += ["ratio = plain generate seconds / this run's seconds (same cache type, same decode length, "
                     "prefill excluded); bound = tau / (c_v(K+1) + K c_d), c_v and c_d measured in this run",
                     "load = 1-minute load average before the configuration -> after it (2 shared cores)",
                     "view_measured = the quantized shadow at the end of the call (it is synced at the start of each "
                     "round, so it lags the final tokens); view_formula = hf_kvspec.memory at the final length"]
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            print(f"context {context}, batch {batch}", flush=True)
            _measure(model, tokenizer, context, batch, args, report)
            report.write()  # after each configuration: a partial run still leaves results
