"""PagedCache on the bundled SmolLM2-135M: decode speed, slot utilisation, concurrency in a budget, warm TTFT.

    python scripts/benchmark.py paged                       # full run, a few minutes on one thread
    python scripts/benchmark.py paged --decode-steps 4 --repeats 1 --ttft-repeats 1   # quicker

Four parts, each a ratio against a baseline measured in the same run:
    decode       tokens/s of single-token decode steps with S cached tokens, DynamicCache vs PagedCache
                 (gathered K/V + SDPA, and attn_implementation="kvspec_paged"). The cache is filled with
                 random K/V instead of a real prefill: decode cost depends on S, not on the values, and a
                 2k-token prefill of 8 rows would take minutes on one CPU thread.
    utilisation  live token slots / allocated slots for a log-normal mix of sequence lengths, allocated by
                 the real BlockTables/BlockPool; StaticCache's is tokens / (rows · longest).
    concurrency  sequences of that mix admitted into a fixed KV budget: the real allocator until it raises
                 OutOfBlocksError, vs a StaticCache that reserves the longest length for every row.
    ttft         time to first token for a prompt of a shared 1k-token prefix + a distinct 32-token tail:
                 cold cache vs a warm one whose load_prefix() attaches the prefix blocks.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.harness import Report, save_plot
from hf_kvspec.attention.paged import ATTN_NAME, register_paged_attention
from hf_kvspec.cache.block_pool import BlockPool, OutOfBlocksError
from hf_kvspec.cache.block_table import BlockTables
from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.memory import kv_bytes_per_token

TARGETS = {"decode": 0.9, "utilisation": 0.96, "concurrency": 2.0, "ttft": 3.0}


def add_arguments(parser) -> None:
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--prompt-lens", default="512,2048", help="cached tokens S before decoding")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed decode rounds per setting")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-seqs", type=int, default=512, help="sequences in the log-normal mix")
    parser.add_argument("--kv-budget", default="1GiB", help="KV budget for the concurrency part")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--ttft-repeats", type=int, default=2)
    parser.add_argument("--plot-only", action="store_true", help="redraw paged.png from paged.json, measure nothing")


# ---- decode -------------------------------------------------------------------------------------------
def _filled_cache(model, cache, batch: int, length: int):
    """Fill every layer with ``length`` random K/V tokens per row (decode cost depends on S, not values)."""
    config = model.config
    shape = (batch, config.num_key_value_heads, length, config.head_dim)
    gen = torch.Generator().manual_seed(0)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer)
    return cache


def _decode_times(model, caches: dict, batch: int, steps: int, repeats: int) -> dict[str, list[float]]:
    """CPU seconds of ``steps`` decode steps per ``{name: (attn_implementation, cache)}``, one list per name.

    Interleaved (one repeat of each variant in turn, the order reversed every other round) so that load from
    other jobs on the shared machine and any drift within a round hit every variant alike."""
    tokens = torch.randint(100, model.config.vocab_size, (batch, 1))
    samples = {name: [] for name in caches}
    for repeat in range(repeats + 1):  # the first round is warm-up
        order = list(caches) if repeat % 2 else list(reversed(caches))
        for name in order:
            attn, cache = caches[name]
            model.set_attn_implementation(attn)
            start = time.process_time()
            with torch.inference_mode():
                for _ in range(steps):
                    model(input_ids=tokens, cache=cache)
            if repeat:
                samples[name].append(time.process_time() - start)
            cache.crop(-steps)  # roll back so every repeat decodes at the same S
    model.set_attn_implementation("sdpa")
    return samples


def decode_part(model, args, report: Report) -> None:
    from transformers import DynamicCache

    register_paged_attention()
    block = args.block_size
    for length in map(int, args.prompt_lens.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            blocks = batch * (-(-(length + args.decode_steps) // block)) + 1

            caches = {"dynamic": ("sdpa", _filled_cache(model, DynamicCache(config=model.config), batch, length))}
            for attn in ("sdpa", ATTN_NAME):
                model.set_attn_implementation(attn)  # a cache pairs with the attention the model runs when built
                pages = PagedCache(model.config, block_size=block, num_blocks=blocks)
                caches[attn] = (attn, _filled_cache(model, pages, batch, length))
            times = _decode_times(model, caches, batch, args.decode_steps, args.repeats)
            del caches
            base = times.pop("dynamic")
            for attn, paged in times.items():
                label = "gathered K/V + sdpa" if attn == "sdpa" else "kvspec_paged attention"
                # ratio: median over rounds of the paired ratio (same round, adjacent in time), which cancels
                # load that drifts between rounds better than a ratio of two medians
                ratio = statistics.median(b / p for b, p in zip(base, paged))
                _add(report, "decode tok/s", f"bs={batch} S={length}, {label}",
                     _rate(base, batch, args.decode_steps), _rate(paged, batch, args.decode_steps), ratio, "decode")


def _rate(seconds: list[float], batch: int, steps: int) -> float:
    """Decode tokens/s from the per-round seconds of ``steps`` steps at ``batch`` rows (median round)."""
    return batch * steps / statistics.median(seconds)


# ---- utilisation and concurrency (the real allocator over simulated lengths) -----------------------------
def lognormal_lengths(num: int, seed: int = 0) -> list[int]:
    """Sequence lengths (prompt + output) with median ~360 tokens and a long tail, clipped to [16, 4096]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=np.log(360), sigma=0.9, size=num), 16, 4096).astype(int).tolist()


