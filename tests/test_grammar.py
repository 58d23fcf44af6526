"""Structured output (``hf_kvspec.grammar``): on a tiny random model spelling with a character tokenizer, every
output under a JSON schema parses and validates (``jsonschema``, the independent check) on 20 schemas; greedy
output under a grammar is the same from transformers' ``generate``, the engine, the engine with each drafter and
speculative ``generate`` (the verifier applies the mask at every node); the processor's masks do not depend on
the order paths are scored in (a fresh processor per path is the reference); bad grammars are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import hf_kvspec  # noqa: E402
from hf_kvspec.grammar import GrammarLogitsProcessor, compile_grammar  # noqa: E402
from hf_kvspec.serving.engine import Engine  # noqa: E402
from hf_kvspec.speculative.drafters.ngram import NgramAssistant  # noqa: E402
from tests.serving.helpers import run_to_end  # noqa: E402
from tests.serving.test_speculation import make_assistant  # noqa: E402
from tests.tiny_models import char_tokenizer, tiny_model  # noqa: E402

NAME = {"type": "string", "maxLength": 4}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"n": {"type": "null"}}, "required": ["n"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "boolean"}},
                                            "required": ["q"]}}, "required": ["p"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "b": {"enum": ["on", "off"]}}, "required": ["a", "b"]},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "child": {"type": "object", "properties": {"id": {"enum": [1, 2]}},
                                                "required": ["id"]}}, "required": ["id", "child"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]},
     "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[ab]{1,3}$"}}, "required": ["s"]},
    {"anyOf": [{"type": "boolean"}, {"enum": [1, 2, 3]}]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"]},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]},
                                                                         "maxItems": 2}, "maxItems": 2}},
     "required": ["m"]},
    {"type": "object", "properties": {"a": {"enum": ["u"]}, "b": {"type": "boolean"}, "c": {"type": "null"}},
     "required": ["a", "b", "c"], "additionalProperties": False},
]
PROMPT = "Answer: "


def closed(schema):
    """Objects without ``additionalProperties`` get ``false`` (as OpenAI's strict mode requires): a random model
    would otherwise add keys until the token limit."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: closed(value) for key, value in schema.items()}
    if schema.get("type") == "object":
        schema.setdefault("additionalProperties", False)
    return schema


SCHEMAS = [closed(schema) for schema in SCHEMAS]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def constrained(tokenizer, schema) -> GrammarLogitsProcessor:
    return GrammarLogitsProcessor(tokenizer, json_schema=schema)


def engine_output(model, tokenizer, schema, assistant=None, **settings) -> list[int]:
    engine = Engine(model, tokenizer, kv_budget=128, block_size=4, max_tokens_per_round=48, draft_lengths="fixed",
                    **({} if assistant is None else {"assistant": assistant}))
    request_id = engine.add_request(tokenizer(PROMPT)["input_ids"], max_new_tokens=80,
                                    logits_processor=[constrained(tokenizer, schema)], **settings)
    run_to_end(engine)
    return engine.get_output(request_id).output_ids


def text_of(tokenizer, output: list[int]) -> str:
    assert output[-1] == tokenizer.eos_token_id, "the grammar did not finish within the token limit"
    return tokenizer.decode(output[:-1])


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_parses_and_validates(llama, tokenizer, index):
    schema = SCHEMAS[index]
    for settings in ({}, {"do_sample": True, "seed": index}):
        value = json.loads(text_of(tokenizer, engine_output(llama, tokenizer, schema, **settings)))
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "oracle_tree", "eagle", "suffix"])
def test_speculation_under_a_grammar_is_greedy_exact(llama, tokenizer, kind):
    """Each drafter in the engine, and speculative generate, give transformers' own constrained greedy output."""
    ids = tokenizer(PROMPT)["input_ids"]
    for schema in (SCHEMAS[0], SCHEMAS[8], SCHEMAS[13]):
        with torch.no_grad():
            reference = llama.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=80,
                                       logits_processor=[constrained(tokenizer, schema)],
                                       pad_token_id=0)[0, len(ids):].tolist()
        assert engine_output(llama, tokenizer, schema, make_assistant(kind, llama)) == reference
        assert engine_output(llama, tokenizer, schema) == reference
    with torch.no_grad():
        speculative = llama.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=80, pad_token_id=0,
                                     logits_processor=[constrained(tokenizer, SCHEMAS[8])],
                                     custom_generate=hf_kvspec.speculative_generate,
                                     assistant=NgramAssistant(num_draft_tokens=4))[0, len(ids):].tolist()
    assert speculative == engine_output(llama, tokenizer, SCHEMAS[8])


