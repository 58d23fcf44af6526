"""Quantized KV caches on real text: Δppl through the cache, bytes at 4k tokens, decode speed, greedy agreement.

    python scripts/benchmark.py kvquant --sections ppl bytes   # the committed run, in three parts of
    python scripts/benchmark.py kvquant --sections speed --decode-steps 32  # 3-7 min each (one CPU thread); a partial run
    python scripts/benchmark.py kvquant --sections greedy      # keeps the other sections' columns from the file
    python scripts/benchmark.py kvquant --quick                # smoke run (~1 min, all sections)

Model: the bundled SmolLM2-135M-Instruct (fp32). Text: held-out files of the ``python-docs`` corpus (Python 3.11
documentation, reST, from Debian's python3.11-doc; ``hf_kvspec.corpus``). Every cache is compared with
DynamicCache measured in the same run. Our caches are read by the fused ``kvspec_quant`` attention (scores from
the codes); ``kivi4-dequant`` is the same KIVI-4 cache read by SDPA over its dequantized copy (the reference
path); DynamicCache and transformers' QuantizedCache use SDPA.

* perplexity: teacher-forced *decoding* — prefill ``--prefix`` tokens, then feed the rest of each segment in
  chunks of ``--chunk`` tokens, so every predicted token attends to a quantized history (the window holds the
  newest 128 tokens); scored token by token against DynamicCache's logits at the same positions by the
  ``cache_fidelity`` metric (``hf_kvspec.load_metric``): perplexity, mean KL(full || cache), top-1 agreement;
* bytes: ``nbytes()`` of a cache filled with 4096 tokens, vs DynamicCache in fp32 (the bundled model's dtype)
  and in fp16 (the usual serving dtype; the window is then fp16 too); checked against ``kv_cache_bytes``;
* decode speed: greedy single-token steps after a ``--context``-token real-text prompt, for DynamicCache,
  ours and transformers' ``QuantizedCache`` (quanto backend, same bits / group / residual) when installed;
* agreement: greedy continuations of ``--new-tokens`` tokens for ``--prompts`` real-text prompts (one left-padded
  batch), position-wise token agreement and mean first-divergence index vs DynamicCache.
"""

from __future__ import annotations

import time

import torch

from bench.harness import Report, save_plot

# name -> QuantizedKVCache settings (the CLI's --cache names); kivi2 uses the paper's group 32
CACHES = {
    "kivi4": dict(method="kivi", bits=4, group_size=64, residual_length=128),
    "kivi4-dequant": dict(method="kivi", bits=4, group_size=64, residual_length=128),
    "kivi2": dict(method="kivi", bits=2, group_size=32, residual_length=128),
    "kivi2-sinks": dict(method="kivi", bits=2, group_size=32, residual_length=128, sink_tokens=4),
    "int8": dict(method="int8"),
    "fp8": dict(method="fp8"),
}
TARGETS = {"kivi4": (3.4, 1.0), "kivi2": (5.0, 5.0)}  # (min bytes ratio vs fp16, max Δppl %)
SECTIONS = ("ppl", "bytes", "speed", "greedy")


def _attention(name: str) -> str:
    """The attention implementation a cache is measured with (see the module docstring)."""
    return "kvspec_quant" if name in CACHES and name != "kivi4-dequant" else "sdpa"


def _use_attention(model, name: str) -> None:
    from hf_kvspec import _compat

    if _compat.attn_implementation(model.config) != _attention(name):
        model.set_attn_implementation(_attention(name))


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="what to measure; columns of the other sections are kept from the existing results file")
    parser.add_argument("--segments", type=int, default=2, help="perplexity segments (one per document)")
    parser.add_argument("--segment-len", type=int, default=768)
    parser.add_argument("--prefix", type=int, default=128, help="tokens prefilled before chunked decoding")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per teacher-forced decoding forward")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096],
                        help="cached tokens when timing decode steps")
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per cache and context "
                        "(transformers' QuantizedCache gets residual_length + 2, so that one of its flushes is timed)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=192, help="longest prompt (rows are 50-100%% of it)")
    parser.add_argument("--new-tokens", type=int, default=128)


