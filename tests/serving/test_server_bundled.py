"""``hf-kvspec serve`` on the bundled SmolLM2-135M with its own tokenizer and chat template: through the openai
client, greedy chat output (whole and streamed, two at once) equals ``generate()`` on the prompt alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_kvspec import Engine

from .server_harness import RunningServer

QUESTIONS = ["What is a KV cache?", "Name three prime numbers."]


@pytest.mark.slow
def test_bundled_chat_through_the_openai_client_equals_generate(bundled):
    model, tokenizer = bundled
    engine = Engine(model, tokenizer, kv_budget="32MB", max_tokens_per_round=64, max_running=4)
    with RunningServer(engine) as server:
        client = server.client()

        def ask(question: str, stream: bool):
            messages = [{"role": "user", "content": question}]
            response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                                      temperature=0, stream=stream)
            if not stream:
                return response.choices[0].message.content, response.kvspec["choices"][0]["token_ids"]
            chunks = list(response)
            return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].kvspec["token_ids"]

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, QUESTIONS, [False, True]))
    for question, (text, token_ids) in zip(QUESTIONS, answers):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)["input_ids"]
        prompt = torch.tensor([list(ids)])
        with torch.no_grad():
            expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=24)[0, prompt.shape[1]:].tolist()
        assert token_ids == expected
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
