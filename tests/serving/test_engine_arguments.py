"""Every ``Engine`` argument is checked where it is given, by name (issue 40's weak cases): a request that would
fail inside a round, or never stop, is refused at ``add_request`` before anything is queued."""

from __future__ import annotations

import threading

import pytest

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason, RequestDelta
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")  # 96 ids


class Words:
    """A stand-in tokenizer: enough for stop strings (decode only)."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


REFUSED = [  # (add_request keywords, fragment of the message)
    ({"prompt": [5, 9, 500]}, "prompt has token id(s) [500] outside the model's vocabulary of 96"),
    ({"prompt": [5, 96]}, "vocabulary of 96"),
    ({"prompt": [5, True]}, "non-negative integers"),
    ({"do_sample": "yes"}, "do_sample must be True or False"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"temperature": "0.7", "do_sample": True}, "temperature must be a finite number"),
    ({"temperature": float("nan"), "do_sample": True}, "temperature must be a finite number"),
    ({"top_p": "1"}, "top_p must be a finite number"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"seed": "abc", "do_sample": True}, "seed must be an integer in 0..18446744073709551615"),
    ({"seed": 1.5, "do_sample": True}, "seed must be an integer"),
    ({"seed": 2**64, "do_sample": True}, "seed must be an integer in 0..18446744073709551615"),
    ({"seed": -1, "do_sample": True}, "seed must be an integer"),
    ({"eos_token_id": -5}, "eos_token_id must be an integer >= 0"),
    ({"eos_token_id": "x"}, "eos_token_id must be a token id or a list"),
    ({"eos_token_id": [2, 4000]}, "eos_token_id has token id(s) [4000] outside"),
    ({"salt": 123}, "salt must be a string"),
    ({"logits_processor": [42]}, "logits_processor entries must be callables"),
    ({"stop_strings": [""]}, "stop_strings must be non-empty strings"),
    ({"stop_strings": ["ok", 7]}, "stop_strings must be non-empty strings"),
    ({"fork_of": "0"}, "fork_of must be a request id"),
]


@pytest.mark.parametrize("kwargs, fragment", REFUSED, ids=[str(k) for k, _ in REFUSED])
def test_bad_arguments_are_refused_at_add_request(llama, kwargs, fragment):
    engine = Engine(llama, Words(), kv_budget=16, block_size=4)
    kwargs = {"prompt": [5, 9, 11], **kwargs}
    with pytest.raises(ValueError) as info:
        engine.add_request(kwargs.pop("prompt"), **kwargs)
    assert fragment in str(info.value)
    assert not engine.has_unfinished() and not engine._requests


def test_an_out_of_vocabulary_prompt_never_reaches_a_round(llama):
    """Issue 40 item 2: the engine accepted [5, 9, 500] and every later step raised."""
    engine = Engine(llama, kv_budget=32, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([5, 9, 500])
    prompt = random_prompts([7], seed=31)[0]
    rid = engine.add_request(prompt, max_new_tokens=6)
    assert [t for d in engine.stream(rid) for t in d.new_token_ids] == greedy_reference(llama, prompt, 6)


def test_an_underflowing_temperature_decodes_greedily(llama):
    """1e-40 would divide the scores into inf (NaN probabilities); below 1e-5 the request is greedy."""
    engine = Engine(llama, kv_budget=32, block_size=4)
    prompt = random_prompts([7], seed=32)[0]
    rid = engine.add_request(prompt, max_new_tokens=6, do_sample=True, temperature=1e-40, seed=2**64 - 1)
    assert not engine._requests[rid].settings.do_sample
    assert [t for d in engine.stream(rid) for t in d.new_token_ids] == greedy_reference(llama, prompt, 6)


def test_the_largest_seed_is_accepted(llama):
    engine = Engine(llama, kv_budget=32, block_size=4)
    rid = engine.add_request([5, 6, 7], max_new_tokens=3, do_sample=True, seed=2**64 - 1)
    assert [d.finish_reason for d in engine.stream(rid)][-1] is FinishReason.LENGTH


def test_unknown_request_ids_are_named(llama):
    engine = Engine(llama, kv_budget=16, block_size=4)
    for call in (engine.cancel, engine.stream, engine.get_output):
        with pytest.raises(KeyError, match="No request 7 in this engine"):
            call(7)
    with pytest.raises(KeyError, match="ints add_request returns"):
        engine.cancel("7")


def test_kv_budget_beyond_the_machines_memory_is_refused_by_name(llama):
    with pytest.raises(ValueError, match=r"kv_budget='999999TB'.*machine"):
        Engine(llama, kv_budget="999999TB")


def test_cancelling_the_streamed_request_inside_its_loop_gives_a_final_delta(llama):
    engine = Engine(llama, kv_budget=32, block_size=4)
    rid = engine.add_request([5, 6, 7, 8], max_new_tokens=20)
    deltas: list[RequestDelta] = []
    for delta in engine.stream(rid):
        deltas.append(delta)
        if len(deltas) == 2:
            engine.cancel(rid)
    assert deltas[-1].finished and deltas[-1].finish_reason is FinishReason.CANCELLED
    assert len(deltas) == 3
    engine.step()
    assert_pool_full(engine)


def test_two_threads_stepping_one_engine_take_turns(llama):
    """Issue 40 item 3: two threads in ``step()`` at once broke the engine (steps raised, a block leaked).
    With the engine's lock they take turns; outputs are exact and every block comes back."""
    prompts = random_prompts([9, 5, 12, 7, 10, 6], seed=33)
    engine = Engine(llama, kv_budget=48, block_size=4, max_tokens_per_round=8, max_running=4)
    ids = [engine.add_request(p, max_new_tokens=12) for p in prompts]
    errors, inside, overlaps = [], [0], []
    original = engine.runner.forward_with_features

    def watched(*args, **kwargs):  # counts forwards that overlap (what the lock must prevent)
        inside[0] += 1
        overlaps.append(inside[0] > 1)
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] -= 1
    engine.runner.forward_with_features = watched

    def drive():
        try:
            while engine.has_unfinished():
                engine.step()
        except Exception as err:  # pragma: no cover - what the test is for
            errors.append(err)
    threads = [threading.Thread(target=drive) for _ in range(2)]
    for thread in threads:
        thread.start()
    late = engine.add_request(prompts[0], max_new_tokens=4)  # add_request beside the stepping threads
    for thread in threads:
        thread.join()
    while engine.has_unfinished():
        engine.step()
    assert not errors and not any(overlaps)
    for request_id, prompt in zip(ids, prompts):
        assert engine.get_output(request_id).output_ids == greedy_reference(llama, prompt, 12)
    assert engine.get_output(late).output_ids == greedy_reference(llama, prompts[0], 4)
    assert_pool_full(engine)


def test_a_corrupt_plan_file_costs_the_engine_one_warning(llama, tmp_path, monkeypatch):
    """Issue 40 item 5: ``{"plans": "x"}`` in the cache directory crashed ``Engine`` rounds (AttributeError)."""
    from hf_kvspec.kernels import trials

    monkeypatch.setenv("HF_KVSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(trials, "_WARNED", set())
    (tmp_path / "decode_kernel_plans.json").write_text('{"plans": "x"}')
    engine = Engine(llama, kv_budget=32, block_size=4, fast_forward=False)  # the kernels run the model's forward
    prompt = random_prompts([6], seed=34)[0]
    with pytest.warns(RuntimeWarning, match="decode_kernel_plans.json"):
        output = engine.generate_batch([prompt], progress_bar=False, max_new_tokens=4)[0]
    assert output.output_ids == greedy_reference(llama, prompt, 4)
