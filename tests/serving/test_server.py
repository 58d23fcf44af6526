"""``hf-kvspec serve`` through the real ``openai`` client against a server on 127.0.0.1: completions and chat,
whole and streamed, ``n = 2``, stop strings, seeded sampling, and greedy output equal to ``generate()``."""

from __future__ import annotations

import pytest

from hf_kvspec.serving.engine import Engine
from tests.tiny_models import tiny_model

from .server_harness import RunningServer, greedy_ids, no_leaks, tiny_tokenizer

PROMPT = "t7 t19 t33 t41 t8 t60 t12 t77 t20"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = Engine(model, tokenizer, kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=8)
    with RunningServer(engine) as running:
        yield running


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client().models.list().data] == ["tiny"]
    status, _, body = server.raw("GET", "/health")
    assert (status, body) == (200, b'{"status":"ok"}')
    samples = server.metrics()
    for name in ("kvspec_requests_running", "kvspec_requests_waiting", "kvspec_kv_block_utilization",
                 "kvspec_tokens_per_second", 'kvspec_time_to_first_token_seconds_bucket{le="+Inf"}'):
        assert name in samples
    assert samples["kvspec_kv_blocks_total"] == 64


def test_greedy_completion_equals_generate(server, model, tokenizer):
    with no_leaks(server):
        response = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    reference = greedy_ids(model, ids_of(tokenizer, PROMPT), 12)
    choice = response.choices[0]
    assert response.kvspec["choices"][0]["token_ids"] == reference
    assert choice.text == tokenizer.decode(reference, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if reference[-1] == 2 else "length")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (9, len(reference))
    assert response.model == "tiny" and response.object == "text_completion"


def test_greedy_chat_equals_generate_on_the_chat_template(server, model, tokenizer):
    messages = [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t44 t45 t46"}]
    response = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                        temperature=0)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    reference = greedy_ids(model, prompt, 10)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == tokenizer.decode(reference, skip_special_tokens=True)
    assert response.kvspec["choices"][0]["token_ids"] == reference
    assert response.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_carries_the_same_text_as_the_whole_response(server, kind):
    client = server.client()
    if kind == "chat":
        create = client.chat.completions.create
        request = {"messages": [{"role": "user", "content": PROMPT}]}
    else:
        create = client.completions.create
        request = {"prompt": PROMPT}
    whole = create(model="tiny", max_tokens=14, temperature=0, **request)
    chunks = list(create(model="tiny", max_tokens=14, temperature=0, stream=True,
                         stream_options={"include_usage": True}, **request))
    pieces = [c.choices[0].delta.content if kind == "chat" else c.choices[0].text for c in chunks if c.choices]
    text = whole.choices[0].message.content if kind == "chat" else whole.choices[0].text
    assert "".join(p or "" for p in pieces) == text
    assert len([p for p in pieces if p]) > 1  # streamed in pieces, not at the end
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"


def test_n_2_forks_the_prompt_and_each_choice_is_exact(server, model, tokenizer):
    client = server.client()
    fresh = "t50 t51 t52 t53 t54 t55 t56 t57 t58"  # nobody computed it before: no prefix-cache hits
    with no_leaks(server):
        greedy = client.completions.create(model="tiny", prompt=fresh, max_tokens=8, temperature=0, n=2)
    reference = greedy_ids(model, ids_of(tokenizer, fresh), 8)
    assert [c["token_ids"] for c in greedy.kvspec["choices"]] == [reference, reference]
    assert [c["cached_prompt_tokens"] for c in greedy.kvspec["choices"]] == [0, 8]  # choice 1 forked choice 0
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert greedy.usage.completion_tokens == 2 * len(reference) and greedy.usage.prompt_tokens == 9
    # sampled: choice i is the request with seed + i on its own
    pair = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2)
    alone = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed)
             for seed in (5, 6)]
    assert [c["token_ids"] for c in pair.kvspec["choices"]] == [a.kvspec["choices"][0]["token_ids"] for a in alone]
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=2,
                                              stream=True))
    for index in (0, 1):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == index)
        assert text == greedy.choices[index].text


def test_seeded_sampling_is_reproducible_and_matches_the_engine(server, model, tokenizer):
    client = server.client()
    runs = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9,
                                      seed=1234).kvspec["choices"][0]["token_ids"] for _ in range(2)]
    engine = Engine(model, tokenizer, kv_budget=64, block_size=4)
    rid = engine.add_request(ids_of(tokenizer, PROMPT), max_new_tokens=16, do_sample=True, temperature=0.8,
                             top_p=0.9, seed=1234)
    while engine.has_unfinished():
        engine.step()
    assert runs[0] == runs[1] == engine.get_output(rid).output_ids


def test_stop_strings_cut_the_text_before_them(server, model, tokenizer):
    reference = greedy_ids(model, ids_of(tokenizer, PROMPT), 12)
    words = tokenizer.decode(reference, skip_special_tokens=True).split()
    assert len(words) >= 4, "the tiny model ended too early for this test"
    stop = words[3]
    first = words.index(stop)  # the first occurrence ends the output
    for stream in (False, True):
        response = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                       stop=[stop, "never-seen"], stream=stream)
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = response.choices[0].text, response.choices[0].finish_reason
            assert response.kvspec["choices"][0]["token_ids"] == reference[: first + 1]
        assert text == " ".join(words[:first]) + " "
        assert reason == "stop"


def test_a_batch_of_prompts_indexes_choices_by_prompt_then_choice(server, model, tokenizer):
    """OpenAI's completions batch: choice ``p * n + i`` is prompt p's choice i; each equals the prompt alone;
    ``usage`` counts each prompt once; streamed, every choice's text equals the whole response's."""
    client = server.client()
    prompts = ["t7 t19 t33", "t50 t51", [9, 10, 11, 12]]
    with no_leaks(server):
        batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for index in range(6):
        prompt = prompts[index // 2]
        ids = prompt if isinstance(prompt, list) else ids_of(tokenizer, prompt)
        assert batch.kvspec["choices"][index]["token_ids"] == greedy_ids(model, ids, 6), index
    lengths = [len(p) if isinstance(p, list) else len(ids_of(tokenizer, p)) for p in prompts]
    assert batch.usage.prompt_tokens == sum(lengths)
    assert batch.usage.completion_tokens == sum(len(c["token_ids"]) for c in batch.kvspec["choices"])
    chunks = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    for index in range(6):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == \
            batch.choices[index].text
    assert chunks[-1].usage.prompt_tokens == sum(lengths)
    echoed = client.completions.create(model="tiny", prompt=prompts[:2], max_tokens=0, echo=True)
    assert [c.text for c in echoed.choices] == prompts[:2] and echoed.usage.completion_tokens == 0


def test_ignore_eos_and_continuous_usage_stats_as_guidellm_sends_them(server, model, tokenizer):
    """vLLM's two extensions that GuideLLM sends on every request: ``ignore_eos`` generates exactly
    ``max_tokens`` (a plain argmax loop is the reference: no end-of-sequence stop), and
    ``stream_options.continuous_usage_stats`` puts the usage so far in every chunk."""
    import torch

    ids = ids_of(tokenizer, PROMPT)
    with torch.no_grad():
        sequence = list(ids)
        for _ in range(20):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    reply = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert reply.kvspec["choices"][0]["token_ids"] == sequence[len(ids):] and reply.usage.completion_tokens == 20
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and all(c.usage is not None for c in chunks)
    assert counts[-1] == chunks[-1].usage.completion_tokens and chunks[-1].choices == []
