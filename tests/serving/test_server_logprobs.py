"""Log-probabilities through the real ``openai`` client: chat ``logprobs`` / ``top_logprobs`` and completions
``logprobs``, whole and streamed, greedy and sampled, ``n = 2``, from a server whose engine speculates (n-gram
drafts verified every round): each value equals the log-softmax of a plain forward of the model over the same
tokens; bad values are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvspec.serving.engine import Engine
from tests.tiny_models import tiny_model

from .server_harness import RunningServer, no_leaks, tiny_tokenizer

PROMPT = "t7 t19 t33 t7 t19 t33 t7 t19 t33"  # repeats: the n-gram drafter proposes


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = Engine(model, tokenizer, kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=8,
                    assistant="ngram", draft_lengths="fixed")
    with RunningServer(engine) as running:
        yield running


def reference(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[n, V]``: log-softmax at each output position of one plain forward, logits divided by ``temperature``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def check_chat_entries(entries, ids: list[int], expected: torch.Tensor, tokenizer, top: int) -> None:
    assert [e.token for e in entries] == [tokenizer.decode([i]) for i in ids]
    for position, (entry, token) in enumerate(zip(entries, ids)):
        assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(
            expected[position].topk(top).values.tolist(), abs=1e-5)


def test_chat_logprobs_are_the_targets_whole_and_streamed(server, model, tokenizer):
    client = server.client()
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with no_leaks(server):
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                               logprobs=True, top_logprobs=3)
    ids = whole.kvspec["choices"][0]["token_ids"]
    check_chat_entries(whole.choices[0].logprobs.content, ids, reference(model, prompt, ids), tokenizer, 3)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    assert sum(r.num_draft_tokens for r in server.state.engine.stats.rounds) > 0  # verify rows were exercised


def test_completion_logprobs_sampled_n2_match_the_forward_after_temperature(server, model, tokenizer):
    client = server.client()
    prompt = tokenizer(PROMPT)["input_ids"]
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.7, seed=3, n=2,
                                         logprobs=2)
    for choice, extension in zip(response.choices, response.kvspec["choices"]):
        ids = extension["token_ids"]
        expected = reference(model, prompt, ids, temperature=0.7)
        logprobs = choice.logprobs
        assert logprobs.tokens == [tokenizer.decode([i]) for i in ids]
        assert logprobs.token_logprobs == pytest.approx([float(expected[p, t]) for p, t in enumerate(ids)], abs=1e-5)
        for position, (token, top) in enumerate(zip(logprobs.tokens, logprobs.top_logprobs)):
            assert 2 <= len(top) <= 3 and token in top  # the alternatives, and the chosen token
            assert sorted(top.values(), reverse=True)[:2] == pytest.approx(expected[position].topk(2).values.tolist(),
                                                                          abs=1e-5)
        offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
        assert logprobs.text_offset == offsets
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.7, seed=3,
                                              logprobs=0, stream=True))
    values = [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(response.choices[0].logprobs.token_logprobs, abs=1e-6)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_refused_by_name(server, path, body, param):
    assert_refused(server, path, body, param)


def test_echo_scores_the_prompt_with_a_plain_forward(server, model, tokenizer):
    """``echo`` (lm-evaluation-harness's log-likelihood requests): the prompt's text and each prompt token's
    log-probability given the ones before it; ``max_tokens: 0`` scores without generating."""
    client = server.client()
    prompt = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [L, V]
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [tokenizer.decode([i]) for i in prompt]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [float(expected[p, t]) for p, t in enumerate(prompt[1:])], abs=1e-5)
    both = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=0)
    ids = both.kvspec["choices"][0]["token_ids"]
    assert both.choices[0].text.startswith(PROMPT) and len(both.choices[0].logprobs.tokens) == len(prompt) + len(ids)
    generated = reference(model, prompt, ids)
    assert both.choices[0].logprobs.token_logprobs[len(prompt):] == pytest.approx(
        [float(generated[p, t]) for p, t in enumerate(ids)], abs=1e-5)
    for max_tokens in (0, 5):
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                                echo=True, logprobs=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == (both if max_tokens else scored).choices[0].text
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert tokens == (both if max_tokens else scored).choices[0].logprobs.tokens


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
])
def test_echo_is_for_completions_and_max_tokens_0_needs_it(server, path, body, param):
    assert_refused(server, path, body, param)


def assert_refused(server, path: str, fields: dict, param: str) -> None:
    """A small request to ``path`` with ``fields`` added is a 400 naming ``param``."""
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "t1"}]} if "chat" in path else {"prompt": "t1"})
    status, _, raw = server.raw("POST", path, json.dumps({**base, **fields}))
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