def test_masks_do_not_depend_on_the_order_paths_are_scored_in(tokenizer):
    """Paths from one prompt scored in a shuffled order (as a tree verifier does) by one processor get the masks
    a fresh processor gets for each path alone."""
    schema = SCHEMAS[9]
    prompt = tokenizer(PROMPT)["input_ids"]
    valid = tokenizer('{"a":3,"b":"off"}')["input_ids"]  # compact: the default separators
    wrong = [*valid[:3], tokenizer.convert_tokens_to_ids("x")]
    paths = [valid[:n] for n in range(len(valid) + 1)] + [wrong]
    random.Random(0).shuffle(paths)
    shared = constrained(tokenizer, schema)
    shared(torch.tensor([prompt]), torch.zeros(1, 96))  # the first call fixes the prompt
    for path in paths:
        scores = torch.randn(1, 96)
        alone = constrained(tokenizer, schema)
        alone(torch.tensor([prompt]), torch.zeros(1, 96))
        expected = alone(torch.tensor([prompt + path]), scores)
        assert torch.equal(shared(torch.tensor([prompt + path]), scores), expected), path
    forbidden = shared(torch.tensor([prompt + wrong]), scores)
    assert torch.equal(forbidden, scores)  # a path through a forbidden token: unmasked (never accepted)
    start = shared(torch.tensor([prompt]), torch.zeros(1, 96))
    assert torch.isfinite(start).nonzero()[:, 1].tolist() == [tokenizer.convert_tokens_to_ids("{")]
    done = shared(torch.tensor([prompt + valid]), torch.zeros(1, 96))
    assert torch.isfinite(done).nonzero()[:, 1].tolist() == [tokenizer.eos_token_id]  # complete: only EOS


def test_bad_grammars_are_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="exactly one of"):
        compile_grammar()
    with pytest.raises(ValueError, match="exactly one of"):
        compile_grammar(json_object=True, regex="a+")
    with pytest.raises(ValueError, match="does not compile"):
        compile_grammar(regex="a(b")
    with pytest.raises(ValueError, match="does not compile"):
        GrammarLogitsProcessor(tokenizer, json_schema={"type": "objectx"})
    with pytest.raises(ValueError, match="not valid JSON"):
        compile_grammar(json_schema="{nope")
    regex = GrammarLogitsProcessor(tokenizer, regex="ab+")
    out = regex(torch.tensor([[1]]), torch.zeros(1, 96))
    assert torch.isfinite(out).nonzero()[:, 1].tolist() == [tokenizer.convert_tokens_to_ids("a")]


def test_keep_nodes_drops_a_node_with_its_descendants_and_reindexes_parents():
    from hf_kvspec.speculative.drafters.base import DraftProposal
    from hf_kvspec.speculative.rounds import keep_nodes

    chain = DraftProposal(torch.tensor([[5, 6, 7, 8]]))
    assert keep_nodes(chain, [True, True, False, True]).tokens.tolist() == [[5, 6]]
    assert keep_nodes(chain, [True] * 4) is chain
    #        0    1          2: child of 0, 3: child of 1, 4: child of 2
    tree = DraftProposal(torch.tensor([[10, 11, 12, 13, 14]]), None, torch.tensor([-1, -1, 0, 1, 2]))
    cut = keep_nodes(tree, [True, False, True, True, True])  # 1 goes, and 3 below it
    assert cut.tokens.tolist() == [[10, 12, 14]] and cut.parents.tolist() == [-1, 0, 1]
    assert keep_nodes(tree, [False, True, True, True, True]).tokens.tolist() == [[11, 13]]


def test_the_engine_verifies_no_draft_its_grammar_forbids(llama, tokenizer, monkeypatch):
    """Drafts outside the grammar are cut before verification (a fresh processor checks every verified path),
    some are cut, and the output is unchanged."""
    from hf_kvspec.serving import round_drafts

    verified, cut = [], [0]
    original = round_drafts.without_forbidden

    def spy(request, proposal):
        kept = original(request, proposal)
        cut[0] += proposal.tokens.shape[1] - kept.tokens.shape[1]
        if kept.tokens.shape[1]:
            parents = None if kept.parents is None else kept.parents.reshape(-1).tolist()
            verified.append((list(request.tokens), kept.tokens[0].tolist(), parents))
        return kept

    monkeypatch.setattr(round_drafts, "without_forbidden", spy)
    schema = SCHEMAS[9]
    reference = engine_output(llama, tokenizer, schema)
    assert engine_output(llama, tokenizer, schema, NgramAssistant(num_draft_tokens=4)) == reference
    assert engine_output(llama, tokenizer, schema, make_assistant("oracle_tree", llama)) == reference
    assert cut[0] > 0  # the unconstrained drafters' proposals break the grammar
    pool = make_assistant("suffix", llama)  # drafts the first answer again: allowed drafts, verified
    assert engine_output(llama, tokenizer, schema, pool) == engine_output(llama, tokenizer, schema, pool) == reference
    assert verified
    prompt = tokenizer(PROMPT)["input_ids"]
    for tokens, drafts, parents in verified:
        fresh = constrained(tokenizer, schema)
        fresh(torch.tensor([prompt]), torch.zeros(1, 96))
        assert all(fresh.allowed_drafts(tokens, drafts, parents)), (tokens, drafts)
