"""Each request's greedy output equals ``generate(do_sample=False)`` on its prompt alone, token for token, under
joins and leaves, chunked prefill, prefix hits, preemption, cancellation and up to 16 rows; the pool is full
afterwards in every scenario."""

from __future__ import annotations

import pytest

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end, run_with_arrivals


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def check_outputs(engine, model, ids, prompts, max_new):
    for request_id, prompt in zip(ids, prompts):
        out = engine.get_output(request_id)
        assert out.output_ids == greedy_reference(model, prompt, max_new), f"request {request_id}"
        assert out.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])  # GQA 2 / MQA / sliding window / softcap
def test_batch_of_uneven_prompts(kind):
    model = tiny_model(kind)
    prompts = random_prompts([5, 17, 33, 9, 2, 12])
    engine = Engine(model, kv_budget=96, block_size=4, max_tokens_per_round=24, max_running=6)
    ids = [engine.add_request(p, max_new_tokens=14) for p in prompts]
    run_to_end(engine)
    check_outputs(engine, model, ids, prompts, 14)
    assert_pool_full(engine)


def test_joins_and_leaves_between_rounds(llama):
    """Requests arrive while others decode, with different lengths, so rows leave at different rounds."""
    prompts = random_prompts([6, 21, 3, 14, 30, 8, 11], seed=1)
    max_new = [4, 12, 7, 16, 5, 9, 13]
    engine = Engine(llama, kv_budget=128, block_size=4, max_tokens_per_round=32, max_running=4)
    ids = run_with_arrivals(engine, prompts, max_new, {0: [0, 1], 2: [2], 3: [3, 4], 7: [5], 9: [6]})
    for request_id, prompt, n in zip(ids, prompts, max_new):
        assert engine.get_output(request_id).output_ids == greedy_reference(llama, prompt, n)
    assert_pool_full(engine)


def test_chunked_prefill_under_a_small_budget(llama):
    """Prompts far longer than the budget are split over many rounds while decode rows keep going."""
    prompts = random_prompts([70, 3, 45, 4], seed=2)
    engine = Engine(llama, kv_budget=128, block_size=4, max_tokens_per_round=5, max_running=4)
    ids = [engine.add_request(p, max_new_tokens=10) for p in prompts]
    run_to_end(engine)
    check_outputs(engine, llama, ids, prompts, 10)
    assert max(r.num_tokens for r in engine.stats.rounds) <= 5
    mixed = [r for r in engine.stats.rounds if 0 < r.num_decode_rows < r.num_rows]
    assert mixed, "decode rows never shared a round with a prefill chunk"
    assert_pool_full(engine)


def test_sixteen_rows(llama):
    prompts = random_prompts([3 + 2 * i for i in range(16)], seed=3)
    engine = Engine(llama, kv_budget=256, block_size=8, max_tokens_per_round=64, max_running=16)
    ids = [engine.add_request(p, max_new_tokens=9) for p in prompts]
    run_to_end(engine)
    check_outputs(engine, llama, ids, prompts, 9)
    assert max(r.num_rows for r in engine.stats.rounds) == 16
    assert_pool_full(engine)


def test_prefix_hits_on_a_shared_system_prompt(llama):
    system = random_prompts([24], seed=4)[0]
    tails = random_prompts([3, 7, 5], seed=5)
    prompts = [system + tail for tail in tails]
    engine = Engine(llama, kv_budget=128, block_size=4, max_tokens_per_round=64, max_running=4)
    first = engine.add_request(prompts[0], max_new_tokens=6)
    run_to_end(engine)
    ids = [first] + [engine.add_request(p, max_new_tokens=6) for p in prompts[1:]]
    run_to_end(engine)
    outputs = [engine.get_output(i) for i in ids]
    assert [o.metrics.cached_prompt_tokens for o in outputs] == [0, 24, 24]
    for out, prompt in zip(outputs, prompts):
        assert out.output_ids == greedy_reference(llama, prompt, 6)
    assert engine.stats.prefix_hit_rate > 0
    assert_pool_full(engine)


def test_salt_keeps_tenants_apart(llama):
    prompt = random_prompts([20], seed=6)[0]
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=2)
    engine.add_request(prompt, max_new_tokens=3, salt="tenant-a")
    run_to_end(engine)
    other = engine.add_request(prompt, max_new_tokens=3, salt="tenant-b")
    same = engine.add_request(prompt, max_new_tokens=3, salt="tenant-a")
    run_to_end(engine)
    assert engine.get_output(other).metrics.cached_prompt_tokens == 0
    assert engine.get_output(same).metrics.cached_prompt_tokens == 16  # 4 full blocks of the 19 prefillable
    assert_pool_full(engine)


def test_preemption_recomputes_without_changing_outputs(llama):
    """A pool far smaller than the batch's peak: requests are preempted and recomputed, outputs unchanged."""
    prompts = random_prompts([10, 13, 7, 16, 9, 12], seed=7)
    engine = Engine(llama, kv_budget=20, block_size=4, max_tokens_per_round=32, max_running=6)
    ids = [engine.add_request(p, max_new_tokens=24) for p in prompts]
    run_to_end(engine)
    assert engine.stats.num_preemptions > 0
    check_outputs(engine, llama, ids, prompts, 24)
    assert_pool_full(engine)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_cancellation_leaves_others_unchanged(llama, enable_prefix_caching):
    prompts = random_prompts([8, 15, 6, 11], seed=8)
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=16, max_running=3,
                    enable_prefix_caching=enable_prefix_caching)
    ids = [engine.add_request(p, max_new_tokens=12) for p in prompts]
    for _ in range(4):
        engine.step()
    engine.cancel(ids[1])  # running
    engine.cancel(ids[3])  # still waiting (max_running=3)
    deltas = engine.step()
    assert {d.request_id for d in deltas if d.finish_reason is FinishReason.CANCELLED} == {ids[1], ids[3]}
    run_to_end(engine)
    for i in (0, 2):
        assert engine.get_output(ids[i]).output_ids == greedy_reference(llama, prompts[i], 12)
    cancelled = engine.get_output(ids[1])
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert cancelled.output_ids == greedy_reference(llama, prompts[1], 12)[: len(cancelled.output_ids)]
    assert_pool_full(engine)
