"""The training-time-test unroll equals drafting step by step with a cache, as inference does."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_kvspec.heads.configuration import EagleConfig
from hf_kvspec.heads.modeling_eagle import EagleHead, unrolled_step_mask
from tests.tiny_models import tiny_model


def test_mask_worked_example():
    mask = unrolled_step_mask(torch.ones(1, 3, dtype=torch.bool), step=1)[0, 0]
    expected = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def _sequential_chain(drafter, next_ids, fused, start, steps):
    """Reference: prefix rows 0..start with true features, then ``steps - 1`` own-hidden steps, one at a time."""
    cache = DynamicCache()
    hidden = drafter.step(next_ids[:, : start + 1], fused[:, : start + 1], torch.arange(start + 1)[None], None, cache)
    outputs = [hidden[:, -1]]
    for j in range(1, steps):
        size = cache.get_seq_length()
        mask = torch.zeros(1, 1, 1, size + 1)  # the new row sees everything cached so far
        row = drafter.step(next_ids[:, start + j: start + j + 1], outputs[-1][:, None], torch.tensor([[start + j]]),
                           mask, cache)
        outputs.append(row[:, 0])
    return outputs


def test_unrolled_equals_sequential_drafting():
    torch.manual_seed(0)
    base = tiny_model("llama", seed=0)
    drafter = EagleHead(EagleConfig.for_base_model(base, "t", feature_layers=[1, -1])).attach(base).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(3, 96, (1, 9))
    features = drafter.collect_features(base(ids, output_hidden_states=True).hidden_states)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    with torch.no_grad():
        unrolled = drafter.unrolled(next_ids, features, torch.ones_like(ids, dtype=torch.bool), steps=3)
        fused = drafter.fuse_features(features)
        for start in (0, 3, 5):
            reference = _sequential_chain(drafter, next_ids, fused, start, steps=3)
            for j in range(3):
                torch.testing.assert_close(unrolled[j][:, start], reference[j], rtol=1e-5, atol=1e-5)


def test_padding_does_not_leak_into_real_rows():
    base = tiny_model("llama", seed=0)
    drafter = EagleHead(EagleConfig.for_base_model(base, "t")).attach(base).eval()
    ids = torch.randint(3, 96, (1, 6))
    features = base(ids, output_hidden_states=True).hidden_states[-1]
    padded_ids = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    padded_features = torch.cat([features, torch.randn(1, 3, 64) * 100], 1)
    valid = torch.arange(9)[None] < 6
    with torch.no_grad():
        clean = drafter.unrolled(ids, features, torch.ones_like(ids, dtype=torch.bool), 2)
        dirty = drafter.unrolled(padded_ids, padded_features, valid, 2)
    for j, (a, b) in enumerate(zip(clean, dirty)):
        keep = 6 - j  # step j at row t consumes token column t+j: the last j rows read past the end (no label)
        torch.testing.assert_close(a[:, :keep], b[:, :keep], rtol=1e-5, atol=1e-5)
