"""The loop's decode kernels (on by default for fp32 CPU targets): greedy output stays token-identical to
``generate(do_sample=False)`` whichever kernel runs the verify and draft forwards; ``decode_kernels=False`` keeps
stock and never imports them. The loop imports ``DecodeKernels`` from ``hf_kvspec.kernels.linear`` when it runs,
so the tests replace it there."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import ClassVar

import pytest
import torch

import hf_kvspec
from hf_kvspec.kernels import linear
from hf_kvspec.kernels.linear import KERNELS, DecodeKernels, onednn_available
from tests.speculative.helpers import batch, drafts_for

FAST = [k for k in KERNELS if k != "stock" and (k != "onednn" or onednn_available())]
MAX_NEW = 24


@pytest.fixture(autouse=True)
def _reference_forward(_fast_forward_tiny_models, monkeypatch):
    """The kernels route the model's own forward: these tests keep the target on it (the fast forward reads its
    own packed weights and is tested in tests/forward/)."""
    from hf_kvspec.forward import runner

    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 1 << 62)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    return drafts_for(request.param)


class _Recording(DecodeKernels):
    """``DecodeKernels`` that remembers every layer it routed (tiny layers count here: threshold 0)."""

    made: ClassVar[list] = []

    def __init__(self, *models, **options):
        super().__init__(*models, **{"min_weight_elements": 0, **options})
        self.routed = set()
        _Recording.made.append(self)

    def route(self, module, x):
        self.routed.add(module)
        return super().route(module, x)


@pytest.fixture
def recording(monkeypatch):
    _Recording.made = []
    monkeypatch.setattr(linear, "DecodeKernels", _Recording)
    return _Recording.made


def _routed(made) -> set:
    return set().union(*(context.routed for context in made))


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
    assert "forward" not in vars(target.lm_head)  # never replaced


@pytest.mark.parametrize("enabled", [None, True, False])
def test_verify_forwards_are_routed_by_default_and_with_true_not_with_false(models, recording, enabled):
    """The loop routes the target's verify forwards (several rows per sequence); drafting and plain steps run
    stock (a 1-row call gains less than the routing costs)."""
    target, drafts = models
    ids, mask = batch(1)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, do_sample=False,
                          custom_generate=hf_kvspec.speculative_generate, decode_kernels=enabled,
                          return_dict_in_generate=True,
                          assistant=hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=3))
    routed = _routed(recording)
    assert (target.lm_head in routed) is (enabled is not False)
    assert drafts["partial"].lm_head not in routed
    assert (out.acceptance.kernels is not None) is (enabled is not False)
    if enabled is not False:
        assert out.acceptance.kernels["bytes_held"] >= 0 and sum(out.acceptance.kernels["calls"].values()) > 0


def test_a_bf16_target_runs_stock_by_default(recording):
    target, _ = drafts_for("llama")
    half = type(target)(target.config).to(torch.bfloat16).eval()
    half.load_state_dict(target.state_dict())
    ids, mask = batch(1)
    out = half.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False,
                        custom_generate=hf_kvspec.speculative_generate, return_dict_in_generate=True,
                        assistant=hf_kvspec.NgramAssistant())
    assert not recording and out.acceptance.kernels is None


def test_enable_path_passes_decode_kernels_through(models, recording):
    target, _ = models
    ids, mask = batch(1)
    hf_kvspec.enable(target)
    try:
        target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False,
                        assistant=hf_kvspec.NgramAssistant(), decode_kernels=False)
        assert not _routed(recording)
        target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False,
                        assistant=hf_kvspec.NgramAssistant())
        assert target.lm_head in _routed(recording)
    finally:
        hf_kvspec.disable(target)


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


_NOT_IMPORTED = """
import sys
from typing import ClassVar
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_kvspec
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(1, 64, (1, 6))
kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
model.generate(ids, custom_generate=hf_kvspec.speculative_generate, decode_kernels=False,
               assistant=hf_kvspec.DraftModelAssistant(model, num_draft_tokens=3), **kw)
hf_kvspec.enable(model)
out = model.generate(ids, assistant=hf_kvspec.NgramAssistant(), return_dict_in_generate=True, decode_kernels=False,
                     **kw)
assert out.acceptance.target_forwards > 0, "the speculative loop did not run"
print(sorted(name for name in sys.modules if name.startswith("hf_kvspec.kernels")))
"""


def test_the_reference_path_does_not_import_the_kernels():
    """A fresh interpreter: importing hf_kvspec and a speculative generate with ``decode_kernels=False`` (both entry
    points) leaves ``hf_kvspec.kernels`` unimported."""
    done = subprocess.run([sys.executable, "-c", _NOT_IMPORTED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
