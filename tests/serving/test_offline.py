"""Stop strings, streaming, text prompts and the JSON Lines batch runner, with a toy character tokenizer on a
tiny model (the bundled-model run of ``hf-kvspec batch`` is in ``test_bundled.py``)."""

from __future__ import annotations

import json

import pytest

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.offline import read_requests, run_requests, write_results
from hf_kvspec.serving.request import FinishReason
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end


class CharTokenizer:
    """One character per token: ids 3..28 are 'a'..'z'; every other id decodes to '#'."""

    def __call__(self, text):
        return {"input_ids": [3 + (ord(c) - ord("a")) % 26 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i - 3) if 3 <= i < 29 else "#" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self("".join(m["content"] for m in messages) + "zz")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_stop_string_ends_the_request_at_the_token_that_completes_it(llama):
    prompt = random_prompts([8], seed=50, vocab=29)[0]
    full = greedy_reference(llama, prompt, 16)
    tok = CharTokenizer()
    stop = tok.decode(full[5:7])
    cut = next(k for k in range(1, len(full) + 1) if stop in tok.decode(full[:k]))
    engine = Engine(llama, tok, kv_budget=32, block_size=4)
    rid = engine.add_request(prompt, max_new_tokens=16, stop_strings=stop)
    run_to_end(engine)
    out = engine.get_output(rid)
    assert out.output_ids == full[:cut] and out.finish_reason is FinishReason.STOP
    assert_pool_full(engine)


def test_stream_yields_each_token_once_while_others_advance(llama):
    prompts = random_prompts([5, 9], seed=51)
    engine = Engine(llama, kv_budget=32, block_size=4)
    first, second = (engine.add_request(p, max_new_tokens=7) for p in prompts)
    deltas = list(engine.stream(first))
    assert [t for d in deltas for t in d.new_token_ids] == greedy_reference(llama, prompts[0], 7)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    streamed = [t for d in engine.stream(second) for t in d.new_token_ids]
    assert streamed == greedy_reference(llama, prompts[1], 7)  # tokens made while streaming `first` included


def test_text_and_chat_prompts_go_through_the_tokenizer(llama):
    tok = CharTokenizer()
    engine = Engine(llama, tok, kv_budget=32, block_size=4)
    text = engine.add_request("hello", max_new_tokens=3)
    chat = engine.add_request([{"role": "user", "content": "hello"}], max_new_tokens=3)
    run_to_end(engine)
    assert engine.get_output(text).prompt_ids == tok("hello")["input_ids"]
    assert engine.get_output(chat).prompt_ids == tok("hellozz")["input_ids"]


def test_jsonl_batch_round_trip(llama, tmp_path):
    prompts = random_prompts([6, 11, 4], seed=52)
    lines = [{"input_ids": prompts[0]}, {"input_ids": prompts[1], "max_new_tokens": 3, "id": "b"},
             {"prompt": "abc", "temperature": 0.7, "seed": 1}]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    engine = Engine(llama, CharTokenizer(), kv_budget=32, block_size=4)
    written = []
    results = run_requests(engine, read_requests(source), {"max_new_tokens": 5}, progress_bar=False,
                           on_result=written.append)
    assert written == results and sorted(map(str, (r["id"] for r in results))) == ["1", "3", "b"]
    assert results[0]["id"] == "b"  # in the order they finish: the 3-token request first
    by_id = {r["id"]: r for r in results}
    assert by_id[1]["output_ids"] == greedy_reference(llama, prompts[0], 5)
    assert by_id["b"]["output_ids"] == greedy_reference(llama, prompts[1], 3)
    assert len(by_id[3]["output_ids"]) == 5 and by_id[3]["finish_reason"] == "length"
    write_results(tmp_path / "out.jsonl", results)
    assert [json.loads(x)["id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == ["b", 1, 3]


@pytest.mark.parametrize("line,fragment", [
    ('{"prompt": "a", "input_ids": [3]}', "exactly one of"),
    ('{"text": "a"}', "exactly one of"),
    ('{"prompt": "a", "temp": 1}', "unknown field"),
    ("{not json", "not valid JSON"),
    ('{"prompt": "a", "temperature": "hot"}', '"temperature" must be a finite number >= 0'),
    ('{"prompt": "a", "temperature": -1}', '"temperature" must be a finite number >= 0'),
    ('{"prompt": "a", "stop": ""}', '"stop" must be a non-empty string'),
    ('{"prompt": "a", "stop": ["x", ""]}', '"stop" must be a non-empty string'),
    ('{"prompt": "a", "max_new_tokens": 0}', "max_new_tokens must be an integer >= 1"),
    ('{"prompt": "a", "seed": -3, "temperature": 1}', "seed must be an integer"),
    ('{"prompt": "a", "top_p": 2}', "top_p must be in (0, 1]"),
    ('{"input_ids": [3, -1]}', '"input_ids" must be a non-empty list of non-negative integers'),
    ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"prompt": "a", "id": 1}', "id 1 is also line 1's"),
    ('{"prompt": "a", "id": [1]}', '"id" must be a string or an integer'),
])
def test_malformed_lines_name_the_line(tmp_path, line, fragment):
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError) as err:
        read_requests(source)
    assert fragment in str(err.value) and "p.jsonl:2" in str(err.value)


def test_every_bad_line_is_reported_at_once(tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "ok"}\n{"prompt": 1}\n\n{"text": 2}\n{"prompt": "x", "stop": ""}\n')
    with pytest.raises(ValueError) as err:
        read_requests(source)
    assert [line.split(": ")[0] for line in str(err.value).splitlines()] == [f"{source}:{n}" for n in (2, 4, 5)]


@pytest.mark.parametrize("flags, fragment", [
    (["--assistant", "early_exit"], "self-speculation"),
    (["--assistant", "nonsense"], "Unknown assistant"),
    (["--num-draft-tokens", "4"], "add --assistant"),
])
def test_batch_assistant_flags_are_checked_before_the_model_loads(tmp_path, capsys, flags, fragment):
    from hf_kvspec.cli import main

    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(SystemExit):
        main(["batch", str(source), "--out", str(tmp_path / "out.jsonl"), *flags])
    assert fragment in capsys.readouterr().err