def run(args) -> None:
    if args.quick:
        args.segments, args.segment_len, args.prefix, args.contexts = 1, 320, 128, [256]
        args.decode_steps, args.prompts, args.prompt_len, args.new_tokens = 4, 4, 64, 16
    from hf_kvspec import load_bundled_model
    from hf_kvspec.attention.quantized import register_quantized_attention
    from hf_kvspec.corpus import load_text_corpus

    register_quantized_attention()
    model, tokenizer = load_bundled_model()
    docs = [tokenizer(text, return_tensors="pt").input_ids[0] for text in load_text_corpus("python-docs", "test")["text"]]
    report = Report("kvquant", "Quantized KV caches on real text (bundled SmolLM2-135M, python-docs test split)",
                    ["cache", "settings", "ppl", "Δppl %", "KL mean", "top-1 agreement", "bytes ratio vs fp16",
                     "bytes ratio vs fp32",
                     *[f"{metric} @{ctx}" for ctx in args.contexts
                       for metric in ("ms/token", "speed vs dynamic", "speed vs quanto")],
                     "greedy agreement", "first divergence"])
    report.notes.append("2-core CPU, torch threads = 1; caches take turns within each context, so compare ratios "
                        "within a run (absolute times drift when other jobs share the machine). Each section's "
                        "date is below; sections measured in different runs are merged.")
    segments = _segments(docs, args.segments, args.segment_len) if "ppl" in args.sections else []
    with torch.inference_mode():
        rows = _measure_all(model, docs, segments, args, report)
    rows, report.settings = _merge_previous(rows, args)
    for section, run_info in report.settings["section_runs"].items():
        report.notes.append(f"section {section}: measured {run_info['date']}")
    for row in rows:
        report.add(**row)
    _target_notes(report, rows)
    report.write()
    save_plot("kvquant", lambda fig: _draw(fig, rows))


# ---------------------------------------------------------------------------------------------------- caches
def _make(name, config):
    from transformers import DynamicCache

    from hf_kvspec.cache.quantized import QuantizedKVCache

    if name == "dynamic":
        return DynamicCache(config=config)
    if name == "quanto-kivi4":
        from transformers import QuantizedCache

        s = CACHES["kivi4"]
        return QuantizedCache("quanto", config, nbits=s["bits"], q_group_size=s["group_size"],
                              residual_length=s["residual_length"])
    return QuantizedKVCache(config, **CACHES[name])


