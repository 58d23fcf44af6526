"""Attention patches: kvspec_gqa vs sdpa/eager on the bundled model, MLA absorb vs stock DeepSeek attention.

    python scripts/benchmark.py attention [--contexts 512,2048,8192] [--mla-contexts 1024,4096,8192,16384]
                                          [--decode-steps 8] [--mla-steps 4] [--repeats 5] [--min-phase-s 20]
                                          [--call-rounds 15]
                                          [--skip-gqa|--skip-mla]   (a skipped part keeps its previous rows)

(a) GQA, bundled SmolLM2-135M (9 query / 3 KV heads, 30 layers, fp32, batch 1). Per context length the
    first ``context - chunk`` tokens are prefilled once (untimed, shared); each implementation then
    prefills the last ``--prefill-chunk`` tokens on that cache (timed; the cache is cropped back), which
    is chunked prefill at that depth (the whole prompt when context <= chunk). Then decode rounds of
    ``--decode-steps`` tokens alternate the implementations on the same full cache. Ratios are vs sdpa,
    medians of per-round paired ratios.
(b) MLA, a randomly initialised DeepSeek-V3-shaped model scaled to a CPU (32 heads, head dim 64,
    d_c = 4·64, d_r = 64/2 as in V3's 512/128 and 64/128): the latent cache is filled with random
    values (decode cost does not depend on them; a real 16k prefill would take minutes), then stock
    transformers attention and the absorbed forward alternate decode rounds on the same cache.

Per-call columns (``*_attn_ms/us``, ``*_peak_mib``) time / profile one attention call of one layer with
pre-allocated inputs: the part that differs between implementations, free of whole-model noise (GQA:
interleaved, with CPU caches evicted before each call, see ``_interleaved_cold_calls``).
Peak memory: transients of one attention call of one layer (prefill chunk / one decode token at that
context), as live torch tensors from the profiler's memory timeline (exact); the rest of a forward is
the same for every implementation. They include eager's score matrix, ``repeat_kv`` copies and stock
MLA's per-head expansion of every cached latent.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import RESULTS_DIR, Report, save_plot

GQA_IMPLS = ("sdpa", "eager", "kvspec_gqa")
MIB = 2**20


def add_arguments(parser) -> None:
    parser.add_argument("--contexts", default="512,2048,8192", help="GQA context lengths (bundled model)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="GQA prefill: new tokens timed at each context")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--mla-contexts", default="1024,4096,8192,16384")
    parser.add_argument("--mla-steps", type=int, default=4)
    parser.add_argument("--mla-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="GQA: at least this many alternating decode rounds (MLA: exactly)")
    parser.add_argument("--min-phase-s", type=float, default=20.0,
                        help="GQA: keep alternating prefill (and decode) rounds at least this long per context")
    parser.add_argument("--call-rounds", type=int, default=15,
                        help="GQA: alternating rounds of one-layer attention calls (per kind and context)")
    parser.add_argument("--skip-gqa", action="store_true")
    parser.add_argument("--skip-mla", action="store_true")


def torch_peak_mib(fn) -> float:
    """Peak growth of live torch CPU tensors while ``fn()`` runs (profiler memory timeline, exact but slow)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export_memory_timeline is deprecated for CUDA, still the CPU tool
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            fn()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "timeline.json"
            prof.export_memory_timeline(str(path), device="cpu")
            _, sizes = json.loads(path.read_text())
    totals = [sum(sample) for sample in sizes]
    return (max(totals) - totals[0]) / MIB


def _decode(model, cache, first_token: torch.Tensor, steps: int) -> float:
    """Seconds for ``steps`` greedy decode steps on ``cache``; the cache is cropped back afterwards."""
    token = first_token
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token, cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
    elapsed = time.perf_counter() - start
    cache.crop(-steps)
    return elapsed


def _prefill(model, ids: torch.Tensor, chunk: int, cache=None):
    for begin in range(0, ids.shape[1], chunk):
        cache = model(ids[:, begin:begin + chunk], cache=cache, use_cache=True, logits_to_keep=1).cache
    return cache


