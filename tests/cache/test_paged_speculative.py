"""Speculative decoding on a PagedCache: greedy output equals plain greedy, and rejected drafts are
cropped away block by block (no leaked blocks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hf_kvspec.speculative.loop", reason="the speculative engine (hf_kvspec.speculative) is missing")

import hf_kvspec
from hf_kvspec.attention.paged import ATTN_NAME, register_paged_attention, unregister_paged_attention
from hf_kvspec.cache.paged import PagedCache
from tests.speculative.helpers import batch, drafts_for

MAX_NEW = 20


@pytest.fixture(scope="module")
def models():
    return drafts_for("llama")


def _speculative(target, draft, ids, mask, cache, num_draft_tokens=4):
    assistant = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=num_draft_tokens)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant, cache=cache,
                          return_dict_in_generate=True)
    return out.sequences, out.acceptance


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("draft_name", ["partial", "wrong"])
def test_speculative_greedy_on_paged_cache_equals_plain_greedy(models, draft_name, bs):
    target, drafts = models
    ids, mask = batch(bs)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    cache = PagedCache(target.config, block_size=4, num_blocks=64)
    out, stats = _speculative(target, drafts[draft_name], ids, mask, cache)
    assert torch.equal(out, expected)
    assert not stats.empty  # canary: the speculative loop really ran
    # every block still held belongs to the kept tokens: rejected drafts left nothing behind
    assert cache.num_used_blocks() == bs * -(-cache.get_seq_length() // 4)


def test_paged_attention_implementation_under_speculation(models):
    target, drafts = models
    ids, mask = batch(4)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    register_paged_attention()
    target.set_attn_implementation(ATTN_NAME)
    try:
        out, _ = _speculative(target, drafts["partial"], ids, mask, PagedCache(target.config, block_size=4, num_blocks=64))
    finally:
        target.set_attn_implementation("sdpa")
        unregister_paged_attention()
    assert torch.equal(out, expected)


def test_crop_on_rejection_frees_blocks(models):
    """With a drafter that is always wrong, every round writes 1 + K tokens and crops K of them."""
    target, drafts = models
    ids, mask = batch(1)
    cache = PagedCache(target.config, block_size=2, num_blocks=64)
    freed = []
    original_crop = cache.crop

    def recording_crop(tokens_to_remove):
        before = cache.num_free_blocks()
        original_crop(tokens_to_remove)
        freed.append((tokens_to_remove, cache.num_free_blocks() - before))

    cache.crop = recording_crop  # instance-level spy on this test's own cache
    _speculative(target, drafts["wrong"], ids, mask, cache, num_draft_tokens=5)
    rejections = [(removed, blocks) for removed, blocks in freed if removed < 0]
    assert rejections, "the loop never cropped the cache"
    full_rejections = [blocks for removed, blocks in rejections if removed <= -5]
    assert len(full_rejections) >= 5
    assert all(blocks >= 2 for blocks in full_rejections)  # 5 tokens span >= 2 blocks of 2
    assert cache.num_used_blocks() == -(-cache.get_seq_length() // 2)


def test_transformers_assisted_decoding_on_paged_cache(models):
    """transformers' built-in assisted generation (assistant_model=, batch 1) crops the cache it is given."""
    target, drafts = models
    ids, mask = batch(1)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    cache = PagedCache(target.config, block_size=4, num_blocks=64)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          assistant_model=drafts["wrong"], cache=cache)
    assert torch.equal(out, expected)
    assert cache.num_used_blocks() == -(-cache.get_seq_length() // 4)
