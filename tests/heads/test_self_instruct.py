"""Diverse self-distilled data: the held-out check refuses leaks, generation is deterministic for a fixed seed, a run
stopped part way (``max_items``) and resumed equals an uninterrupted one, and chats become examples correctly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_kvspec.heads import self_instruct
from hf_kvspec.heads.data import HeldOut, HeldOutLeakError, message_example, read_prompts
from hf_kvspec.heads.distill import chat_ids
from hf_kvspec.heads.reading_tasks import documented_functions, prose_paragraphs, reading_tasks
from hf_kvspec.heads.self_instruct import RecipeSettings, build_distill_data, clean_request
from tests.heads.tiny_base import char_tokenizer
from tests.tiny_models import tiny_model

CONFIGS = Path(__file__).resolve().parents[2] / "scripts" / "train_configs"
HELD_OUT_FILE = CONFIGS / "chat_prompts_heldout.jsonl"
SETTINGS = RecipeSettings(seed=3, num_requests=6, num_reading=3, corpora=("python-stdlib",), follow_up_fraction=0.5,
                          request_max_new_tokens=12, answer_max_new_tokens=5, batch_size=2)


@pytest.fixture(scope="module")
def target():
    tokenizer = char_tokenizer()
    model = tiny_model("llama", seed=0, vocab_size=len(tokenizer)).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _build(target, path, settings=SETTINGS, max_items=None, held_out=None):
    model, tokenizer = target
    held_out = held_out or HeldOut.from_file(str(HELD_OUT_FILE))
    return build_distill_data(model, tokenizer, path, "fp", held_out, settings, max_items, progress=False)


def test_held_out_check_refuses_leaks():
    held_out = HeldOut.from_file(str(HELD_OUT_FILE))
    leaks = ["explain QUANTUM computing to a high-school student",      # a held-out prompt, case/punctuation changed
             "Any tips for surviving an earthquake?",                   # a held-out topic (singular form)
             "Explain volcanoes to a high-school student.",             # a held-out template, another topic
             "Please write code that converts a Roman numeral to an integer."]  # a held-out code task
    for text in leaks:
        assert held_out.leak(text), text
        with pytest.raises(HeldOutLeakError, match="leak held-out material"):
            held_out.check(["How do I bake bread?", text])
    clean = ["How do I bake bread?", "Explain volcanoes in simple terms.", "Write a Python function that reverses a "
             "string."]
    assert [held_out.leak(t) for t in clean] == [None] * 3
    held_out.check(clean)
    for name in ("chat_prompts_train.jsonl", "chat_prompts_train_large.jsonl"):  # the shipped sets stay disjoint
        held_out.check(read_prompts(str(CONFIGS / name)))


def test_pipeline_drops_leaking_candidates(target, tmp_path):
    # a held-out "topic" that every stdlib function mentions: all reading tasks must be dropped and counted
    held_out = HeldOut.from_prompts(["Explain def to a high-school student."])
    data = _build(target, tmp_path / "cache.jsonl", held_out=held_out)
    assert data.complete and data.recipe["reading"]["kept"] == 0
    assert data.recipe["reading"]["held_out_leaks"] == data.recipe["reading"]["candidates"] > 0
    users = [m["content"] for row in data.rows for m in row["messages"] if m["role"] == "user"]
    assert users and not any(held_out.leak(u) for u in users)


def test_generation_is_deterministic_for_a_fixed_seed(target, tmp_path):
    first = _build(target, tmp_path / "a.jsonl")
    second = _build(target, tmp_path / "b.jsonl")  # a fresh cache: everything generated again
    assert first.rows == second.rows and first.recipe == second.recipe
    sources = {row["source"] for row in first.rows}
    assert sources == {"self-instruct", "reading:python-stdlib", "self-instruct follow-up"}
    assert {row["answer"] for row in first.rows} == {"greedy", "sampled t=0.7"}
    follow_ups = [row for row in first.rows if row["source"] == "self-instruct follow-up"]
    assert follow_ups and all([m["role"] for m in r["messages"]] == ["user", "assistant"] * 2 for r in follow_ups)
    other = _build(target, tmp_path / "c.jsonl", replace(SETTINGS, seed=4))
    assert self_instruct.seed_specs(SETTINGS) != self_instruct.seed_specs(replace(SETTINGS, seed=4))
    assert other.rows != first.rows


def test_seed_tasks_steer_the_requests_and_the_default_draws_from_all():
    import random

    everything = replace(SETTINGS, num_requests=200)
    rng = random.Random(everything.seed)  # the default draw, written out independently
    expected = [(rng.choice(self_instruct.GENRES), rng.choice(sorted(self_instruct.TASKS))) for _ in range(200)]
    assert self_instruct.seed_specs(everything) == expected
    steered = self_instruct.seed_specs(replace(everything, tasks=("explanation", "definition")))
    assert {task for _, task in steered} == {"explanation", "definition"}
    with pytest.raises(ValueError, match="sonnet"):
        self_instruct.seed_specs(replace(everything, tasks=("sonnet",)))


def test_prompt_slices_of_one_seed_are_disjoint_and_cover_the_file(tmp_path):
    import random

    path = tmp_path / "prompts.jsonl"
    rows = [f"Tell me something about item number {i}." for i in range(23)]
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    settings = replace(SETTINGS, prompts=str(path), num_prompts=10)
    slices = [self_instruct.prompt_slice(replace(settings, prompts_start=start)) for start in (0, 10, 20)]
    assert [len(s) for s in slices] == [10, 10, 3]
    shuffled = list(rows)
    random.Random(settings.seed).shuffle(shuffled)  # the order, written out independently
    assert [row for part in slices for row in part] == shuffled
    assert self_instruct.prompt_slice(replace(settings, num_prompts=None, prompts_start=20)) == slices[2]
    assert self_instruct.prompt_slice(replace(settings, seed=4))[:10] != slices[0]
    assert self_instruct.prompt_slice(SETTINGS) == []


def test_prompts_file_rows_get_the_targets_greedy_answers(target, tmp_path):
    """Only a prompts file: each kept row is answered as ``generate`` answers it alone; a held-out leak and a
    duplicate are dropped and counted."""
    model, tokenizer = target
    path = tmp_path / "prompts.jsonl"
    rows = ["How do I bake bread?", "Explain volcanoes to a high-school student.", "How do I bake bread?",
            "Name three birds that migrate."]
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    settings = replace(SETTINGS, num_requests=0, num_reading=0, sampled_answers=False, prompts=str(path),
                       batch_size=1)
    data = _build(target, tmp_path / "cache.jsonl", settings)
    assert data.complete and {row["source"] for row in data.rows} == {"prompts:prompts.jsonl"}
    counts = data.recipe["prompts"]
    assert (counts["kept"], counts["held_out_leaks"], counts["duplicates"]) == (2, 1, 1)
    assert data.recipe["rows"] == {"prompts:prompts.jsonl / greedy": 2}
    for row in data.rows:
        user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        ids = torch.tensor([chat_ids(tokenizer, [{"role": "user", "content": user}])])
        out = model.generate(ids, max_new_tokens=settings.answer_max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        eos = tokenizer.eos_token_id
        out = out[:out.index(eos) + 1] if eos in out else out
        assert answer == tokenizer.decode(out, skip_special_tokens=True).strip()
    assert {row["messages"][0]["content"] for row in data.rows} == {rows[0], rows[3]}


def test_resume_after_interruption_equals_an_uninterrupted_run(target, tmp_path):
    whole = _build(target, tmp_path / "whole.jsonl")
    cache, runs = tmp_path / "parts.jsonl", 0
    while True:
        runs += 1
        part = _build(target, cache, max_items=3)  # stops at the first batch boundary after 3 new items
        if part.complete:
            break
        assert not part.rows
    assert runs > 3 and part.rows == whole.rows
    assert sorted(cache.read_text().splitlines()) == sorted((tmp_path / "whole.jsonl").read_text().splitlines())
    model, _tokenizer = target
    calls = []
    original = model.generate
    model.generate = lambda *a, **k: calls.append(1)  # a complete cache must not generate again
    try:
        assert _build(target, cache).rows == whole.rows and not calls
    finally:
        model.generate = original


def test_message_example_trains_on_the_last_answer_only():
    tokenizer = char_tokenizer()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok!"}]
    example = message_example(tokenizer, chat, max_length=512)
    prompt = chat_ids(tokenizer, chat[:-1])
    assert example["prompt_length"] == len(prompt)
    assert example["input_ids"] == prompt + tokenizer("ok!")["input_ids"] + [tokenizer.eos_token_id]
    assert message_example(tokenizer, chat, max_length=5)["input_ids"] == example["input_ids"][:5]
    with pytest.raises(ValueError, match="end with an assistant turn"):
        message_example(tokenizer, chat[:-1], max_length=512)


def test_clean_request_and_passages():
    assert clean_request('User: "How do I repot a cactus safely?"\n\nSure!') == "How do I repot a cactus safely?"
    assert clean_request("Hiking!") is None
    assert clean_request("Answer: That one question I was supposed to have was all well and good.") is None
    text = "Title\n=====\n\n.. note:: skip\n\n" + "The :func:`open` function reads files. " * 8 + "\n\n  indented"
    assert prose_paragraphs(text) == [("The open function reads files. " * 8).strip()]
    source = 'def f(x):\n    """Doc."""\n    y = x\n    return y\n\n\ndef g():\n    return 1\n'
    assert documented_functions(source) == ['def f(x):\n    """Doc."""\n    y = x\n    return y']
    first = reading_tasks(4, seed=1, corpora=("python-stdlib",))
    assert first == reading_tasks(4, seed=1, corpora=("python-stdlib",)) and len(first) == 8
    assert all("```python\ndef " in task.prompt for task in first)


def test_written_recipe_renders_in_the_model_card(target, tmp_path):
    from hf_kvspec import hub
    from hf_kvspec.heads.configuration import MedusaConfig

    data = _build(target, tmp_path / "cache.jsonl")
    path = self_instruct.write_data(data, tmp_path / "chats.jsonl")
    recipe = json.loads(self_instruct.recipe_path(path).read_text())
    summary = {"args": {}, "data": [{"source": str(path), "kind": "chat", "sequences": len(data.rows), "tokens": 1,
                                     "recipe": recipe}]}
    config = MedusaConfig.for_base_model(target[0], "tiny")
    card = hub.render_model_card(config, hub.CardFields.from_summary(summary))
    assert "Data recipe of the self-distilled chats" in card
    assert f"{recipe['self_instruct']['candidates']} candidates" in card
    assert "| self-instruct follow-up / greedy |" in card


def test_a_prompts_file_recipe_renders_without_claiming_other_sources(target, tmp_path):
    from hf_kvspec import hub
    from hf_kvspec.heads.configuration import MedusaConfig

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Name {n} birds that migrate."}) + "\n" for n in range(5)))
    settings = replace(SETTINGS, num_requests=0, num_reading=0, follow_up_fraction=0, sampled_answers=False,
                       prompts=str(path), prompts_start=1, num_prompts=3)
    data = _build(target, tmp_path / "cache.jsonl", settings)
    summary = {"args": {}, "data": [{"source": "x", "kind": "chat", "sequences": 3, "tokens": 1,
                                     "recipe": data.recipe}]}
    card = hub.render_model_card(MedusaConfig.for_base_model(target[0], "tiny"), hub.CardFields.from_summary(summary))
    assert "3 rows of the prompts file `prompts.jsonl` (the rows\n[1, 4) of its order" in card
    assert "self-instruct" not in card and "reading tasks" not in card and "follow-up" not in card
    assert "answers greedy, at most 5 tokens; seed 3." in card


def test_train_drafter_reads_chats_and_refuses_leaks(target, tmp_path):
    import sys

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    import train_drafter

    from tests.heads.tiny_base import save_tiny_base

    save_tiny_base(tmp_path / "base")
    chats = self_instruct.write_data(_build(target, tmp_path / "cache.jsonl"), tmp_path / "chats.jsonl")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "say one"}) + "\n")
    args = ["--head", "medusa", "--num_heads", "1", "--base_model", str(tmp_path / "base"), "--max_steps", "1",
            "--per_device_batch_size", "2", "--num_threads", "1", "--data_cache_dir", str(tmp_path / "data"),
            "--distill_max_new_tokens", "2", "--eval_prompts", str(tmp_path / "eval.jsonl")]
    train_drafter.main([*args, "--dataset", str(chats), "--output_dir", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert summary["data"][0]["sequences"] == len(chats.read_text().splitlines())
    assert summary["data"][0]["recipe"]["rows"] == json.loads(self_instruct.recipe_path(chats).read_text())["rows"]
    assert "Data recipe of the self-distilled chats" in (tmp_path / "out" / "README.md").read_text()
    leaky = tmp_path / "leaky.jsonl"
    leak = {"messages": [{"role": "user", "content": "Say one!"}, {"role": "assistant", "content": "one"}]}
    rows = [*chats.read_text().splitlines(), json.dumps(leak)]
    leaky.write_text("\n".join(rows) + "\n")
    with pytest.raises(HeldOutLeakError, match=r"1 of .* user turns of --dataset .*leaky\.jsonl"):
        train_drafter.main([*args, "--dataset", str(leaky), "--output_dir", str(tmp_path / "out2")])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "say one"}) + "\n")
    with pytest.raises(HeldOutLeakError, match="prompts of --dataset"):
        train_drafter.main([*args, "--dataset", str(prompts), "--check_held_out", "true", "--self_distill", "true",
                            "--output_dir", str(tmp_path / "out3")])
