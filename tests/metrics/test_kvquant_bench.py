"""scripts/bench/kvquant.py's perplexity section measures through the cache_fidelity metric: on a tiny model its
perplexity equals the benchmark's former hand-written chunked cross-entropy, cache by cache."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def _former_perplexity(model, ids, name, args, kvquant) -> float:
    """The benchmark's computation before the metric existed: chunked decoding, summed cross-entropy per chunk."""
    nll, count = 0.0, 0
    kvquant._use_attention(model, name)
    cache = kvquant._make(name, model.config)
    logits = model(ids[:, :args.prefix], cache=cache).logits[:, -1:]
    for start in range(args.prefix, ids.shape[1], args.chunk):
        chunk = ids[:, start:start + args.chunk]
        chunk_logits = model(chunk, cache=cache).logits
        predicting = torch.cat([logits, chunk_logits[:, :-1]], dim=1)
        nll += torch.nn.functional.cross_entropy(predicting[0].float(), chunk[0], reduction="sum").item()
        count += chunk.shape[1]
        logits = chunk_logits[:, -1:]
    return math.exp(nll / count)


@torch.inference_mode()
def test_fidelity_section_reproduces_the_former_perplexity():
    from bench import kvquant
    from hf_kvspec.attention.quantized import register_quantized_attention

    register_quantized_attention()
    model = tiny_model("llama", seed=0)
    segments = [torch.randint(3, 96, (1, 37), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    args = SimpleNamespace(prefix=8, chunk=5)
    results = kvquant._fidelity(model, segments, ["dynamic", "int8"], args)
    for name in ("dynamic", "int8"):
        former = [_former_perplexity(model, ids, name, args, kvquant) for ids in segments]
        # the former figure was one exp(mean NLL) over both segments (29 predicted tokens each)
        expected = math.exp(sum(math.log(p) for p in former) / 2)
        assert results[name]["perplexity"] == pytest.approx(expected, rel=1e-6)  # fp32 sums in another order
        assert results[name]["tokens"] == 2 * 29
    assert results["dynamic"]["kl_divergence"] == 0.0 and results["dynamic"]["top1_agreement"] == 1.0
    assert 0.0 < results["int8"]["kl_divergence"] < 0.01  # int8 keys/values move a random tiny model a little
    assert results["int8"]["reference_perplexity"] == results["dynamic"]["perplexity"]
