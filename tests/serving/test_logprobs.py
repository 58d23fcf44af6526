"""Log-probabilities from the engine: every output token's value and its alternatives equal the log-softmax of a
plain forward of the model over the same tokens (the independent reference: ``model(ids).logits``, processed by
transformers' own warpers), greedy and sampled, without an assistant and with each drafter, so that under
speculation the values are the target's, never the drafter's; the deltas carry the same values as the output."""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.logprobs import token_logprobs
from tests.tiny_models import tiny_model

from .helpers import random_prompts, run_to_end
from .test_speculation import VOCAB, make_assistant

TOP = 4
SAMPLED = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 8}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def reference_logprobs(model, prompt: list[int], output: list[int], sampled: bool) -> torch.Tensor:
    """``[n, V]``: the log-softmax at each output position of one plain forward over prompt + output, after the
    request's warpers (none for greedy)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1].float()  # [n, V]
    if sampled:
        warpers = [TemperatureLogitsWarper(SAMPLED["temperature"]), TopKLogitsWarper(SAMPLED["top_k"]),
                   TopPLogitsWarper(SAMPLED["top_p"])]
        for warper in warpers:
            logits = warper(None, logits)
    return torch.log_softmax(logits, dim=-1)


def assert_matches(logprobs, reference: torch.Tensor, output: list[int]) -> None:
    assert [entry.token_id for entry in logprobs] == output
    for position, entry in enumerate(logprobs):
        row = reference[position]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-5)
        assert len(entry.top) == TOP
        values = [value for _, value in entry.top]
        finite = row[torch.isfinite(row)].sort(descending=True).values[:TOP]
        expected = finite.tolist() + [float("-inf")] * (TOP - len(finite))
        assert values == pytest.approx(expected, abs=1e-5)
        for token, value in entry.top:  # ties aside, each alternative is that token's own value
            assert value == pytest.approx(float(row[token]), abs=1e-5)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", [None, "ngram", "draft_model", "oracle_tree", "eagle", "medusa", "self_int8",
                                  "suffix", "suffix+eagle"])
def test_logprobs_are_the_targets_at_every_output_token(llama, kind, sampled):
    prompts = random_prompts([7, 15, 4, 11], seed=3, vocab=VOCAB)
    engine = Engine(llama, draft_lengths="fixed", kv_budget=128, block_size=4, max_tokens_per_round=40,
                    max_running=3, assistant=None if kind is None else make_assistant(kind, llama))
    settings = SAMPLED if sampled else {}
    ids = [engine.add_request(p, max_new_tokens=14, logprobs=TOP, seed=i, **settings) for i, p in enumerate(prompts)]
    streamed = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            assert len(delta.logprobs) == len(delta.new_token_ids)
            streamed[delta.request_id] += delta.logprobs
    drafted = sum(r.num_draft_tokens for r in engine.stats.rounds)
    assert kind is None or drafted > 0, "no drafts were verified: the speculative path was not tested"
    for request_id, prompt in zip(ids, prompts):
        output = engine.get_output(request_id)
        assert output.logprobs == streamed[request_id]
        assert_matches(output.logprobs, reference_logprobs(llama, prompt, output.output_ids, sampled),
                       output.output_ids)


def test_without_logprobs_nothing_is_kept_and_bad_values_are_refused(llama):
    engine = Engine(llama, kv_budget=64, block_size=4)
    request_id = engine.add_request([1, 2, 3], max_new_tokens=3)
    run_to_end(engine)
    assert engine.get_output(request_id).logprobs is None
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match=r"logprobs must be an integer in 0\.\.20"):
            engine.add_request([1, 2, 3], logprobs=bad)


def test_zero_alternatives_and_the_helper_on_a_known_row():
    scores = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, 0.0, 0.0]])  # [2, 3]
    entries = token_logprobs(scores, [1, 2], top=0)
    assert [e.top for e in entries] == [(), ()]
    assert entries[0].logprob == pytest.approx(-torch.log1p(torch.exp(torch.tensor(-1.0))).item())
    assert entries[1].logprob == pytest.approx(-torch.log(torch.exp(torch.tensor(2.0)) + 2).item())
    assert token_logprobs(scores, [0, 0], top=2)[1].top[0][0] == 0
