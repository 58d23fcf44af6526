"""The loop uses the caller's cache, crops it on rejection, and refuses caches that cannot crop."""

from __future__ import annotations

import pytest
from transformers import DynamicCache

import hf_kvspec
from tests.speculative.helpers import batch, drafts_for


class _NoCrop(DynamicCache):
    is_croppable = False


class _CountingCache(DynamicCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.crops = []

    def crop(self, tokens_to_remove: int) -> None:
        self.crops.append(tokens_to_remove)
        super().crop(tokens_to_remove)


@pytest.fixture(scope="module")
def models():
    return drafts_for("llama")


def test_non_croppable_cache_is_refused(models):
    target, drafts = models
    ids, _mask = batch(1)
    with pytest.raises(ValueError, match="_NoCrop cannot be cropped"):
        target.generate(ids, max_new_tokens=4, custom_generate=hf_kvspec.speculative_generate,
                        assistant=hf_kvspec.DraftModelAssistant(drafts["right"]), cache=_NoCrop(config=target.config))


def test_callers_cache_is_used_and_cropped(models):
    target, drafts = models
    ids, mask = batch(4)
    cache = _CountingCache(config=target.config)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, return_dict_in_generate=True,
                          assistant=hf_kvspec.DraftModelAssistant(drafts["wrong"], num_draft_tokens=4), cache=cache)
    assert out.cache is cache
    assert cache.crops and all(k < 0 for k in cache.crops)  # negative crop = tokens removed
    # the cache ends one column short of the buffer: sequences plus the holes of shorter rows, minus the last token
    assert cache.get_seq_length() >= out.sequences.shape[1] - 1