def allocate(lengths: list[int], block_size: int, num_blocks: int) -> tuple[int, BlockTables]:
    """Admit sequences in order until the pool is exhausted; returns (admitted, tables)."""
    tables = BlockTables(BlockPool(num_blocks, block_size))
    for length in lengths:
        tables.add_rows(1)
        try:
            tables.grow([tables.length(r) for r in range(tables.num_rows - 1)] + [length])
        except OutOfBlocksError:
            tables.select(range(tables.num_rows - 1))
            break
    return tables.num_rows, tables


def memory_part(model, args, report: Report) -> None:
    lengths = lognormal_lengths(args.num_seqs)
    tokens, longest = sum(lengths), max(lengths)
    for block in (8, 16, 32, 64):
        _, tables = allocate(lengths, block, 10**7)
        used = tables.pool.num_used()
        utilisation = tokens / (used * block)
        static = tokens / (len(lengths) * longest)
        _add(report, "slot utilisation", f"{len(lengths)} log-normal seqs, block={block}", static, utilisation,
             utilisation / static, "utilisation" if block == args.block_size else None, value_target=True)

    from hf_kvspec.memory import parse_bytes

    budget = parse_bytes(args.kv_budget)
    per_token = kv_bytes_per_token(model.config, torch.float32)
    num_blocks = budget // (per_token * args.block_size)
    admitted, _ = allocate(lengths, args.block_size, num_blocks)
    static_rows = budget // (per_token * longest)
    _add(report, "concurrent seqs", f"{args.kv_budget} KV fp32, block={args.block_size}, StaticCache rows of "
         f"{longest} tokens", static_rows, admitted, admitted / max(static_rows, 1), "concurrency")


