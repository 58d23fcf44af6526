"""Feature cache: shards read back equal the online features; a cache for other settings is refused."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.heads.features import (
    CachedFeatures,
    FeatureCacheMismatchError,
    collate,
    extract_to_cache,
    target_features,
)
from tests.tiny_models import tiny_model


def test_cached_features_equal_online_features(tmp_path, monkeypatch):
    monkeypatch.setattr("hf_kvspec.heads.features.SHARD_TOKENS", 20)  # force several shards
    target = tiny_model("llama", seed=0)
    torch.manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 96, (n,)).tolist(), "prompt_length": n // 3} for n in (9, 4, 13, 7, 11)]
    meta = {"fingerprint": "x", "examples_hash": "y"}
    extract_to_cache(target, examples, tmp_path, [1, -1], meta, batch_size=2, progress=False)
    assert len(list(tmp_path.glob("features-*.safetensors"))) > 1
    cached = CachedFeatures(tmp_path, expected_meta=meta)
    assert len(cached) == len(examples)
    by_ids = {tuple(item["input_ids"].tolist()): item for item in cached}
    for example in examples:
        item = by_ids[tuple(example["input_ids"])]
        ids = torch.tensor([example["input_ids"]])
        features, tokens = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), [1, -1])
        # stored in float16: relative error <= 2**-11 per element, plus right-padding reorders nothing
        torch.testing.assert_close(item["features"].float(), features[0], rtol=2e-3, atol=2e-3)
        assert torch.equal(item["target_tokens"], tokens[0])
        assert item["prompt_length"] == example["prompt_length"]
    # the same call again is a cache hit; other metadata is refused with the fix named
    extract_to_cache(target, examples, tmp_path, [1, -1], meta, progress=False)
    with pytest.raises(FeatureCacheMismatchError, match="Delete it"):
        extract_to_cache(target, examples, tmp_path, [-1], meta, progress=False)


def test_collate_right_pads():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "features": torch.ones(3, 2), "target_tokens": torch.tensor([1, 2, 3]),
              "prompt_length": 1},
             {"input_ids": torch.tensor([8]), "features": torch.full((1, 2), 2.0), "target_tokens": torch.tensor([4]),
              "prompt_length": 0}]
    batch = collate(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["valid"].tolist() == [[True] * 3, [True, False, False]]
    assert batch["features"][1].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    assert batch["target_tokens"].tolist() == [[1, 2, 3], [4, 0, 0]]
