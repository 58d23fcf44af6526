"""Stop strings made of many byte-level tokens stop the engine where they stop ``generate`` — plain and
speculative — (issue 40 item 4): an emoji with a skin tone, a flag, CJK inside a longer word, a combining mark.

The bundled tokenizer (byte-level BPE, 49,152 ids) over a tiny random model of the same vocabulary, whose output
is forced to a chosen text by a logits processor, so the tokens around each stop string are known.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessorList

import hf_kvspec
from hf_kvspec.models import bundled_model_path
from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason
from tests.tiny_models import tiny_model

PROMPT = "Say it:"
CASES = [  # (forced continuation, stop string)
    (" Great 👍🏽 thanks, see you soon", "👍🏽"),
    (" Vive la 🇫🇷 et la 🇩🇪 aussi", "🇫🇷"),
    (" I like 日本語 a lot", "日本"),
    (" un cafe\u0301 noir, merci", "e\u0301"),
    (" plain words then more", "then"),
]
MAX_NEW = 24


class Forced:
    """A logits processor that makes the model emit ``target`` after a prompt of ``prompt_len`` tokens."""

    def __init__(self, target: list[int], prompt_len: int):
        self.target, self.prompt_len = target, prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.target[min(step, len(self.target) - 1)]] = 0.0
        return forced


@pytest.fixture(scope="module")
def setup():
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    model = tiny_model("llama", seed=0, vocab_size=len(tokenizer), eos_token_id=None)
    model.generation_config.eos_token_id = None
    return tokenizer, model


def _case(tokenizer, continuation):
    prompt = tokenizer(PROMPT)["input_ids"]
    target = tokenizer(continuation)["input_ids"]
    target += target[-1:] * MAX_NEW  # keep going past the text if nothing stops it
    return prompt, Forced(target, len(prompt))


def _generate(model, tokenizer, prompt, forced, stop, assistant=None):
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, stop_strings=[stop], tokenizer=tokenizer,
                  logits_processor=LogitsProcessorList([forced]), attention_mask=torch.ones_like(ids))
    if assistant is None:
        return model.generate(ids, **kwargs)[0, len(prompt):].tolist()
    hf_kvspec.enable(model)
    try:
        return model.generate(ids, assistant=assistant, **kwargs)[0, len(prompt):].tolist()
    finally:
        hf_kvspec.disable(model)


@pytest.mark.parametrize("continuation, stop", CASES, ids=[stop for _, stop in CASES])
def test_engine_and_generate_stop_at_the_same_token(setup, continuation, stop):
    tokenizer, model = setup
    prompt, forced = _case(tokenizer, continuation)
    engine = Engine(model, tokenizer, kv_budget=64, block_size=8)
    rid = engine.add_request(prompt, max_new_tokens=MAX_NEW, stop_strings=[stop], logits_processor=[forced])
    finish = [d.finish_reason for d in engine.stream(rid)][-1]
    output = engine.get_output(rid)
    assert finish is FinishReason.STOP and len(output.output_ids) < MAX_NEW
    text = tokenizer.decode(output.output_ids)
    assert text.endswith(stop) or stop in text[-len(stop) - 4:]  # stopped by the token that completed it
    assert stop not in tokenizer.decode(output.output_ids[:-1])  # and not one token later
    assert output.output_ids == _generate(model, tokenizer, prompt, forced, stop)
    speculative = _generate(model, tokenizer, prompt, forced, stop, hf_kvspec.DraftModelAssistant(model, 3))
    assert speculative == output.output_ids


def test_a_speculative_engine_stops_inside_an_accepted_draft(setup):
    """With an assistant the stop string may complete in the middle of a round's accepted tokens."""
    tokenizer, model = setup
    continuation, stop = CASES[0]
    prompt, forced = _case(tokenizer, continuation)
    engine = Engine(model, tokenizer, kv_budget=64, block_size=8, assistant="ngram")
    rid = engine.add_request(prompt, max_new_tokens=MAX_NEW, stop_strings=[stop], logits_processor=[forced])
    assert [d.finish_reason for d in engine.stream(rid)][-1] is FinishReason.STOP
    assert engine.get_output(rid).output_ids == _generate(model, tokenizer, prompt, forced, stop)
