"""``response_format`` through the real ``openai`` client: a JSON schema's output parses and validates, equals
transformers' own constrained greedy ``generate`` on the chat template although the server's engine speculates
(n-gram drafts verified every round), whole and streamed; ``json_object`` starts an object; bad formats are
refused by name."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from hf_kvspec.grammar import GrammarLogitsProcessor  # noqa: E402
from hf_kvspec.serving.engine import Engine  # noqa: E402
from tests.tiny_models import char_tokenizer, tiny_model  # noqa: E402

from .server_harness import CHAT_TEMPLATE, RunningServer  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
MESSAGES = [{"role": "user", "content": "Fill the form."}]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = Engine(model, tokenizer, kv_budget=128, block_size=4, max_tokens_per_round=48, max_running=4,
                    assistant="ngram", draft_lengths="fixed")
    with RunningServer(engine) as running:
        yield running


def test_a_json_schema_output_validates_and_equals_constrained_generate(server, model, tokenizer):
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "form", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                           response_format=response_format)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=80, pad_token_id=0,
                                   logits_processor=[GrammarLogitsProcessor(tokenizer, json_schema=SCHEMA)])
    assert whole.kvspec["choices"][0]["token_ids"] == reference[0, len(prompt):].tolist()
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                                 response_format=response_format, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    sampled = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=1.0,
                                             seed=4, n=3, response_format=response_format)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert sum(r.num_draft_tokens for r in server.state.engine.stats.rounds) > 0  # verify rows were exercised


def test_json_object_starts_an_object(server):
    reply = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                    response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_object", "schema": {}}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "response_format"),
])
def test_bad_response_formats_are_refused_by_name(server, response_format, param):
    body = {"model": "tiny", "max_tokens": 2, "messages": MESSAGES, "response_format": response_format}
    status, _, raw = server.raw("POST", "/v1/chat/completions", json.dumps(body))
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