def _timed_chunk(model, cache, chunk_ids: torch.Tensor) -> float:
    """Seconds to prefill ``chunk_ids`` on top of ``cache`` (``None``: an empty one); the cache is restored."""
    start = time.perf_counter()
    model(chunk_ids, cache=cache, use_cache=True, logits_to_keep=1)  # logits_to_keep=1 as generate's prefill
    elapsed = time.perf_counter() - start
    if cache is not None:
        cache.crop(-chunk_ids.shape[1])
    return elapsed


def _run_gqa(args, report: Report, results: dict) -> None:
    from hf_kvspec.attention.gqa import register_gqa
    from hf_kvspec.models import load_bundled_model

    register_gqa()
    model, _ = load_bundled_model()
    warm = torch.randint(100, 40000, (1, 64))
    for impl in GQA_IMPLS:  # first-call costs (kernels, dispatch caches) stay out of the timings
        model.set_attn_implementation(impl)
        _decode(model, _prefill(model, warm, 64), warm[:, -1:], 2)
    for context in [int(c) for c in args.contexts.split(",")]:
        rows = _gqa_context(model, args, context)
        _add_gqa_rows(report, results, context, rows)
    model.set_attn_implementation("sdpa")


def _gqa_context(model, args, context: int) -> dict:
    """Prefill the last chunk on a shared cache, then decode; implementations alternate within each round."""
    torch.manual_seed(context)
    ids = torch.randint(100, 40000, (1, context))
    chunk = min(args.prefill_chunk, context)
    model.set_attn_implementation("kvspec_gqa")  # the shared context: untimed, lowest memory
    cache = _prefill(model, ids[:, : context - chunk], 2048) if context > chunk else None
    rows = {impl: {} for impl in GQA_IMPLS}
    prefill = _alternating_rounds(model, lambda: _timed_chunk(model, cache, ids[:, context - chunk:]),
                                  args.prefill_repeats, args.min_phase_s)
    cache = _prefill(model, ids[:, context - chunk:], chunk, cache)
    decode = _alternating_rounds(model, lambda: _decode(model, cache, ids[:, -1:], args.decode_steps),
                                 args.repeats, args.min_phase_s)
    for impl in GQA_IMPLS:
        rows[impl]["prefill"], rows[impl]["decode"] = prefill[impl], decode[impl]
    calls = {impl: {kind: _gqa_call(model, impl, q_len, context, padded)
                    for kind, q_len, padded in (("prefill", chunk, False), ("decode", 1, False),
                                                ("decode_padded", 1, True))}
             for impl in GQA_IMPLS}
    for kind in ("prefill", "decode", "decode_padded"):
        call_times = _interleaved_cold_calls({impl: calls[impl][kind] for impl in GQA_IMPLS}, args.call_rounds)
        for impl in GQA_IMPLS:
            rows[impl][f"{kind}_call"] = call_times[impl]
    for impl in GQA_IMPLS:
        row = rows[impl]
        row["prefill_peak_mib"] = torch_peak_mib(calls[impl]["prefill"])
        row["decode_peak_mib"] = torch_peak_mib(calls[impl]["decode"])
        row["prefill_tokens"], row["decode_steps"] = chunk, args.decode_steps
    print(f"  gqa context {context} done", flush=True)
    return rows


def _alternating_rounds(model, timed, min_rounds: int, min_seconds: float) -> dict[str, list[float]]:
    """Seconds of ``timed()`` per implementation, in rounds that run every implementation once.

    The order is reversed every round, so none always runs first (or last); rounds go on until there
    are ``min_rounds`` and ``min_seconds`` have passed (cheap short contexts get more rounds).
    """
    times: dict[str, list[float]] = {impl: [] for impl in GQA_IMPLS}
    start, round_index = time.perf_counter(), 0
    while round_index < min_rounds or time.perf_counter() - start < min_seconds:
        for impl in (GQA_IMPLS if round_index % 2 == 0 else GQA_IMPLS[::-1]):
            model.set_attn_implementation(impl)
            times[impl].append(timed())
        round_index += 1
    return times


