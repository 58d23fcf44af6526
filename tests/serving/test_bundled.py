"""The engine on the bundled SmolLM2-135M: chat requests with a shared system prompt, chunked prefill and joins
give exactly each prompt's own greedy ``generate``; ``hf-kvspec batch`` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvspec import Engine
from hf_kvspec.cli import main

SYSTEM = ("You are a careful assistant for a company that builds caches for language models. Answer briefly, "
          "with concrete numbers where you can, and say when you do not know.")
QUESTIONS = ["What is a KV cache?", "Name three prime numbers.", "Why is the sky blue?",
             "Write one sentence about paging."]


@pytest.mark.slow
def test_chat_requests_equal_their_own_generate(bundled):
    model, tokenizer = bundled
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    chats.append([{"role": "user", "content": QUESTIONS[0]}])
    engine = Engine(model, tokenizer, kv_budget="64MB", max_tokens_per_round=48, max_running=4)
    first = engine.add_request(chats[0], max_new_tokens=24)
    engine.step()
    ids = [first] + [engine.add_request(chat, max_new_tokens=24) for chat in chats[1:]]
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.get_output(i) for i in ids]
    for chat, out in zip(chats, outputs):
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert out.prompt_ids == list(rendered)
        prompt = torch.tensor([out.prompt_ids])
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=24)[0, prompt.shape[1]:].tolist()
        assert out.output_ids == expected, tokenizer.decode(out.prompt_ids)
    assert all(o.metrics.cached_prompt_tokens >= 16 for o in outputs[2:4])  # the system prompt's blocks
    assert engine.stats.num_rounds > 0 and max(r.num_tokens for r in engine.stats.rounds) <= 48
    assert engine.cache.num_free_blocks() == engine.cache.num_total_blocks()


@pytest.mark.slow
def test_cli_batch_end_to_end(bundled, tmp_path, capsys):
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": QUESTIONS[1]}, {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_new_tokens": 5},
        {"prompt": QUESTIONS[3], "temperature": 0.8, "seed": 3, "id": "sampled"}]))
    out = tmp_path / "results.jsonl"
    assert main(["batch", str(source), "--out", str(out), "--max-new-tokens", "12", "--threads", "1",
                 "--no-progress"]) == 0
    results = {json.loads(line)["id"]: json.loads(line) for line in out.read_text().splitlines()}
    assert set(results) == {1, 2, "sampled"}  # written in the order they finish
    assert len(results[2]["output_ids"]) <= 5 and all(r["output"] for r in results.values())
    assert "3 requests" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("assistant", ["eagle", "ngram", "auto"])
def test_speculating_engine_equals_generate_on_the_bundled_model(bundled, assistant):
    """The bundled EAGLE head (trees, features captured on the packed forward), n-gram (chains) and ``"auto"``
    (the suffix pool mixed with the EAGLE head, which fits this model) inside the engine: every chat request's
    output is its own greedy ``generate``, drafts are accepted."""
    model, tokenizer = bundled
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    # fixed draft lengths: every decoding request drafts, so every verify-row path is exercised (under the default
    # goodput choice the budget rightly keeps some requests at K = 0 on this short run: no tau for them)
    engine = Engine(model, tokenizer, kv_budget="64MB", max_tokens_per_round=64, max_running=4, assistant=assistant,
                    draft_lengths="fixed")
    if assistant == "auto":
        assert type(engine.drafts.drafters).__name__ == "MixedDrafters"
    first = engine.add_request(chats[0], max_new_tokens=32)
    engine.step()
    ids = [first] + [engine.add_request(chat, max_new_tokens=32) for chat in chats[1:]]
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.get_output(i) for i in ids]
    for out in outputs:
        prompt = torch.tensor([out.prompt_ids])
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=32)[0, prompt.shape[1]:].tolist()
        assert out.output_ids == expected, tokenizer.decode(out.prompt_ids)
    assert engine.stats.num_accepted_tokens > 0 and all(out.metrics.tau is not None for out in outputs)
    assert max(r.num_tokens for r in engine.stats.rounds) <= 64
    assert engine.cache.num_free_blocks() == engine.cache.num_total_blocks()


@pytest.mark.slow
def test_cli_batch_with_an_assistant(bundled, tmp_path, capsys):
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": q}) for q in QUESTIONS[:2]))
    out = tmp_path / "results.jsonl"
    assert main(["batch", str(source), "--out", str(out), "--max-new-tokens", "12", "--threads", "1",
                 "--no-progress", "--assistant", "eagle", "--num-draft-tokens", "6"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["tau"] is not None and r["output"] for r in results)
    assert "speculation (eagle)" in capsys.readouterr().out
