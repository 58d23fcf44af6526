"""Attention patches: kvspec_gqa vs sdpa/eager on the bundled model, MLA absorb vs stock DeepSeek attention.

    python scripts/benchmark.py attention [--contexts 512,2048,8192] [--mla-contexts 1024,4096,8192,16384]
                                          [--decode-steps 8] [--mla-steps 4] [--repeats 5] [--skip-gqa|--skip-mla]

(a) GQA, bundled SmolLM2-135M (9 query / 3 KV heads, 30 layers, fp32, batch 1). Per context length the
    first ``context - chunk`` tokens are prefilled once (untimed, shared); each implementation then
    prefills the last ``--prefill-chunk`` tokens on that cache (timed; the cache is cropped back), which
    is chunked prefill at that depth (the whole prompt when context <= chunk). Then decode rounds of
    ``--decode-steps`` tokens alternate the implementations on the same full cache. Ratios are vs sdpa.
(b) MLA, a randomly initialised DeepSeek-V3-shaped model scaled to a CPU (32 heads, head dim 64,
    d_c = 4·64, d_r = 64/2 as in V3's 512/128 and 64/128): the latent cache is filled with random
    values (decode cost does not depend on them; a real 16k prefill would take minutes), then stock
    transformers attention and the absorbed forward alternate decode rounds on the same cache.

Per-call columns (``*_attn_ms/us``, ``*_peak_mib``) time / profile one attention call of one layer with
pre-allocated inputs: the part that differs between implementations, free of whole-model noise.
Peak memory: transients of one attention call of one layer (prefill chunk / one decode token at that
context), as live torch tensors from the profiler's memory timeline (exact); the rest of a forward is
the same for every implementation. They include eager's score matrix, ``repeat_kv`` copies and stock
MLA's per-head expansion of every cached latent.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import Report, save_plot

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
    parser.add_argument("--repeats", type=int, default=5, help="alternating decode rounds per implementation")
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
    """Prefill the last chunk (timed per implementation) on a shared cache, then alternate decode rounds."""
    torch.manual_seed(context)
    ids = torch.randint(100, 40000, (1, context))
    chunk = min(args.prefill_chunk, context)
    model.set_attn_implementation("kvspec_gqa")  # the shared context: untimed, lowest memory
    cache = _prefill(model, ids[:, : context - chunk], 2048) if context > chunk else None
    rows = {impl: {"prefill": [], "decode": []} for impl in GQA_IMPLS}
    for _ in range(args.prefill_repeats):
        for impl in GQA_IMPLS:
            model.set_attn_implementation(impl)
            rows[impl]["prefill"].append(_timed_chunk(model, cache, ids[:, context - chunk:]))
    cache = _prefill(model, ids[:, context - chunk:], chunk, cache)
    for _ in range(args.repeats):
        for impl in GQA_IMPLS:
            model.set_attn_implementation(impl)
            rows[impl]["decode"].append(_decode(model, cache, ids[:, -1:], args.decode_steps))
    for impl in GQA_IMPLS:
        model.set_attn_implementation(impl)
        row = rows[impl]
        row["prefill_tok_s"] = chunk / min(row.pop("prefill"))
        row["decode_tok_s"] = args.decode_steps / min(row.pop("decode"))
        prefill_call, decode_call = _gqa_call(model, impl, chunk, context), _gqa_call(model, impl, 1, context)
        row["prefill_peak_mib"], row["decode_peak_mib"] = torch_peak_mib(prefill_call), torch_peak_mib(decode_call)
        row["prefill_attn_ms"], row["decode_attn_us"] = _call_us(prefill_call, 2.0) / 1e3, _call_us(decode_call)
        row["prefill_tokens"] = chunk
    print(f"  gqa context {context} done", flush=True)
    return rows


def _gqa_call(model, impl: str, q_len: int, context: int):
    """One attention call of one layer (``q_len`` new tokens, ``context`` keys) as a closure.

    Pre-allocated inputs and the mask each implementation receives from transformers (none for an
    unpadded decode step or an empty cache, else the causal 4D mask). The rest of a forward is the same
    for every implementation, so this isolates what differs, free of whole-model timing noise.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    attn, config = model.model.layers[0].self_attn, model.config
    head_dim = config.hidden_size // config.num_attention_heads
    query = torch.randn(1, config.num_attention_heads, q_len, head_dim)
    key, value = torch.randn(2, 1, config.num_key_value_heads, context, head_dim).unbind(0)
    sizes = dict(batch_size=1, q_length=q_len, kv_length=context, q_offset=context - q_len,
                 mask_function=causal_mask_function)
    if impl == "eager":
        function, mask = eager_attention_forward, eager_mask(**sizes)
    else:
        function, mask = AttentionInterface()[impl], sdpa_mask(**sizes)
    return lambda: function(attn, query, key, value, mask, scaling=attn.scaling)


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


def _add_gqa_rows(report: Report, results: dict, context: int, rows: dict) -> None:
    base = rows["sdpa"]
    for impl, row in rows.items():
        results.setdefault(("gqa", impl), []).append((context, row["decode_tok_s"], row["prefill_tok_s"]))
        report.add(part="gqa", impl=impl, context=context, decode_tok_s=round(row["decode_tok_s"], 2),
                   decode_vs_base=round(row["decode_tok_s"] / base["decode_tok_s"], 3),
                   prefill_tokens=row["prefill_tokens"], prefill_tok_s=round(row["prefill_tok_s"], 1),
                   prefill_vs_base=round(row["prefill_tok_s"] / base["prefill_tok_s"], 3),
                   prefill_attn_ms=round(row["prefill_attn_ms"], 2), decode_attn_us=round(row["decode_attn_us"], 1),
                   prefill_peak_mib=round(row["prefill_peak_mib"], 1), decode_peak_mib=round(row["decode_peak_mib"], 2))


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


def run(args) -> None:
    report = Report(
        "attention", "Attention patches: kvspec_gqa vs sdpa/eager, MLA absorb vs stock (CPU, fp32, batch 1)",
        ["part", "impl", "context", "decode_tok_s", "decode_vs_base", "prefill_tokens", "prefill_tok_s",
         "prefill_vs_base", "prefill_attn_ms", "decode_attn_us",
         "prefill_peak_mib", "decode_peak_mib", "cache_bytes_per_token_layer", "expanded_bytes_per_token_layer"],
        settings=vars(args),
    )
    report.notes += [
        "Ratios are vs the baseline measured in the same run (gqa: sdpa, mla: stock); decode rounds alternate "
        "implementations; fastest round (on a machine shared with other jobs the minimum is the least "
        "contended estimate of each implementation's own cost; expect ±10% noise in ratios).",
        "prefill_tok_s: the last prefill_tokens of the context prefilled on a cache holding the rest (chunked "
        "prefill at that depth). prefill_attn_ms / decode_attn_us: fastest of repeated calls of one layer's "
        "attention alone (prefill chunk / one decode token at that context). Peak MiB: transients of that "
        "call (torch profiler memory timeline), per layer and call.",
        "MLA cache rows: bytes actually stored per token per layer (c_kv + k_rot, asserted equal to "
        "kv_cache_bytes) vs what per-head K/V of the same model would take.",
    ]
    results: dict = {}
    with torch.inference_mode():  # no autograd graph: cached K/V would otherwise keep every activation alive
        if not args.skip_gqa:
            _run_gqa(args, report, results)
        if not args.skip_mla:
            _run_mla(args, report, results)
    report.write()
    save_plot("attention", _draw(results))
