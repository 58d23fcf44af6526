"""Cross-check of KIVI quality: an independent fake-quantization KIVI vs ``QuantizedKVCache``, same text.

    python scripts/bench/kivi_reference.py     # ~3 min, one CPU thread; prints Δppl per variant

Boundary: a standalone check, not part of the ``kvquant`` table. The reference keeps full-precision keys/values
in a DynamicCache and returns min-max fake-quantized copies (fp32 scales, no bit packing) of the tokens KIVI
(arXiv:2402.02750) would have quantized: keys per channel in groups of ``G`` tokens, values per token in groups of
``G`` channels. Groups are aligned from token 0 and quantized independently, so re-deriving them at every step
equals quantizing them once. Two flush splits: ours (oldest whole groups leave a window of ≤ R tokens) and the
official KIVI code's (keys flushed R at a time, values leaving an R-token window one by one). Evaluation is the
``kvquant`` benchmark's: 128-token prefill, then 16-token teacher-forced chunks, 2 held-out documents × 768 tokens.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `bench` resolves when run as a script

from bench.kvquant import _segments


def fake_quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max quantize-dequantize with the whole extent of ``dim`` as one group (fp32)."""
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (high - low) / (2 ** bits - 1)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return ((x - low) / safe).round().clamp(0, 2 ** bits - 1) * scale + low


class FakeKiviCache(DynamicCache):
    def __init__(self, config, bits: int, group: int, residual: int, split: str):
        super().__init__(config=config)
        self.bits, self.group, self.residual, self.split = bits, group, residual, split

    def _quantized_counts(self, tokens: int) -> tuple[int, int]:
        if self.split == "ours":
            count = math.ceil(max(0, tokens - self.residual) / self.group) * self.group
            return count, count
        return (tokens // self.residual) * self.residual, max(0, tokens - self.residual)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)  # [B, H, S, D]
        n_keys, n_values = self._quantized_counts(keys.shape[2])
        keys, values = keys.clone(), values.clone()
        if n_keys:
            grouped = keys[:, :, :n_keys].unflatten(2, (n_keys // self.group, self.group))  # [B, H, N, G, D]
            keys[:, :, :n_keys] = fake_quantize(grouped, self.bits, 3).flatten(2, 3)
        if n_values:
            grouped = values[:, :, :n_values].unflatten(3, (-1, self.group))  # [B, H, S, D/G, G]
            values[:, :, :n_values] = fake_quantize(grouped, self.bits, 4).flatten(3, 4)
        return keys, values


def perplexity(model, segments, make_cache) -> float:
    nll, count = 0.0, 0
    for ids in segments:
        cache = make_cache()
        logits = model(ids[:, :128], cache=cache).logits[:, -1:]
        for start in range(128, ids.shape[1], 16):
            chunk = ids[:, start:start + 16]
            out = model(chunk, cache=cache).logits
            predicting = torch.cat([logits, out[:, :-1]], dim=1)
            nll += torch.nn.functional.cross_entropy(predicting[0], chunk[0], reduction="sum").item()
            count += chunk.shape[1]
            logits = out[:, -1:]
    return math.exp(nll / count)


def main() -> None:
    from hf_kvspec import QuantizedKVCache, load_bundled_model
    from hf_kvspec.corpus import load_text_corpus

    torch.set_num_threads(1)
    model, tokenizer = load_bundled_model()
    docs = [tokenizer(t, return_tensors="pt").input_ids[0] for t in load_text_corpus("python-docs", "test")["text"]]
    segments, config = _segments(docs, 2, 768), model.config
    with torch.inference_mode():
        base = perplexity(model, segments, lambda: DynamicCache(config=config))
        for bits, group in ((2, 32), (4, 64)):
            factories = {
                "QuantizedKVCache": lambda b=bits, g=group: QuantizedKVCache(
                    config, bits=b, group_size=g, residual_length=128),
                "reference, our split": lambda b=bits, g=group: FakeKiviCache(config, b, g, 128, "ours"),
                "reference, official split": lambda b=bits, g=group: FakeKiviCache(config, b, g, 128, "official"),
            }
            results = {name: perplexity(model, segments, make) for name, make in factories.items()}
            print(f"KIVI-{bits} G{group} (DynamicCache ppl {base:.4f}): " + "; ".join(
                f"{name} {value:.4f} ({100 * (value / base - 1):+.2f}%)" for name, value in results.items()), flush=True)


if __name__ == "__main__":
    main()
