"""A round is all or nothing: an exception inside it (the model's forward, a logits processor) gives back the
round's blocks and advances no request; the engine runs it again request by request, so a passing failure costs
nobody anything (same outputs). Culprits that fail alone: ``test_isolation.py``. Refusals happen at
``add_request``, before anything is queued."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec import RequestTooLongError
from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end


class Boom(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def _reference_forward(_fast_forward_tiny_models, monkeypatch):
    """Failures are injected with hooks on the model's modules, which only the model's own forward runs."""
    from hf_kvspec.forward import runner

    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 1 << 62)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def raise_once_at(call: int):
    """A forward pre-hook / processor that raises on its ``call``-th use and is transparent otherwise."""
    calls = {"n": 0}

    def hook(*args):
        calls["n"] += 1
        if calls["n"] == call:
            raise Boom(f"injected failure at call {call}")
        return args[1] if len(args) == 2 and isinstance(args[1], torch.Tensor) else None
    return hook


def state(engine, ids):
    """What a failed round must not change: each request's progress and output."""
    requests = [engine._requests[i] for i in ids]
    return [(r.num_computed if r in engine.scheduler.running else 0, list(r.output_ids)) for r in requests]


@pytest.mark.parametrize("where", ["forward", "processor"])
def test_a_passing_failure_changes_no_output(llama, where):
    prompts = random_prompts([9, 14, 5], seed=11)
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=8, max_running=3)
    injected = raise_once_at(6 if where == "processor" else 7)
    calls = []
    counted = lambda *args: (calls.append(1), injected(*args))[1]  # noqa: E731
    ids = [engine.add_request(p, max_new_tokens=10, logits_processor=[counted] if where == "processor" and i == 1
                              else None) for i, p in enumerate(prompts)]
    handle = llama.model.layers[1].register_forward_pre_hook(counted) if where == "forward" else None
    try:
        deltas = []
        while engine.has_unfinished():
            deltas += engine.step()  # never raises: the round is re-run request by request
    finally:
        if handle is not None:
            handle.remove()
    assert len(calls) > 7 and not any(d.finish_reason is FinishReason.ERROR for d in deltas)
    for request_id, prompt in zip(ids, prompts):
        assert engine.get_output(request_id).output_ids == greedy_reference(llama, prompt, 10)
    assert_pool_full(engine)


def test_a_round_undone_by_a_failure_changes_nothing(llama):
    """``_run_round`` raising leaves every request's progress, output and K/V length as before the round."""
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=8, max_running=3)
    ids = [engine.add_request(p, max_new_tokens=10) for p in random_prompts([9, 14, 5], seed=11)]
    engine.step()
    before = state(engine, ids)
    handle = llama.model.layers[1].register_forward_pre_hook(raise_once_at(1))
    try:
        with pytest.raises(Boom):
            engine._run_round()
    finally:
        handle.remove()
    assert state(engine, ids) == before
    assert all(engine.cache.length(r.request_id) == r.num_computed for r in engine.scheduler.running)


def test_a_model_that_always_fails_fails_every_request_and_frees_every_block(llama):
    engine = Engine(llama, kv_budget=32, block_size=4, max_tokens_per_round=8, max_running=2)
    ids = [engine.add_request(p, max_new_tokens=8) for p in random_prompts([11, 6, 7], seed=12)]
    engine.step()
    handle = llama.model.layers[0].register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(Boom("broken")))
    try:
        run_to_end(engine)
    finally:
        handle.remove()
    outputs = [engine.get_output(request_id) for request_id in ids]
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] * 3
    assert all("Boom: broken" in o.error for o in outputs)
    assert_pool_full(engine)


def test_seeded_sampling_survives_a_failed_round(llama):
    """The failed round's draws are undone (generator state restored): same samples as an undisturbed run."""
    prompt = random_prompts([7], seed=13)[0]
    outputs = []
    for inject in (False, True):
        engine = Engine(llama, kv_budget=32, block_size=4, max_tokens_per_round=8, max_running=2)
        processor = raise_once_at(4) if inject else (lambda ids, scores: scores)
        rid = engine.add_request(prompt, max_new_tokens=8, do_sample=True, seed=5, logits_processor=[processor])
        run_to_end(engine)
        outputs.append(engine.get_output(rid).output_ids)
    assert outputs[0] == outputs[1]


def test_a_prompt_longer_than_the_kv_budget_is_refused_at_add_request(llama):
    engine = Engine(llama, kv_budget=8, block_size=4, max_tokens_per_round=8, max_running=2)  # 32 slots
    with pytest.raises(RequestTooLongError, match="kv_budget"):
        engine.add_request(list(range(3, 40)), max_new_tokens=1)
    with pytest.raises(RequestTooLongError, match="max_new_tokens"):
        engine.add_request(list(range(3, 30)), max_new_tokens=7)  # 27 + 7 - 1 = 33 slots
    rid = engine.add_request(list(range(3, 30)), max_new_tokens=6)  # exactly 32: fits
    assert not engine._requests.keys() - {rid}
    run_to_end(engine)
    assert len(engine.get_output(rid).output_ids) >= 1
    assert_pool_full(engine)


def test_a_prompt_past_the_models_positions_is_refused(llama):
    engine = Engine(llama, kv_budget=512, block_size=4, max_tokens_per_round=8, max_running=2)
    with pytest.raises(RequestTooLongError, match="max_position_embeddings=512"):
        engine.add_request([5] * 500, max_new_tokens=13)
    assert not engine.has_unfinished()


def test_no_round_runs_more_tokens_than_the_budget(llama):
    """Counted at the model's own input, not only in the engine's records."""
    widths = []
    handle = llama.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        engine = Engine(llama, kv_budget=128, block_size=4, max_tokens_per_round=7, max_running=5)
        for p in random_prompts([30, 2, 19, 5, 41, 1], seed=14):
            engine.add_request(p, max_new_tokens=6)
        run_to_end(engine)
    finally:
        handle.remove()
    assert widths and max(widths) <= 7
    assert [r.num_tokens for r in engine.stats.rounds] == widths
    assert max(widths) == 7  # the budget is also used, not just respected


def test_bad_settings_are_refused(llama):
    with pytest.raises(ValueError, match="max_running"):
        Engine(llama, kv_budget=16, max_tokens_per_round=4, max_running=8)
    with pytest.raises(ValueError, match="kv_budget"):
        Engine(llama, kv_budget=2.5)
    engine = Engine(llama, kv_budget=16)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([4, 5], do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text needs a tokenizer")


def test_mla_models_are_refused_by_name():
    with pytest.raises(ValueError, match="MLA"):
        Engine(tiny_model("deepseek_v3"), kv_budget=16)