def _gqa_call(model, impl: str, q_len: int, context: int, padded: bool = False):
    """One attention call of one layer (``q_len`` new tokens, ``context`` keys) as a closure.

    Pre-allocated inputs, laid out as in a forward (query a transposed projection, K/V contiguous cache
    tensors), and the mask each implementation's registered mask function builds (for ``sdpa`` and
    ``kvspec_gqa`` none for an unpadded decode step or an empty cache; ``padded``: 16 left pads, so every
    implementation gets a mask). The rest of a forward is the same for every implementation.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
    from transformers.models.llama.modeling_llama import eager_attention_forward

    attn, config = model.model.layers[0].self_attn, model.config
    head_dim = config.hidden_size // config.num_attention_heads
    query = torch.randn(1, q_len, config.num_attention_heads, head_dim).transpose(1, 2)
    key, value = torch.randn(2, 1, config.num_key_value_heads, context, head_dim).unbind(0)
    padding = torch.ones(1, context, dtype=torch.bool)
    padding[:, :16] = not padded
    mask = AttentionMaskInterface()[impl](
        batch_size=1, q_length=q_len, kv_length=context, q_offset=context - q_len,
        mask_function=causal_mask_function, attention_mask=padding, dtype=query.dtype,
    )
    function = eager_attention_forward if impl == "eager" else AttentionInterface()[impl]
    return lambda: function(attn, query, key, value, mask, scaling=attn.scaling)


_EVICT = None  # 64 MiB scratch, twice this machine's L3: written between timed calls


def _interleaved_cold_calls(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each closure: ``rounds`` rounds, implementations alternating, caches evicted.

    In a real forward 29 other layers' weights and K/V pass through the caches between two calls of one
    layer's attention, so its K/V come from memory. Timing the same call back to back instead keeps K/V
    in L2/L3 and favours whichever layout reads more K/V bytes; at 8k keys (12 MiB of K/V, L3 32 MiB)
    those warm timings were bimodal and flipped between runs. The eviction itself is not timed.
    """
    global _EVICT
    if _EVICT is None:
        _EVICT = torch.zeros(16 * MIB)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for round_index in range(rounds):
        for name in (list(calls) if round_index % 2 == 0 else list(calls)[::-1]):
            _EVICT.add_(1.0)
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _call_us(call, budget_s: float = 0.5) -> float:
    """Fastest of repeated calls, in microseconds (the least contended estimate on a shared machine)."""
    call()
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best * 1e6


def _paired_ratio(base: list[float], ours: list[float]) -> float:
    """Median over rounds of ``base / ours`` seconds (> 1: faster than the baseline), each round paired.

    Pairing cancels slow drifts in the machine's load that a ratio of two minima or medians keeps.
    """
    return statistics.median(b / o for b, o in zip(base, ours))


def _add_gqa_rows(report: Report, results: dict, context: int, rows: dict) -> None:
    base = rows["sdpa"]
    for impl, row in rows.items():
        decode_tok_s = row["decode_steps"] / statistics.median(row["decode"])
        prefill_tok_s = row["prefill_tokens"] / statistics.median(row["prefill"])
        results.setdefault(("gqa", impl), []).append((context, decode_tok_s, prefill_tok_s))
        report.add(
            part="gqa", impl=impl, context=context, decode_tok_s=round(decode_tok_s, 2),
            decode_vs_base=round(_paired_ratio(base["decode"], row["decode"]), 3),
            prefill_tokens=row["prefill_tokens"], prefill_tok_s=round(prefill_tok_s, 1),
            prefill_vs_base=round(_paired_ratio(base["prefill"], row["prefill"]), 3),
            decode_attn_us=round(statistics.median(row["decode_call"]) * 1e6, 1),
            decode_attn_vs_base=round(_paired_ratio(base["decode_call"], row["decode_call"]), 3),
            decode_padded_attn_us=round(statistics.median(row["decode_padded_call"]) * 1e6, 1),
            decode_padded_attn_vs_base=round(_paired_ratio(base["decode_padded_call"], row["decode_padded_call"]), 3),
            prefill_attn_ms=round(statistics.median(row["prefill_call"]) * 1e3, 2),
            prefill_attn_vs_base=round(_paired_ratio(base["prefill_call"], row["prefill_call"]), 3),
            prefill_peak_mib=round(row["prefill_peak_mib"], 1), decode_peak_mib=round(row["decode_peak_mib"], 2),
        )


