"""Greedy speculative decoding is token-identical to generate(do_sample=False) (tiny fp32 Llama and Qwen2)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from tests.speculative.helpers import PROMPTS, batch, drafts_for

MAX_NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    return drafts_for(request.param)


def _plain(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, **kw)


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("draft_name", ["right", "wrong", "partial"])
def test_custom_generate_matches_plain_greedy(models, draft_name, bs):
    target, drafts = models
    ids, mask = batch(bs)
    assistant = hf_kvspec.DraftModelAssistant(drafts[draft_name], num_draft_tokens=4)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          cache=DynamicCache(config=target.config), return_dict_in_generate=True)
    assert torch.equal(out.sequences, _plain(target, ids, mask))
    stats = out.acceptance
    assert not stats.empty  # canary: the loop really ran rounds
    if draft_name == "right":
        assert stats.mean_acceptance == 1.0
    if draft_name == "wrong":
        assert stats.mean_acceptance < 0.1


@pytest.mark.parametrize("draft_name", ["right", "partial"])
def test_enable_matches_plain_greedy(models, draft_name):
    target, drafts = models
    ids, mask = batch(4)
    expected = _plain(target, ids, mask)
    hf_kvspec.enable(target)
    try:
        assistant = hf_kvspec.DraftModelAssistant(drafts[draft_name], num_draft_tokens=3)
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                              assistant=assistant, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert not out.acceptance.empty
        # without assistant the enabled model is stock generate
        assert torch.equal(_plain(target, ids, mask), expected)
    finally:
        hf_kvspec.disable(target)
    assert "generate" not in vars(target)


def test_each_batch_row_equals_its_prompt_alone(models):
    target, drafts = models
    ids, mask = batch(4)
    assistant = hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=5)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
    for row, prompt in enumerate(PROMPTS):
        alone = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                                custom_generate=hf_kvspec.speculative_generate,
                                assistant=hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=5))
        offset = ids.shape[1] - len(prompt)
        assert torch.equal(out[row, offset: offset + alone.shape[1]], alone[0])


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_models_at_batch_one(kind):
    """Sequences longer than the window (8): rollback must work on sliding layers (past recording)."""
    target, drafts = drafts_for(kind)
    ids = torch.tensor([PROMPTS[2]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0)
    for name in ("right", "partial"):
        assistant = hf_kvspec.DraftModelAssistant(drafts[name], num_draft_tokens=4)
        out = target.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0,
                              custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
        assert torch.equal(out, expected), name


def test_sliding_window_batches_are_refused():
    target, drafts = drafts_for("mistral")
    ids, mask = batch(2)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0,
                        custom_generate=hf_kvspec.speculative_generate,
                        assistant=hf_kvspec.DraftModelAssistant(drafts["right"]))


def test_path_dependent_processors_under_greedy(models):
    """Repetition penalty, no-repeat-n-gram and min-new-tokens see each verified position's own prefix."""
    target, drafts = models
    ids, mask = batch(4)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=3,
              repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=6)
    expected = target.generate(ids, **kw)
    for name in ("right", "partial"):
        assistant = hf_kvspec.DraftModelAssistant(drafts[name], num_draft_tokens=4)
        out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                              return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, expected), name
        assert out.acceptance.mean_acceptance > 0.3