# ---- time to first token with a shared prefix ------------------------------------------------------------
def ttft_part(model, tokenizer, args, report: Report) -> None:
    torch.manual_seed(0)
    prefix = torch.randint(100, model.config.vocab_size, (1, args.prefix_len))

    def prompt(seed: int):
        tail = torch.randint(100, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(seed))
        return torch.cat([prefix, tail], dim=1)

    def first_token(cache, ids) -> float:
        start = time.process_time()
        with torch.inference_mode():
            cache.load_prefix(ids)
            model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)
        return time.process_time() - start

    blocks = 2 * -(-(args.prefix_len + 40) // args.block_size) + 2
    new_cache = lambda: PagedCache(model.config, block_size=args.block_size, num_blocks=blocks,  # noqa: E731
                                   enable_prefix_caching=True)
    cold = sorted(first_token(new_cache(), prompt(seed)) for seed in range(args.ttft_repeats))
    warm_cache = new_cache()
    first_token(warm_cache, prompt(100))  # another request with the same prefix
    warm = sorted(first_token(warm_cache, prompt(seed)) for seed in range(args.ttft_repeats))
    cold_s, warm_s = cold[len(cold) // 2], warm[len(warm) // 2]
    _add(report, "TTFT s", f"{args.prefix_len}-token shared prefix + 32-token tail (cold / warm)", cold_s, warm_s,
         cold_s / warm_s, "ttft")


# ---- report ---------------------------------------------------------------------------------------------
def _add(report, part, setting, baseline, paged, ratio, target_key, value_target=False):
    target = TARGETS.get(target_key) if target_key else None
    met = "" if target is None else ("yes" if (paged if value_target else ratio) >= target else "NO")
    report.add(part=part, setting=setting, baseline=round(float(baseline), 4), paged=round(float(paged), 4),
               ratio=round(float(ratio), 3), target=f">= {target}" if target else "", met=met)


def run(args) -> None:
    if args.plot_only:
        return plot_from_json()
    from hf_kvspec.models import load_bundled_model

    model, tokenizer = load_bundled_model()
    report = Report("paged", "PagedCache vs DynamicCache / StaticCache on SmolLM2-135M (fp32, CPU)",
                    ["part", "setting", "baseline", "paged", "ratio", "target", "met"],
                    settings=vars(args) | {"model": "smollm2-135m-instruct fp32"})
    report.notes += [
        "decode: baseline = DynamicCache tokens/s, paged = PagedCache tokens/s; single-token steps over random "
        f"K/V with S cached tokens, {args.decode_steps} steps per repeat, {args.repeats} repeats interleaved "
        "across the three variants (order reversed every other round); tok/s from the median repeat, ratio = median "
        "over rounds of the paired DynamicCache/PagedCache time ratio.",
        "slot utilisation: baseline = StaticCache sized for the longest sequence; target applies to the paged value.",
        "concurrent seqs: allocator arithmetic over the real BlockPool (no tensors), StaticCache reserves the longest.",
        "TTFT (CPU s): baseline = cold (full prefill), paged = warm (prefix blocks reused via load_prefix); "
        f"median of {args.ttft_repeats}.",
        "Times are CPU seconds of this single-threaded process (time.process_time), not wall time: the 2-core "
        "machine was shared with ~6 other jobs, and wall time mostly measured their load (wall-clock ratios of the "
        "same runs swung by +-20%). With one torch thread, CPU time equals wall time on an idle machine.",
    ]
    memory_part(model, args, report)
    ttft_part(model, tokenizer, args, report)
    decode_part(model, args, report)
    report.write()
    plot_from_json()


def _draw(fig, plot: dict) -> None:
    ax = fig.add_subplot(2, 2, 1)
    names = [n for n, _ in plot.get("sdpa", [])]
    for offset, (attn, label) in enumerate((("sdpa", "gathered K/V + sdpa"), (ATTN_NAME, "kvspec_paged"))):
        ratios = [r for _, r in plot.get(attn, [])]
        ax.bar([i + 0.4 * offset for i in range(len(ratios))], ratios, width=0.4, label=label)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=7)
    ax.axhline(TARGETS["decode"], color="red", linestyle="--", linewidth=1)
    ax.set_title("decode tok/s / DynamicCache's", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax = fig.add_subplot(2, 2, 2)
    blocks, util = zip(*plot["utilisation"])
    ax.plot(blocks, util, marker="o")
    ax.axhline(TARGETS["utilisation"], color="red", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size", fontsize=8)
    ax.set_title("slot utilisation, log-normal lengths", fontsize=9)
    ax = fig.add_subplot(2, 2, 3)
    static, admitted = plot["concurrency"]
    ax.bar(["StaticCache", "PagedCache"], [static, admitted], color=["grey", "tab:blue"])
    ax.set_title("sequences admitted in the same KV budget", fontsize=9)
    ax = fig.add_subplot(2, 2, 4)
    cold, warm = plot["ttft"]
    ax.bar(["cold", "warm (prefix cached)"], [cold, warm], color=["grey", "tab:blue"])
    ax.set_ylabel("CPU s", fontsize=8)
    ax.set_title("time to first token, shared 1k prefix", fontsize=9)


def plot_from_json(path=None) -> None:
    """Redraw ``paged.png`` from the rows of a previous run's ``paged.json``."""
    import json

    from bench.harness import RESULTS_DIR

    rows = json.loads((path or RESULTS_DIR / "paged.json").read_text())["rows"]
    plot: dict = {"utilisation": []}
    for row in rows:
        if row["part"] == "decode tok/s":
            attn = "sdpa" if "gathered" in row["setting"] else ATTN_NAME
            batch, length = row["setting"].split(",")[0].split()
            plot.setdefault(attn, []).append((f"{batch.replace('=', '')}\n{length.replace('=', '')}", row["ratio"]))
        elif row["part"] == "slot utilisation":
            plot["utilisation"].append((int(row["setting"].rsplit("=", 1)[1]), row["paged"]))
        elif row["part"] == "concurrent seqs":
            plot["concurrency"] = (row["baseline"], row["paged"])
        elif row["part"] == "TTFT s":
            plot["ttft"] = (row["baseline"], row["paged"])
    save_plot("paged", lambda fig: _draw(fig, plot))
