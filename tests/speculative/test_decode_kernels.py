"""The loop's decode kernels (``decode_kernels=True``, the default): greedy output stays token-identical to
``generate(do_sample=False)`` whichever kernel runs the verify and draft forwards; ``False`` keeps stock."""

from __future__ import annotations

import functools

import pytest
import torch

import hf_kvspec
from hf_kvspec.kernels.linear import KERNELS, DecodeKernels, onednn_available
from hf_kvspec.speculative import loop
from tests.speculative.helpers import batch, drafts_for

FAST = [k for k in KERNELS if k != "stock" and (k != "onednn" or onednn_available())]
MAX_NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    return drafts_for(request.param)


def _swaps(module):
    """Record, per forward of ``module``, whether its forward was swapped at that moment."""
    seen = []
    handle = module.register_forward_pre_hook(lambda mod, args: seen.append("forward" in vars(mod)))
    return seen, handle


@pytest.mark.parametrize("kernel", FAST)
@pytest.mark.parametrize("bs", [1, 4])
def test_forced_kernels_keep_greedy_identical(models, kernel, bs, monkeypatch):
    target, drafts = models
    ids, mask = batch(bs)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    expected = target.generate(ids, **kw)
    made = []

    def forced(*models, **options):
        made.append(DecodeKernels(*models, force=kernel, min_weight_elements=0, **options))
        return made[-1]

    monkeypatch.setattr(loop, "DecodeKernels", forced)
    for name in ("partial", "right"):
        assistant = hf_kvspec.DraftModelAssistant(drafts[name], num_draft_tokens=4)
        out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **kw)
        assert torch.equal(out, expected), name
        assert made[-1].calls[kernel] > 0  # the fast kernel really ran
    assert "forward" not in vars(target.lm_head)  # restored after the call


def test_target_and_draft_linears_are_swapped_by_default_and_not_with_false(models, monkeypatch):
    """The loop opens DecodeKernels over the target and the draft (tiny layers count here: threshold 0)."""
    target, drafts = models
    ids, mask = batch(1)
    monkeypatch.setattr(loop, "DecodeKernels", functools.partial(DecodeKernels, min_weight_elements=0))
    target_seen, target_hook = _swaps(target.lm_head)
    draft_seen, draft_hook = _swaps(drafts["partial"].lm_head)
    try:
        for enabled in (True, False):
            target_seen.clear(), draft_seen.clear()
            target.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, do_sample=False,
                            custom_generate=hf_kvspec.speculative_generate, decode_kernels=enabled,
                            assistant=hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=3))
            assert target_seen and set(target_seen) == {enabled}
            assert draft_seen and set(draft_seen) == {enabled}
    finally:
        target_hook.remove(), draft_hook.remove()


def test_enable_path_passes_decode_kernels_through(models, monkeypatch):
    target, _ = models
    ids, mask = batch(1)
    monkeypatch.setattr(loop, "DecodeKernels", functools.partial(DecodeKernels, min_weight_elements=0))
    seen, handle = _swaps(target.lm_head)
    hf_kvspec.enable(target)
    try:
        target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False,
                        assistant=hf_kvspec.NgramAssistant(), decode_kernels=False)
        assert seen and not any(seen)
    finally:
        hf_kvspec.disable(target)
        handle.remove()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_with_forced_kernels_draws_what_stock_draws(seed, monkeypatch):
    """Same seed, same draws: the kernels change logits only by fp32 rounding, far below what moves a sample
    (the exact-distribution tests in test_sampling.py run with the default, timed kernels)."""
    target, drafts = drafts_for("llama")
    ids, mask = batch(4)

    def sample(enabled):
        torch.manual_seed(seed)
        return target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW, pad_token_id=0,
                               custom_generate=hf_kvspec.speculative_generate, decode_kernels=enabled,
                               assistant=hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4))

    stock = sample(False)
    monkeypatch.setattr(loop, "DecodeKernels", functools.partial(DecodeKernels, force=FAST[-1], min_weight_elements=0))
    assert torch.equal(sample(True), stock)