def mla_bench_config(layers: int):
    """DeepSeek-V3's ratios at CPU size (V3: 128 heads of 128 + 64 RoPE, d_c 512, q rank 1536, hidden 56/head)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=4096, hidden_size=1792, intermediate_size=4608, moe_intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=32, q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=32768,
    )


def _latent_cache(config, context: int):
    """A DynamicCache holding ``context`` random latents per layer: c_kv [1, 1, S, C], k_rot [1, 1, S, R]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    generator = torch.Generator().manual_seed(context)
    for layer in range(config.num_hidden_layers):
        c_kv = torch.randn(1, 1, context, config.kv_lora_rank, generator=generator)
        k_rot = torch.randn(1, 1, context, config.qk_rope_head_dim, generator=generator)
        cache.update(c_kv, k_rot, layer)
    return cache


class _FrozenCache:
    """Stands in for a cache holding ``context`` latents: ``update`` returns them without concatenating."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, *args, **kwargs):
        return self.keys, self.values


def _mla_call(model, cache, context: int):
    """One decode forward of layer 0's attention over ``context`` cached latents, as a closure."""
    attn = model.model.layers[0].self_attn
    layer = cache.layers[0]
    frozen = _FrozenCache(layer.keys[:, :, :context], layer.values[:, :, :context])
    hidden = torch.randn(1, 1, model.config.hidden_size)
    embeddings = model.model.rotary_emb(hidden, torch.tensor([[context]]))
    return lambda: attn(hidden_states=hidden, position_embeddings=embeddings, attention_mask=None, cache=frozen)


