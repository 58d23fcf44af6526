"""The loop's decode kernels (``decode_kernels=True``, opt-in): greedy output stays token-identical to
``generate(do_sample=False)`` whichever kernel runs the verify and draft forwards; ``False`` (the default) keeps
stock. The loop imports ``DecodeKernels`` from ``hf_kvspec.kernels.linear`` only when asked, so the tests replace
it there."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

import hf_kvspec
from hf_kvspec.kernels import linear
from hf_kvspec.kernels.linear import KERNELS, DecodeKernels, onednn_available
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

    monkeypatch.setattr(linear, "DecodeKernels", forced)
    for name in ("partial", "right"):
        assistant = hf_kvspec.DraftModelAssistant(drafts[name], num_draft_tokens=4)
        out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                              decode_kernels=True, **kw)
        assert torch.equal(out, expected), name
        assert made[-1].calls[kernel] > 0  # the fast kernel really ran
    assert "forward" not in vars(target.lm_head)  # restored after the call


def test_target_and_draft_linears_are_swapped_with_true_and_not_with_false(models, monkeypatch):
    """The loop opens DecodeKernels over the target and the draft (tiny layers count here: threshold 0)."""
    target, drafts = models
    ids, mask = batch(1)
    monkeypatch.setattr(linear, "DecodeKernels", functools.partial(DecodeKernels, min_weight_elements=0))
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
    monkeypatch.setattr(linear, "DecodeKernels", functools.partial(DecodeKernels, min_weight_elements=0))
    seen, handle = _swaps(target.lm_head)
    hf_kvspec.enable(target)
    try:
        target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False,
                        assistant=hf_kvspec.NgramAssistant(), decode_kernels=False)
        assert seen and not any(seen)
        seen.clear()
        target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False,
                        assistant=hf_kvspec.NgramAssistant(), decode_kernels=True)
        assert seen and all(seen)
    finally:
        hf_kvspec.disable(target)
        handle.remove()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_with_forced_kernels_draws_what_stock_draws(seed, monkeypatch):
    """Same seed, same draws: the kernels change logits only by fp32 rounding, far below what moves a sample
    (the exact-distribution tests in test_sampling.py run with the default, stock kernels)."""
    target, drafts = drafts_for("llama")
    ids, mask = batch(4)

    def sample(enabled):
        torch.manual_seed(seed)
        return target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW, pad_token_id=0,
                               custom_generate=hf_kvspec.speculative_generate, decode_kernels=enabled,
                               assistant=hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4))

    stock = sample(False)
    monkeypatch.setattr(linear, "DecodeKernels", functools.partial(DecodeKernels, force=FAST[-1], min_weight_elements=0))
    assert torch.equal(sample(True), stock)


def test_default_is_stock(models, monkeypatch):
    """Without ``decode_kernels=`` no linear of the target or the draft is swapped."""
    target, drafts = models
    ids, mask = batch(1)
    monkeypatch.setattr(linear, "DecodeKernels", functools.partial(DecodeKernels, min_weight_elements=0))
    target_seen, target_hook = _swaps(target.lm_head)
    draft_seen, draft_hook = _swaps(drafts["partial"].lm_head)
    try:
        target.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, do_sample=False,
                        custom_generate=hf_kvspec.speculative_generate,
                        assistant=hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=3))
        assert target_seen and not any(target_seen)
        assert draft_seen and not any(draft_seen)
    finally:
        target_hook.remove(), draft_hook.remove()


_NOT_IMPORTED = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_kvspec
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(1, 64, (1, 6))
kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
model.generate(ids, custom_generate=hf_kvspec.speculative_generate,
               assistant=hf_kvspec.DraftModelAssistant(model, num_draft_tokens=3), **kw)
hf_kvspec.enable(model)
out = model.generate(ids, assistant=hf_kvspec.NgramAssistant(), return_dict_in_generate=True, **kw)
assert out.acceptance.target_forwards > 0, "the speculative loop did not run"
print(sorted(name for name in sys.modules if name.startswith("hf_kvspec.kernels")))
"""


def test_default_generate_does_not_import_the_kernels():
    """A fresh interpreter: importing hf_kvspec and a speculative generate with default settings (both entry
    points) leaves ``hf_kvspec.kernels`` unimported."""
    done = subprocess.run([sys.executable, "-c", _NOT_IMPORTED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
