"""PagedCache inside ``model.generate``: token-identical to DynamicCache (fp32 tiny models), beam search,
tiny budgets with eviction, NaN-poisoned unused slots, rollback, batch operations, prefix reuse that
really skips prefill, exhaustion."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from hf_kvspec.attention.paged import ATTN_NAME, register_paged_attention, unregister_paged_attention
from hf_kvspec.cache.block_pool import OutOfBlocksError
from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.memory import kv_bytes_per_token
from tests.tiny_models import left_padded_batch, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 4, 5], [7, 30, 31, 7, 40, 41, 42, 43, 44, 45, 46, 47, 48], [9, 8]]
NEW_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def paged_attention_registered():
    register_paged_attention()
    yield
    unregister_paged_attention()


@functools.cache
def model(kind: str, attn: str | None = None):
    return tiny_model(kind, attn_implementation=attn)


def batch(size: int):
    return left_padded_batch(PROMPTS[:size])


@functools.cache
def reference(kind: str, size: int, num_beams: int = 1) -> torch.Tensor:
    ids, mask = batch(size)
    m = model(kind)
    return m.generate(ids, attention_mask=mask, cache=DynamicCache(config=m.config), **_gen_kwargs(num_beams))


def _gen_kwargs(num_beams: int = 1) -> dict:
    return dict(max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=num_beams, pad_token_id=0)


def generate(kind: str, size: int, cache: PagedCache, attn: str | None = None, num_beams: int = 1):
    ids, mask = batch(size)
    return model(kind, attn).generate(ids, attention_mask=mask, cache=cache, **_gen_kwargs(num_beams))


# ---- token identity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("size", [1, 4])
def test_greedy_matches_dynamic_cache(kind, block_size, size):
    cache = PagedCache(model(kind).config, block_size=block_size, num_blocks=4 * 32 // block_size + 4)
    assert torch.equal(generate(kind, size, cache), reference(kind, size))
    stored = NEW_TOKENS - 1 + batch(size)[0].shape[1]  # the last generated token is never fed back
    assert cache.get_seq_length() == stored
    assert cache.num_used_blocks() == size * -(-stored // block_size)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_paged_attention_implementation_matches_dynamic_cache(kind):
    """attn_implementation="kvspec_paged" reads K/V through the block tables (pages + PagedKV kwarg)."""
    cache = PagedCache(model(kind).config, block_size=4, num_blocks=64, enable_prefix_caching=True)
    assert torch.equal(generate(kind, 4, cache, attn=ATTN_NAME), reference(kind, 4))


def test_gemma_style_config_with_gathered_kv():
    cache = PagedCache(model("gemma2").config, block_size=16, num_blocks=16)
    assert cache.is_sliding == [True, False]  # Gemma-2 alternates sliding and global layers
    assert torch.equal(generate("gemma2", 4, cache), reference("gemma2", 4))


def test_mla_latent_cache_is_paged_too():
    """DeepSeek-V3 caches its latent (c_kv in the key slot, k_rope in the value slot): pages follow those shapes."""
    config = model("deepseek_v3").config
    cache = PagedCache(config, block_size=4, num_blocks=32)
    assert torch.equal(generate("deepseek_v3", 4, cache), reference("deepseek_v3", 4))
    assert cache.layers[0].keys.shape[1:] == (4, 1, config.kv_lora_rank)
    assert cache.layers[0].values.shape[1:] == (4, 1, config.qk_rope_head_dim)
    assert cache.nbytes() == kv_bytes_per_token(config, torch.float32) * 4 * 32  # budget arithmetic = storage


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_beam_search_matches_dynamic_cache(kind):
    cache = PagedCache(model(kind).config, block_size=4, num_blocks=64)
    assert torch.equal(generate(kind, 1, cache, num_beams=3), reference(kind, 1, num_beams=3))


def test_beam_reorder_shares_blocks_instead_of_copying():
    cache = PagedCache(model("llama").config, block_size=4, num_blocks=32)
    cache.early_initialization(2, 2, 16, torch.float32, torch.device("cpu"))
    m = model("llama")
    m(torch.tensor([[5, 6, 7, 8, 9, 10]] * 2), cache=cache)  # 6 tokens: blocks [0, 1] and [2, 3]
    assert [cache.block_table(0), cache.block_table(1)] == [[0, 1], [2, 3]]
    cache.reorder_cache(torch.tensor([1, 1]))
    assert [cache.block_table(0), cache.block_table(1)] == [[2, 3], [2, 3]]
    assert cache.num_used_blocks() == 2
    m(torch.tensor([[11], [12]]), cache=cache)  # both rows write into shared block 3: one copies it
    assert cache.block_table(0)[0] == cache.block_table(1)[0] == 2
    assert cache.block_table(0)[1] != cache.block_table(1)[1]


# ---- memory discipline ----------------------------------------------------------------------------------
def test_pages_are_head_major_and_gathered_rows_token_contiguous():
    """Pages keep the [N, P, Hkv, D] shape but live head-major in memory, so a gathered row is contiguous along
    tokens per head (the layout SDPA reads fastest) and holds exactly what was written, in order."""
    cache = PagedCache(model("llama").config, block_size=4, num_blocks=16)
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(2, 2, 6, 16, generator=gen)  # [B, Hkv, T, D]
    cache.update(first, -first, 0)
    cache.update(first, first, 1)  # the other layer of the tiny model, so the next step starts
    step = torch.randn(2, 2, 1, 16, generator=gen)
    keys, values = cache.update(step, -step, 0)
    pages = cache.layers[0].keys
    assert pages.shape == (16, 4, 2, 16) and pages.permute(2, 0, 1, 3).is_contiguous()
    assert keys.shape == (2, 2, 7, 16) and keys.stride()[-2:] == (16, 1)
    assert torch.equal(keys, torch.cat([first, step], dim=2))
    assert torch.equal(values, -torch.cat([first, step], dim=2))


@pytest.mark.parametrize("attn", [None, ATTN_NAME])
def test_nan_in_unused_slots_never_reaches_the_output(attn):
    m = model("llama", attn)
    cache = PagedCache(m.config, block_size=16, num_blocks=24)
    cache.early_initialization(4, 2, 16, torch.float32, torch.device("cpu"))
    for layer in cache.layers:
        layer.keys.fill_(float("nan"))
        layer.values.fill_(float("nan"))
    assert torch.equal(generate("llama", 4, cache, attn=attn), reference("llama", 4))


def test_tiny_budget_with_prefix_caching_evicts_and_stays_exact():
    """9 blocks of 4 tokens, three prompts in turn: cached blocks are evicted and reused, outputs never change."""
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=9, enable_prefix_caching=True)
    prompts = [torch.tensor([p]) for p in ([5] * 14, [6, 7] * 7, [5] * 10 + [9, 9, 9])]
    skipped = []
    for index in [0, 1, 0, 2, 0, 1]:
        ids = prompts[index]
        skipped.append(cache.load_prefix(ids))
        out = m.generate(ids, cache=cache, **_gen_kwargs())
        expected = m.generate(ids, cache=DynamicCache(config=m.config), **_gen_kwargs())
        assert torch.equal(out, expected)
        assert cache.num_used_blocks() + cache.num_free_blocks() == 9
    # call 2 needs 7 of 9 blocks and evicts prompt 0's *last* cached block first (tail-first order), so
    # call 3 reuses 2 blocks and re-caches the third; prompt 2 shares 2 blocks with prompt 0; call 5 hits
    # all 3; prompt 1's blocks were evicted in between
    assert skipped == [0, 0, 8, 8, 12, 0]
    assert 0 < cache.prefix_hit_rate() < 1


def test_out_of_blocks_raises_and_leaves_the_cache_consistent():
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=5)
    ids, mask = batch(4)
    with pytest.raises(OutOfBlocksError, match="needs 16 new block"):
        m.generate(ids, attention_mask=mask, cache=cache, **_gen_kwargs())
    assert cache.num_free_blocks() == 5 and cache.get_seq_length() == 0
    out = m.generate(ids[:1], attention_mask=mask[:1], cache=PagedCache(m.config, block_size=4, num_blocks=8),
                     max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 4)


def test_crop_frees_tail_blocks_and_rolls_back_exactly():
    m = model("llama")
    ids = torch.tensor([list(range(3, 17))])  # 14 tokens
    cache = PagedCache(m.config, block_size=4, num_blocks=8)
    m(ids[:, :10], cache=cache)
    assert cache.num_used_blocks() == 3
    cache.crop(-5)  # 5 tokens left -> 2 blocks
    assert (cache.get_seq_length(), cache.num_used_blocks(), cache.num_free_blocks()) == (5, 2, 6)
    logits = m(ids[:, 5:], cache=cache).logits
    full = m(ids, cache=DynamicCache(config=m.config)).logits[:, 5:]
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)  # fp32, different kernel shapes only
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_batch_select_and_repeat_interleave_are_table_operations():
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=16)
    m(torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]), cache=cache)
    assert [cache.block_table(0), cache.block_table(1)] == [[0, 1], [2, 3]]
    cache.batch_repeat_interleave(2)
    assert [cache.block_table(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert cache.num_used_blocks() == 4 and cache.pool.ref_count(0) == 2
    cache.batch_select_indices(torch.tensor([3]))
    assert cache.block_table(0) == [2, 3] and cache.num_used_blocks() == 2
    cache.reset()
    assert cache.num_free_blocks() == 16 and cache.get_seq_length() == 0


# ---- prefix reuse across generate calls --------------------------------------------------------------
class PrefillCounter:
    """Counts the tokens the model is actually run on, per forward (an independent witness)."""

    def __init__(self, module):
        self.widths: list[int] = []
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.widths.append(kwargs["input_ids"].shape[1])


def test_prefix_reuse_skips_prefill_of_cached_blocks():
    m = model("llama")
    counter = PrefillCounter(m)
    try:
        cache = PagedCache(m.config, block_size=4, num_blocks=64, enable_prefix_caching=True)
        system = list(range(10, 30))  # 20-token shared prefix = 5 full blocks
        first = torch.tensor([[*system, 40, 41, 42]])
        second = torch.tensor([[*system, 50, 51, 52, 53, 54, 55]])
        for ids, expected_skip in ((first, 0), (second, 20), (second, 24)):
            assert cache.load_prefix(ids) == expected_skip
            counter.widths.clear()
            out = m.generate(ids, cache=cache, **_gen_kwargs())
            assert counter.widths[0] == ids.shape[1] - expected_skip  # prefill ran on the uncached tail only
            assert torch.equal(out, m.generate(ids, cache=DynamicCache(config=m.config), **_gen_kwargs()))
        assert cache.prefix_hit_rate() == pytest.approx((5 + 6) / (5 + 6 + 6))
    finally:
        counter.handle.remove()


def test_record_tokens_makes_generated_blocks_reusable_for_the_next_turn():
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=64, enable_prefix_caching=True)
    ids, mask = batch(2)  # 11 columns, row 1 left padded
    cache.load_prefix(ids, mask)
    out = m.generate(ids, attention_mask=mask, cache=cache, **_gen_kwargs())  # 23 columns, 22 stored
    cache.record_tokens(out, mask)
    follow_up = torch.cat([out, torch.tensor([[60, 61, 62]] * 2)], dim=1)
    follow_mask = torch.cat([mask, torch.ones(2, follow_up.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    assert cache.load_prefix(follow_up, follow_mask) == 20  # 5 full blocks, generated tokens included
    again = m.generate(follow_up, attention_mask=follow_mask, cache=cache, **_gen_kwargs())
    expected = m.generate(follow_up, attention_mask=follow_mask, cache=DynamicCache(config=m.config), **_gen_kwargs())
    assert torch.equal(again, expected)
    with pytest.raises(ValueError, match="do not start with"):
        cache.record_tokens(torch.zeros_like(again))


def test_prefix_reuse_with_left_padding_and_salt():
    m = model("qwen2")
    ids, mask = batch(4)
    cache = PagedCache(m.config, block_size=2, num_blocks=128, enable_prefix_caching=True, cache_salt="tenant-a")
    for expected_skip in (0, 12):
        assert cache.load_prefix(ids, mask) == expected_skip
        out = m.generate(ids, attention_mask=mask, cache=cache, **_gen_kwargs())
        assert torch.equal(out, reference("qwen2", 4))
    other = PagedCache(m.config, block_size=2, num_blocks=128, enable_prefix_caching=True, cache_salt="tenant-b")
    other.pool, other.tables.pool = cache.pool, cache.pool  # same pool, other tenant: no hits
    other.reset()
    assert other.load_prefix(ids, mask) == 0


def test_per_request_salt_overrides_the_cache_default():
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=64, enable_prefix_caching=True)
    ids = torch.tensor([list(range(10, 23))])  # 13 tokens: 3 full blocks within the first 12
    for salt, expected_skip in (("alice", 0), ("bob", 0), ("alice", 12), (None, 0), ("bob", 12)):
        assert cache.load_prefix(ids, cache_salt=salt) == expected_skip
        m.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="cache_salt"):
        cache.load_prefix(ids, cache_salt="")


def test_load_prefix_requires_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PagedCache(model("llama").config, num_blocks=4).load_prefix(torch.tensor([[1, 2, 3]]))


# ---- construction and introspection -------------------------------------------------------------------
def test_memory_budget_sizes_the_pool():
    config = model("llama").config
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # K+V · layers · kv heads · head dim · fp32 bytes · block size
    assert PagedCache(config, block_size=16, memory_budget=10 * per_block + 5).num_total_blocks() == 10
    assert PagedCache(config, block_size=16, memory_budget="1MiB").num_total_blocks() == 2**20 // per_block
    with pytest.raises(ValueError, match="raise it"):
        PagedCache(config, memory_budget=100)


def test_introspection_and_nbytes():
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=10)
    m(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache)
    assert cache.num_total_blocks() == 10 and cache.num_used_blocks() == 2 and cache.num_free_blocks() == 8
    assert cache.utilization() == pytest.approx(6 / 8)
    assert cache.nbytes() == 2 * 2 * 10 * 4 * 2 * 16 * 4  # layers · (K, V) · N · P · Hkv · D · fp32
    assert cache.is_croppable and not cache.is_compileable
    with pytest.raises(IndexError):
        cache.block_table(0, layer_idx=5)


def test_rejects_unsupported_layer_types_and_bad_arguments():
    from tests.tiny_models import tiny_config

    with pytest.raises(ValueError, match="block_size"):
        PagedCache(tiny_config("llama"), block_size=0, num_blocks=4)
    with pytest.raises(ValueError, match="supports"):
        PagedCache(tiny_config("llama", layer_types=["full_attention", "linear_attention"]), num_blocks=4)


def test_batch_size_change_needs_reset():
    m = model("llama")
    cache = PagedCache(m.config, block_size=4, num_blocks=16)
    m(torch.tensor([[5, 6, 7]]), cache=cache)
    with pytest.raises(ValueError, match="reset"):
        m(torch.tensor([[5], [6]]), cache=cache)


def test_make_cache_knows_paged():
    from hf_kvspec.cache.factory import CACHE_CHOICES, make_cache

    assert "paged" in CACHE_CHOICES
    assert isinstance(make_cache("paged", model("llama").config), PagedCache)
