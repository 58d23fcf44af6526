"""One bad request never fails another: a round that raises is re-run request by request, the culprits end with
finish reason ERROR, and every bystander's greedy output equals its own ``generate(do_sample=False)``."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason, RequestFailedError
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end


class Poison(RuntimeError):
    pass


def raising(after: int = 0):
    """A logits processor that raises from its ``after``-th call on (0: always)."""
    calls = {"n": 0}

    def processor(input_ids, scores):
        calls["n"] += 1
        if calls["n"] > after:
            raise Poison(f"poisoned processor (call {calls['n']})")
        return scores
    return processor


def nan_scores(input_ids, scores):
    """Not an exception in itself: sampling from NaN probabilities is (``torch.multinomial``)."""
    return torch.full_like(scores, float("nan"))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _run(engine, prompts, poison: dict) -> tuple[list[int], list]:
    ids = []
    for i, prompt in enumerate(prompts):
        kwargs = poison.get(i, {})
        ids.append(engine.add_request(prompt, max_new_tokens=10, **kwargs))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    return ids, deltas


@pytest.mark.parametrize("assistant", [None, "ngram"])
def test_culprits_fail_alone_and_bystanders_match_generate(llama, assistant):
    prompts = random_prompts([9, 14, 5, 11, 7], seed=21)
    poison = {1: {"logits_processor": [raising(after=3)]},  # fails mid-decode
              3: {"logits_processor": [nan_scores], "do_sample": True, "seed": 3}}  # fails at its first sample
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=16, max_running=5, assistant=assistant)
    ids, deltas = _run(engine, prompts, poison)
    outputs = [engine.get_output(request_id) for request_id in ids]
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if i in poison:
            assert output.finish_reason is FinishReason.ERROR and output.error
        else:
            assert output.finish_reason is not FinishReason.ERROR
            assert output.output_ids == greedy_reference(llama, prompt, 10)
    assert "Poison: poisoned processor" in outputs[1].error
    errors = [d.request_id for d in deltas if d.finish_reason is FinishReason.ERROR]
    assert sorted(errors) == [ids[1], ids[3]]  # each culprit reported once, nobody else
    assert_pool_full(engine)


def test_a_culprit_under_preemption_leaks_no_block(llama):
    """A budget so small that rounds preempt: culprits still fail alone and every block comes back."""
    prompts = random_prompts([13, 11, 9, 12], seed=22)
    engine = Engine(llama, kv_budget=10, block_size=4, max_tokens_per_round=8, max_running=4)
    ids, _ = _run(engine, prompts, {2: {"logits_processor": [raising(after=1)]}})
    for i, (prompt, request_id) in enumerate(zip(prompts, ids)):
        output = engine.get_output(request_id)
        if i == 2:
            assert output.finish_reason is FinishReason.ERROR
        else:
            assert output.output_ids == greedy_reference(llama, prompt, 10)
    assert engine.stats.summary()["preemptions"] > 0
    assert_pool_full(engine)


def test_stream_raises_for_its_failed_request_only(llama):
    prompts = random_prompts([6, 8], seed=23)
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=16, max_running=2)
    bad = engine.add_request(prompts[0], max_new_tokens=6, logits_processor=[raising(after=2)])
    good = engine.add_request(prompts[1], max_new_tokens=6)
    with pytest.raises(RequestFailedError, match="poisoned processor") as info:
        list(engine.stream(bad))
    assert isinstance(info.value.__cause__, Poison)
    tokens = [t for delta in engine.stream(good) for t in delta.new_token_ids]
    assert tokens == greedy_reference(llama, prompts[1], 6)
    assert_pool_full(engine)


def test_generate_batch_raises_naming_the_failed_prompt(llama):
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=16, max_running=2)
    prompts = random_prompts([6, 8], seed=24)

    def fails_on_prompt_1(input_ids, scores):  # generate_batch gives every prompt the same processors
        if input_ids[0, :len(prompts[1])].tolist() == prompts[1]:
            raise Poison("only prompt 1")
        return scores
    with pytest.raises(RequestFailedError, match="prompt 1"):
        engine.generate_batch(prompts, progress_bar=False, max_new_tokens=4, logits_processor=[fails_on_prompt_1])
    assert_pool_full(engine)


def test_a_failure_past_the_commit_point_fails_that_request_only(llama):
    """A stop-string check that raises (after the round's K/V were kept) ends its own request only."""

    class Tokenizer:  # decodes fine for one request, raises for the other
        def decode(self, ids, skip_special_tokens=False):
            return "x" * len(ids)

    prompts = random_prompts([6, 7], seed=25)
    engine = Engine(llama, Tokenizer(), kv_budget=64, block_size=4, max_tokens_per_round=16, max_running=2)
    good = engine.add_request(prompts[0], max_new_tokens=5, stop_strings=["never"])
    bad = engine.add_request(prompts[1], max_new_tokens=5, stop_strings=["never"])
    engine.step()  # prefill both
    original = engine._append

    def append(request, tokens, now):
        if request.request_id == bad:
            raise Poison("stop check")
        return original(request, tokens, now)
    engine._append = append
    run_to_end(engine)
    assert engine.get_output(bad).finish_reason is FinishReason.ERROR
    assert engine.get_output(good).output_ids == greedy_reference(llama, prompts[0], 5)
    assert_pool_full(engine)
