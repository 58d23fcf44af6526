"""KV-cache bytes per config, dtype and bit width; formula checked against a real cache of the bundled model.

    python scripts/benchmark.py memory [--seq-len 4096]
"""

from __future__ import annotations

import torch

from bench.harness import Report, save_plot
from hf_kvspec.memory import format_bytes, kv_cache_bytes
from hf_kvspec.presets import PRESETS, load_config

# (label, kwargs of kv_cache_bytes): fp16 is the baseline of every ratio
_STORAGES = [
    ("fp16", {"dtype": torch.float16}),
    ("fp8", {"dtype": torch.float8_e4m3fn}),
    ("int4 g64", {"dtype": torch.float16, "bits": 4, "group_size": 64}),
    ("int2 g32", {"dtype": torch.float16, "bits": 2, "group_size": 32}),
]


def add_arguments(parser) -> None:
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--measure-tokens", type=int, default=512, help="prompt length for the measured check")


def _formula_rows(report: Report, seq_len: int) -> dict:
    per_token = {}
    for name in PRESETS:
        config = load_config(name)
        base = kv_cache_bytes(config, seq_len, dtype=torch.float16)
        per_token[name] = {}
        for label, kwargs in _STORAGES:
            size = kv_cache_bytes(config, seq_len, **kwargs)
            per_token[name][label] = size / seq_len
            report.add(config=name, storage=label, per_sequence=format_bytes(size), bytes=size,
                       ratio_vs_fp16=round(base / size, 3))
    return per_token


def _measured_row(report: Report, tokens: int) -> None:
    """The bundled model's real DynamicCache after a prompt of ``tokens`` tokens vs the formula."""
    from transformers import DynamicCache

    from hf_kvspec.models import load_bundled_model

    model, _ = load_bundled_model()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (1, tokens)), cache=cache)
    measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    formula = kv_cache_bytes(model.config, tokens, dtype=torch.float32)
    report.notes.append(f"Measured check: bundled SmolLM2-135M DynamicCache after {tokens} tokens (fp32) holds "
                        f"{measured:,} B; formula says {formula:,} B ({'equal' if measured == formula else 'DIFFERENT'}).")


def run(args) -> None:
    report = Report("memory", f"KV-cache bytes per sequence at {args.seq_len} tokens",
                    ["config", "storage", "per_sequence", "bytes", "ratio_vs_fp16"],
                    settings={"seq_len": args.seq_len})
    report.notes.append("Quantized rows: b code bits + fp16 scale and zero per group, no residual window.")
    per_token = _formula_rows(report, args.seq_len)
    _measured_row(report, args.measure_tokens)
    report.write()

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        names = list(per_token)
        width = 0.8 / len(_STORAGES)
        for i, (label, _) in enumerate(_STORAGES):
            ax.bar([x + i * width for x in range(len(names))], [per_token[n][label] / 1024 for n in names],
                   width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
        ax.set_yscale("log")
        ax.set_ylabel("KiB per token (all layers)")
        ax.set_title("KV cache per token by model and storage")
        ax.legend()

    save_plot("memory", draw)
