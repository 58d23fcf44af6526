"""``n > 1`` choices of one prompt: a request forked from a running one shares its stored prompt blocks
copy-on-write (``RaggedPagedCache.fork``, ``add_request(fork_of=...)``) and still decodes exactly as
``generate()`` does on the prompt alone."""

from __future__ import annotations

import pytest

from hf_kvspec.serving.engine import Engine
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_fork_shares_the_prefix_blocks_and_copies_the_partial_one_on_write(llama):
    engine = Engine(llama, kv_budget=16, block_size=4, max_tokens_per_round=16, max_running=4,
                    enable_prefix_caching=False)
    cache = engine.cache
    parent = engine.add_request(random_prompts([10])[0], max_new_tokens=4)
    engine.step()  # prefills the 10-token prompt: blocks [b0, b1, b2], b2 half full
    table = cache.tables.table(cache._row_of[parent])
    cache.fork(parent, 99, 9)
    child = cache.tables.table(cache._row_of[99])
    assert child == table and cache.length(99) == 9
    assert [cache.pool.ref_count(b) for b in table] == [2, 2, 2]
    cache.reserve(99, 10)  # the child writes position 9, inside the shared block b2: it gets its own copy
    child = cache.tables.table(cache._row_of[99])
    assert child[:2] == table[:2] and child[2] not in table
    assert [cache.pool.ref_count(b) for b in table] == [2, 2, 1]
    cache.rollback_reservations()
    cache.release(99)
    with pytest.raises(ValueError, match="outside"):
        cache.fork(parent, 98, 11)
    with pytest.raises(ValueError, match="already"):
        cache.fork(parent, parent, 4)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_choices_compute_the_prompt_once_and_decode_exactly(llama, prefix_caching):
    prompt = random_prompts([13], seed=3)[0]
    engine = Engine(llama, kv_budget=32, block_size=4, max_tokens_per_round=16, max_running=4,
                    enable_prefix_caching=prefix_caching)
    first = engine.add_request(prompt, max_new_tokens=6)
    engine.step()  # the whole prompt in one round; the first choice has its first token
    others = [engine.add_request(prompt, max_new_tokens=6, fork_of=first) for _ in range(2)]
    widths = []
    while engine.has_unfinished():
        engine.step()
        widths.append(engine.stats.rounds[-1].num_tokens)
    assert widths[0] == 1 + 2  # the first choice's decode + one prompt token per forked choice
    reference = greedy_reference(llama, prompt, 6)
    outputs = [engine.get_output(request_id) for request_id in [first, *others]]
    assert [o.output_ids for o in outputs] == [reference] * 3
    assert [o.metrics.cached_prompt_tokens for o in outputs] == [0, 12, 12]  # all but the last prompt token shared
    assert_pool_full(engine)


def test_a_fork_whose_parent_is_gone_computes_its_prompt(llama):
    prompt = random_prompts([9], seed=4)[0]
    engine = Engine(llama, kv_budget=32, block_size=4, max_tokens_per_round=16, max_running=4,
                    enable_prefix_caching=False)
    first = engine.add_request(prompt, max_new_tokens=1)
    run_to_end(engine)
    other = engine.add_request(prompt, max_new_tokens=3, fork_of=first)
    engine.step()
    assert engine.stats.rounds[-1].num_tokens == 9
    run_to_end(engine)
    assert engine.get_output(other).output_ids == greedy_reference(llama, prompt, 3)
    assert_pool_full(engine)