def _quanto_status(config) -> str | None:
    """None when transformers' quanto-backed QuantizedCache works here, else why not."""
    try:
        _make("quanto-kivi4", config)
        import optimum.quanto  # noqa: F401
    except (ImportError, RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _measure_all(model, docs, segments, args, report) -> list[dict]:
    quanto_error = _quanto_status(model.config)
    if quanto_error:
        report.notes.append(f"transformers QuantizedCache (quanto) unavailable, not compared: {quanto_error}")
    names = ["dynamic", *CACHES] + ([] if quanto_error else ["quanto-kivi4"])
    rows = {name: {"cache": name, "settings": _describe(name)} for name in names}
    if "ppl" in args.sections:
        print(f"perplexity on {len(segments)} segments of {args.segment_len} tokens", flush=True)
        for name, result in _fidelity(model, segments, names, args).items():
            rows[name].update({"ppl": result["perplexity"], "Δppl %": result["delta_perplexity_percent"],
                               "KL mean": result["kl_divergence"], "top-1 agreement": result["top1_agreement"]})
    if "bytes" in args.sections:
        for name in ["dynamic", *CACHES]:
            fp16, fp32 = _bytes_ratios(model.config, name)
            rows[name].update({"bytes ratio vs fp16": fp16, "bytes ratio vs fp32": fp32})
    if "speed" in args.sections:
        print("decode speed", flush=True)
        for ctx, times in _decode_speeds(model, _prompt(docs, max(args.contexts)), names, args).items():
            for name in names:
                rows[name].update({
                    f"ms/token @{ctx}": 1000 * times[name], f"speed vs dynamic @{ctx}": times["dynamic"] / times[name],
                    f"speed vs quanto @{ctx}": times["quanto-kivi4"] / times[name] if "quanto-kivi4" in times else None})
    if "greedy" in args.sections:
        print("greedy agreement", flush=True)
        batch = _prompt_batch(docs, args.prompts, args.prompt_len)
        greedy = {name: _greedy(model, batch, name, args.new_tokens) for name in ["dynamic", *CACHES]}
        for name in greedy:
            agreement, divergence = _agreement(greedy[name], greedy["dynamic"], batch[0].shape[1])
            rows[name].update({"greedy agreement": agreement, "first divergence": divergence})
    return list(rows.values())


def _section_of(column: str) -> str | None:
    if column in ("ppl", "Δppl %", "KL mean", "top-1 agreement"):
        return "ppl"
    if column.startswith("bytes ratio"):
        return "bytes"
    if column.startswith(("ms/token", "speed vs")):
        return "speed"
    return "greedy" if column in ("greedy agreement", "first divergence") else None


def _merge_previous(rows: list[dict], args) -> tuple[list[dict], dict]:
    """Fill the columns of sections not measured now from the existing results file; return (rows, settings)
    where settings["section_runs"] records, per section, the date and options of the run that measured it."""
    import json
    import time as _time

    from bench.harness import RESULTS_DIR

    options = {k: v for k, v in vars(args).items() if k not in ("func", "sections")}
    runs = {section: {"date": _time.strftime("%Y-%m-%d %H:%M"), "options": options} for section in args.sections}
    path = RESULTS_DIR / "kvquant.json"
    if set(args.sections) == set(SECTIONS) or args.quick or not path.exists():
        return rows, {"section_runs": runs}
    previous = json.loads(path.read_text())
    old_runs = previous.get("settings", {}).get("section_runs", {})
    old_rows = {row["cache"]: row for row in previous["rows"]}
    kept = [section for section in SECTIONS if section not in args.sections]
    for row in rows:
        for column, value in old_rows.get(row["cache"], {}).items():
            if _section_of(column) in kept:
                row[column] = value
    return rows, {"section_runs": {**{s: r for s, r in old_runs.items() if s not in runs}, **runs}}


def _describe(name: str) -> str:
    if name == "dynamic":
        return "full precision"
    if name == "quanto-kivi4":
        return "transformers QuantizedCache(quanto), 4 bit, group 64, residual 128"
    read = "fused kvspec_quant attention" if _attention(name) == "kvspec_quant" else "SDPA on the dequantized copy"
    return ", ".join(f"{k}={v}" for k, v in CACHES[name].items()) + f"; {read}"


# ---------------------------------------------------------------------------------------------------- measurements
def _segments(docs, count: int, length: int) -> list[torch.Tensor]:
    long_docs = [d[:length] for d in docs if d.shape[0] >= length]
    if len(long_docs) < count:
        raise RuntimeError(f"only {len(long_docs)} test documents have {length} tokens; lower --segment-len.")
    return [d[None] for d in long_docs[:count]]  # [1, L] each


def _fidelity(model, segments, names, args) -> dict[str, dict]:
    """{cache: ``cache_fidelity`` result}: every cache decodes each segment the same way as DynamicCache, and each
    predicted token is scored against DynamicCache's logits there (DynamicCache against itself: KL 0)."""
    from hf_kvspec.metrics import load_metric, token_statistics

    metrics = {name: load_metric("cache_fidelity", keep_in_memory=True) for name in names}
    for ids in segments:
        reference = _decoding_logits(model, ids, "dynamic", args)                        # [1, L - prefix, V]
        for name in names:
            logits = reference if name == "dynamic" else _decoding_logits(model, ids, name, args)
            metrics[name].add_batch(**token_statistics(logits, reference, ids[:, args.prefix:]))
    results = {name: metric.compute() for name, metric in metrics.items()}
    for name, result in results.items():
        print(f"  {name}: ppl {result['perplexity']:.4f}, KL {result['kl_divergence']:.5f}, "
              f"top-1 {result['top1_agreement']:.4f}", flush=True)
    return results


def _decoding_logits(model, ids, name, args) -> torch.Tensor:
    """Logits [1, L - prefix, V] that predict ``ids[:, prefix:]``: prefill the prefix, then decode the rest of the
    segment [1, L] chunk by chunk through cache ``name``."""
    _use_attention(model, name)
    cache = _make(name, model.config)
    logits = [model(ids[:, :args.prefix], cache=cache).logits[:, -1:]]
    for start in range(args.prefix, ids.shape[1], args.chunk):
        logits.append(model(ids[:, start:start + args.chunk], cache=cache).logits)
    return torch.cat(logits, dim=1)[:, :-1]  # the segment's last position predicts past its end


def _prompt(docs, length: int) -> torch.Tensor:
    text = torch.cat(docs[::-1])  # starts with documents not used for perplexity
    if text.shape[0] < length:
        raise RuntimeError(f"not enough held-out text for a {length}-token prompt; lower --contexts.")
    return text[None, :length]


def _decode_speeds(model, prompt, names, args) -> dict[int, dict[str, float]]:
    """{context: {cache: seconds per greedy single-token step}}.

    One DynamicCache prefill of the longest context; every cache is then filled from its keys/values with one
    ``update`` per layer (what its own prefill would store, minus the prefill forward, which is not timed).
    The caches take turns in rounds of steps, so that load changes on the shared machine hit all of them."""
    from transformers import DynamicCache

    full = DynamicCache(config=model.config)
    model(prompt, cache=full)
    out = {}
    for ctx in args.contexts:
        caches, tokens, seconds, steps = {}, {}, dict.fromkeys(names, 0.0), {}
        for name in names:
            _use_attention(model, name)  # a cache pairs with the attention the model runs when it is built
            caches[name] = _make(name, model.config)
            for idx, layer in enumerate(full.layers):
                caches[name].update(layer.keys[:, :, :ctx], layer.values[:, :, :ctx], idx)
            tokens[name] = prompt[:, ctx - 1:ctx]
            steps[name] = args.decode_steps if name != "quanto-kivi4" else CACHES["kivi4"]["residual_length"] + 2
        rounds = 4
        for r in range(rounds):
            for name in names:
                count = steps[name] // rounds + (steps[name] % rounds if r == rounds - 1 else 0)
                _use_attention(model, name)
                start = time.perf_counter()
                for _ in range(count):
                    tokens[name] = model(tokens[name], cache=caches[name]).logits[:, -1:].argmax(-1)
                seconds[name] += time.perf_counter() - start
        out[ctx] = {name: seconds[name] / steps[name] for name in names}
        print("  " + "  ".join(f"{name}@{ctx}: {1000 * t:.1f} ms" for name, t in out[ctx].items()), flush=True)
    return out


def _prompt_batch(docs, count: int, length: int):
    """(input_ids, attention_mask) [count, length]: one prompt per document, cut at a random-but-seeded
    offset and length in [length/2, length], left padded (rows of uneven length, as in real batches)."""
    gen = torch.Generator().manual_seed(0)
    usable = [d for d in docs if d.shape[0] >= 2 * length][:count]
    if len(usable) < count:
        raise RuntimeError(f"only {len(usable)} documents are long enough for {count} prompts; lower --prompts.")
    ids = torch.zeros(count, length, dtype=torch.long)
    mask = torch.zeros(count, length, dtype=torch.long)
    for row, doc in enumerate(usable):
        size = int(torch.randint(length // 2, length + 1, (), generator=gen))
        offset = int(torch.randint(0, doc.shape[0] - size + 1, (), generator=gen))
        ids[row, length - size:] = doc[offset:offset + size]
        mask[row, length - size:] = 1
    return ids, mask


def _greedy(model, batch, name, new_tokens: int) -> torch.Tensor:
    ids, mask = batch
    _use_attention(model, name)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=0, cache=_make(name, model.config))
    print(f"  {name}: generated {out.shape[1] - ids.shape[1]} tokens x {ids.shape[0]} prompts", flush=True)
    return out


def _agreement(tokens, reference, prompt_len: int):
    """(share of positions with the same token, mean index of the first differing token) over new tokens."""
    if tokens is None:
        return None, None
    new, ref = tokens[:, prompt_len:], reference[:, prompt_len:]
    same = new == ref
    first = torch.where(same.all(1), same.shape[1], (~same).int().argmax(1))
    return same.float().mean().item(), first.float().mean().item()


def _bytes_ratios(config, name: str):
    """DynamicCache bytes / this cache's measured bytes at 4096 tokens, for fp16 and fp32 storage."""
    from hf_kvspec.memory import kv_cache_bytes

    ratios = []
    for dtype in (torch.float16, torch.float32):
        dense = kv_cache_bytes(config, 4096, dtype=dtype)
        ratios.append(dense / _filled_nbytes(config, name, dtype, 4096))
    return tuple(ratios)


def _filled_nbytes(config, name: str, dtype, tokens: int) -> int:
    """nbytes() of a cache filled with random states (checked against kv_cache_bytes)."""
    from hf_kvspec.memory import head_dim, kv_cache_bytes, num_kv_heads

    if name == "dynamic":
        return kv_cache_bytes(config, tokens, dtype=dtype)
    cache = _make(name, config)
    shape = (1, num_kv_heads(config), tokens, head_dim(config))
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), layer)
    sinks = cache.settings.sink_tokens  # kept at full precision, ahead of the windowed/quantized tokens
    expected = kv_cache_bytes(config, tokens - sinks, dtype=dtype, **cache.settings.memory_kwargs()) + \
        kv_cache_bytes(config, sinks, dtype=dtype)
    if cache.nbytes() != expected:
        raise AssertionError(f"{name}: nbytes() {cache.nbytes()} != kv_cache_bytes {expected}")
    return expected


