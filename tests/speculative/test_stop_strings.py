"""Stop strings end a row inside an accepted draft as in plain generate, and a TextStreamer prints exactly the
returned text (real tokenizer, tiny random model)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, StoppingCriteriaList, StopStringCriteria, TextStreamer

import hf_kvspec
from hf_kvspec.models import bundled_model_path
from tests.tiny_models import left_padded_batch, tiny_model


@pytest.fixture(scope="module")
def setup():
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    vocab = len(tokenizer)
    target = tiny_model("llama", seed=0, vocab_size=vocab)
    draft = tiny_model("llama", seed=0, vocab_size=vocab)  # always right: the stop lands inside a kept draft
    ids, mask = left_padded_batch([tokenizer("The cat sat on")["input_ids"], tokenizer("Hello")["input_ids"]])
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=0)
    new = free[0, ids.shape[1]:].tolist()
    # a stop string = the text of a token that first shows up inside the second round (4 drafts + bonus)
    for at in range(6, 9):
        text = tokenizer.decode(new[at]).strip()
        if len(text) >= 2 and text not in tokenizer.decode(new[:at]):
            return tokenizer, target, draft, ids, mask, text, free
    pytest.skip("no distinctive token in the random continuation")


def _kwargs(ids, mask):
    return dict(attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=0)


def test_stop_strings_via_enable(setup):
    tokenizer, target, draft, ids, mask, stop, free = setup
    expected = target.generate(ids, **_kwargs(ids, mask), stop_strings=[stop], tokenizer=tokenizer)
    assert not torch.equal(expected[0], free[0])  # the stop string really stopped row 0 early (padded after)
    hf_kvspec.enable(target)
    try:
        out = target.generate(ids, **_kwargs(ids, mask), stop_strings=[stop], tokenizer=tokenizer,
                              assistant=hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=4))
    finally:
        hf_kvspec.disable(target)
    assert torch.equal(out, expected)
    assert stop in tokenizer.decode(out[0, ids.shape[1]:])


def test_stop_string_criteria_via_custom_generate(setup):
    tokenizer, target, draft, ids, mask, stop, _free = setup
    expected = target.generate(ids, **_kwargs(ids, mask), stop_strings=[stop], tokenizer=tokenizer)
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
    out = target.generate(ids, **_kwargs(ids, mask), stopping_criteria=criteria,
                          custom_generate=hf_kvspec.speculative_generate,
                          assistant=hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=4))
    assert torch.equal(out, expected)


class _TextCollector(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text


def test_text_streamer_output_equals_returned_text(setup):
    tokenizer, target, draft, ids, mask, _stop, _free = setup
    prompt = ids[1:, -int(mask[1].sum()):]  # TextStreamer streams batch size 1
    streamer = _TextCollector(tokenizer)
    out = target.generate(prompt, do_sample=False, max_new_tokens=14, pad_token_id=0, streamer=streamer,
                          custom_generate=hf_kvspec.speculative_generate,
                          assistant=hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=4))
    assert streamer.text == tokenizer.decode(out[0, prompt.shape[1]:])
    assert len(streamer.text) > 0