def _run_mla(args, report: Report, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    from hf_kvspec.attention.mla import enable_mla_absorb
    from hf_kvspec.memory import kv_cache_bytes

    config = mla_bench_config(args.mla_layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    token = torch.tensor([[7]])
    _decode(model, _latent_cache(config, 64), token, 2)  # warm-up of both paths
    with enable_mla_absorb(model):
        _decode(model, _latent_cache(config, 64), token, 2)
    expanded = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    for context in [int(c) for c in args.mla_contexts.split(",")]:
        cache = _latent_cache(config, context)
        times = {"stock": [], "absorbed": []}
        for _ in range(args.repeats):
            times["stock"].append(_decode(model, cache, token, args.mla_steps))
            with enable_mla_absorb(model):
                times["absorbed"].append(_decode(model, cache, token, args.mla_steps))
        calls = {"stock": _call_us(_mla_call(model, cache, context))}
        peaks = {"stock": torch_peak_mib(_mla_call(model, cache, context))}
        with enable_mla_absorb(model):
            calls["absorbed"] = _call_us(_mla_call(model, cache, context))
            peaks["absorbed"] = torch_peak_mib(_mla_call(model, cache, context))
        stored = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
        per_token_layer = stored / (context * config.num_hidden_layers)
        assert stored == kv_cache_bytes(config, context, 1, dtype=torch.float32), "cache is not latent-only"
        base = args.mla_steps / min(times["stock"])
        for impl in ("stock", "absorbed"):
            rate = args.mla_steps / min(times[impl])
            results.setdefault(("mla", impl), []).append((context, rate, None))
            report.add(part="mla", impl=impl, context=context, decode_tok_s=round(rate, 2),
                       decode_vs_base=round(rate / base, 3), decode_attn_us=round(calls[impl], 1),
                       decode_peak_mib=round(peaks[impl], 2),
                       cache_bytes_per_token_layer=int(per_token_layer),
                       expanded_bytes_per_token_layer=expanded * 4)
        del cache


def _draw(results: dict):
    def draw(fig):
        fig.set_size_inches(13, 4.2)
        panels = [("gqa", 1, "GQA decode (SmolLM2-135M)", "decode tokens/s"),
                  ("gqa", 2, "GQA prefill (SmolLM2-135M)", "prefill tokens/s"),
                  ("mla", 1, "MLA decode (DeepSeek-V3-shaped)", "decode tokens/s")]
        for index, (part, column, title, ylabel) in enumerate(panels, start=1):
            ax = fig.add_subplot(1, 3, index)
            for (kind, impl), points in sorted(results.items()):
                if kind == part:
                    ax.plot([p[0] for p in points], [p[column] for p in points], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set(title=title, xlabel="context tokens", ylabel=ylabel)
            ax.legend()
    return draw


def _carry_over(part: str, report: Report, results: dict) -> None:
    """Keep the rows of a skipped part (``--skip-gqa``/``--skip-mla``) from the previous results file, dated."""
    path = RESULTS_DIR / "attention.json"
    previous = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = [row for row in previous["rows"] if row.get("part") == part]
    if not rows:
        return
    note = f"{part} rows carried over unchanged from the run of {previous['environment']['date']} (this run skipped that part)."
    report.notes.append(next((n for n in previous["notes"] if n.startswith(f"{part} rows carried over")), note))
    for row in rows:
        report.add(**row)
        rates = (row["context"], row["decode_tok_s"], row.get("prefill_tok_s"))
        results.setdefault((part, row["impl"]), []).append(rates)


def run(args) -> None:
    report = Report(
        "attention", "Attention patches: kvspec_gqa vs sdpa/eager, MLA absorb vs stock (CPU, fp32, batch 1)",
        ["part", "impl", "context", "decode_tok_s", "decode_vs_base", "prefill_tokens", "prefill_tok_s",
         "prefill_vs_base", "decode_attn_us", "decode_attn_vs_base", "decode_padded_attn_us",
         "decode_padded_attn_vs_base", "prefill_attn_ms", "prefill_attn_vs_base",
         "prefill_peak_mib", "decode_peak_mib", "cache_bytes_per_token_layer", "expanded_bytes_per_token_layer"],
        settings=vars(args),
    )
    report.notes += [
        "Ratios are vs the baseline measured in the same run (gqa: sdpa, mla: stock); > 1 means faster. Machine "
        "shared with other jobs.",
        "gqa: whole-model rounds (prefill chunk, decode_steps tokens) and one-layer attention calls alternate "
        "the implementations (order reversed every round); *_vs_base is the median over rounds of the paired "
        "ratio sdpa time / impl time, rates are medians. prefill_tok_s: the last prefill_tokens of the context "
        "prefilled on a cache holding the rest (chunked prefill at that depth).",
        "gqa *_attn_*: one layer's attention call alone with the mask its implementation's mask function builds, "
        "CPU caches evicted before each call (as in a forward, where 29 other layers run in between); "
        "decode_padded: the same decode step with 16 left-padding tokens (every implementation gets a mask). "
        "Peak MiB: transients of the prefill-chunk / decode call (torch profiler memory timeline), per layer "
        "and call.",
        "mla: fastest of alternating decode rounds; decode_attn_us fastest of repeated calls of one layer's "
        "attention. Cache rows: bytes actually stored per token per layer (c_kv + k_rot, asserted equal to "
        "kv_cache_bytes) vs what per-head K/V of the same model would take.",
    ]
    results: dict = {}
    with torch.inference_mode():  # no autograd graph: cached K/V would otherwise keep every activation alive
        for part, skip, measure in (("gqa", args.skip_gqa, _run_gqa), ("mla", args.skip_mla, _run_mla)):
            if skip:
                _carry_over(part, report, results)
            else:
                measure(args, report, results)
    report.write()
    save_plot("attention", _draw(results))