# ---------------------------------------------------------------------------------------------------- report
def _target_notes(report, rows) -> None:
    by_name = {row["cache"]: row for row in rows}
    for name, (min_ratio, max_dppl) in TARGETS.items():
        row = by_name[name]
        if row.get("bytes ratio vs fp16") is None or row.get("Δppl %") is None:
            continue
        report.notes.append(
            f"target {name}: bytes ≥ {min_ratio}x smaller than fp16 DynamicCache at 4k -> "
            f"{row['bytes ratio vs fp16']:.2f}x ({'met' if row['bytes ratio vs fp16'] >= min_ratio else 'MISSED'}); "
            f"Δppl ≤ {max_dppl}% -> {row['Δppl %']:.2f}% ({'met' if row['Δppl %'] <= max_dppl else 'MISSED'})")
    for key in (k for k in by_name["kivi4"] if k.startswith("speed vs quanto")):
        speed = by_name["kivi4"][key]
        if speed is not None:
            report.notes.append(f"target kivi4 decode ≥ 1.5x transformers QuantizedCache(quanto), {key}: "
                                f"{speed:.2f}x ({'met' if speed >= 1.5 else 'MISSED'})")


def _draw(fig, rows) -> None:
    ours = [row for row in rows if row.get("bytes ratio vs fp16") is not None and row.get("Δppl %") is not None
            and row["cache"] != "dynamic"]
    ax = fig.add_subplot(1, 2, 1)
    ax.scatter([r["bytes ratio vs fp16"] for r in ours], [r["Δppl %"] for r in ours])
    for r in ours:
        ax.annotate(r["cache"], (r["bytes ratio vs fp16"], r["Δppl %"]))
    ax.set_xlabel("cache bytes ratio vs fp16 DynamicCache (4k tokens)")
    ax.set_ylabel("Δppl % vs DynamicCache")
    ax = fig.add_subplot(1, 2, 2)
    longest = max((int(k.split("@")[1]) for row in rows for k in row if k.startswith("ms/token @")), default=None)
    if longest is None:
        return
    timed = [r for r in rows if r.get(f"ms/token @{longest}") is not None]
    ax.bar([r["cache"] for r in timed], [r[f"ms/token @{longest}"] for r in timed])
    ax.set_ylabel(f"decode ms/token at {longest} cached tokens (1 thread)")
    ax.tick_params(axis="x", rotation=30)
