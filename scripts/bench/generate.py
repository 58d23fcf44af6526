"""Decode throughput of the bundled model per cache, as a ratio to DynamicCache in the same run.

    python scripts/benchmark.py generate [--caches dynamic,...] [--batch-sizes 1,4] [--new-tokens 32]
"""

from __future__ import annotations

import torch

from bench.harness import Report, measure, save_plot
from hf_kvspec.cache.factory import CACHE_CHOICES, cache_nbytes, enable_cache_attention, make_cache


def add_arguments(parser) -> None:
    parser.add_argument("--caches", default=",".join(CACHE_CHOICES), help="comma-separated --cache names")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)


def _decode_rate(model, ids, cache_name, new_tokens, repeats):
    """(tokens/s of generate, KV bytes at the end); min_new_tokens pins the length so runs compare."""
    state = {}

    def run():
        cache = make_cache(cache_name, model.config)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        state["bytes"] = cache_nbytes(cache)

    patch = enable_cache_attention(cache_name, model)  # as `hf-kvspec generate --cache` runs it
    try:
        timing = measure(run, warmup=1, repeats=repeats)
    finally:
        if patch is not None:
            patch.remove()
    return ids.shape[0] * new_tokens / timing.median_s, state["bytes"], timing


def run(args) -> None:
    from hf_kvspec.models import load_bundled_model

    model, _ = load_bundled_model()
    caches = args.caches.split(",")
    report = Report("generate", "Greedy generate throughput on SmolLM2-135M by cache (ratio vs DynamicCache)",
                    ["batch", "cache", "tokens_per_s", "ratio_vs_dynamic", "kv_bytes", "spread"],
                    settings=vars(args) | {"model": "smollm2-135m-instruct fp32"})
    report.notes.append("tokens_per_s counts prefill + decode wall time of `generate`; median of repeats.")
    report.notes.append("Each cache runs with the attention `hf-kvspec generate --cache` picks for it (kvspec_quant "
                        "for the quantized caches, sdpa otherwise); 1 torch thread; machine otherwise idle.")
    report.notes.append("kv_bytes is what each cache holds at the end: paged reports its whole preallocated pool "
                        "(num_blocks=None sizes it from free memory); at these short lengths KIVI's 128-token "
                        "full-precision window (model dtype, fp32 here) dominates, so see the kvquant benchmark "
                        "for sizes at 4k tokens.")
    rates = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        torch.manual_seed(0)
        ids = torch.randint(100, model.config.vocab_size, (batch, args.prompt_len))
        base = None
        for name in caches:
            rate, size, timing = _decode_rate(model, ids, name, args.new_tokens, args.repeats)
            base = base or rate
            rates[(batch, name)] = rate
            report.add(batch=batch, cache=name, tokens_per_s=round(rate, 2), ratio_vs_dynamic=round(rate / base, 3),
                       kv_bytes=size, spread=round(timing.spread, 3))
    report.write()

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        for name in caches:
            points = sorted((b, r) for (b, n), r in rates.items() if n == name)
            ax.plot([b for b, _ in points], [r for _, r in points], marker="o", label=name)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title("SmolLM2-135M greedy generate by cache")
        ax.legend()

    save_plot("generate", draw)
