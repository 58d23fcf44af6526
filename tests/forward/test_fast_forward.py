"""The fast forward (``hf_kvspec.forward``) against the reference, the model's own forward, on tiny models.

Tolerance: the fast forward computes the same function with fused, transposed weight copies, so each projection
sums in another order; on these models (hidden 64, fp32, activations O(1)) the logits differ by ~1e-6, and
``ATOL = 1e-4`` leaves two orders of margin while any real mistake (a missed norm, rotary or mask) moves logits
by O(0.1) or more.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_kvspec
from hf_kvspec.forward import runner
from hf_kvspec.forward.packed import unsupported_reason
from hf_kvspec.forward.runner import EagerForward, FastForward, choose_forward
from hf_kvspec.kernels import fp32
from hf_kvspec.kernels.ops import onednn_available
from tests.tiny_models import left_padded_batch, tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param, seed=3)


def _pair(model, inputs, feature_layers=None, cache_pair=None):
    """(fast, reference) results of one forward each on their own copies of a cache."""
    fast_cache, eager_cache = cache_pair or (None, None)
    fast = FastForward(model)(inputs, fast_cache, feature_layers)
    eager = EagerForward(model)(inputs, eager_cache, feature_layers)
    return fast, eager


@torch.inference_mode()
def test_prefill_then_decode_steps_match_the_reference(model):
    ids = torch.randint(3, 96, (2, 9))
    (fl, _, fc), (el, _, ec) = _pair(model, dict(input_ids=ids))
    torch.testing.assert_close(fl, el, atol=ATOL, rtol=0)
    token = el[:, -1:].argmax(-1)
    for _ in range(4):
        (fl, _, _), (el, _, _) = _pair(model, dict(input_ids=token, logits_to_keep=1), cache_pair=(fc, ec))
        torch.testing.assert_close(fl, el, atol=ATOL, rtol=0)
        token = el[:, -1:].argmax(-1)
    assert fc.get_seq_length() == ec.get_seq_length() == 13
    torch.testing.assert_close(fc.layers[1].keys, ec.layers[1].keys, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_left_padding_and_several_new_tokens_with_features(model):
    ids, mask = left_padded_batch([[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions)
    (fl, ff, fc), (el, ef, ec) = _pair(model, inputs, feature_layers=(0, 1, -1))
    real = mask.bool()
    torch.testing.assert_close(fl[real], el[real], atol=ATOL, rtol=0)  # padding columns' outputs are unused
    torch.testing.assert_close(ff[real], ef[real], atol=ATOL, rtol=0)
    assert not fl.isnan().any()
    new = torch.randint(3, 96, (3, 4))  # a verify forward: 4 tokens per row after the padded prompts
    inputs = dict(input_ids=new, attention_mask=torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], dim=1),
                  position_ids=positions[:, -1:] + 1 + torch.arange(4), logits_to_keep=4)
    (fl, ff, _), (el, ef, _) = _pair(model, inputs, feature_layers=(2,), cache_pair=(fc, ec))
    torch.testing.assert_close(fl, el, atol=ATOL, rtol=0)
    torch.testing.assert_close(ff, ef, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_a_4d_tree_mask_is_used_as_given(model):
    ids = torch.randint(3, 96, (1, 5))
    (_, _, fc), (_, _, ec) = _pair(model, dict(input_ids=ids))
    # root + two siblings (each sees the root only) + a child of the second: nodes 0..3 at positions 5, 6, 6, 7
    parents = [-1, 0, 0, 2]
    visible = torch.zeros(4, 9, dtype=torch.bool)
    visible[:, :5] = True
    for node, parent in enumerate(parents):
        visible[node, 5 + node] = True
        while parent >= 0:
            visible[node, 5 + parent], parent = True, parents[parent]
    mask = torch.zeros(1, 1, 4, 9).masked_fill(~visible, torch.finfo(torch.float32).min)
    inputs = dict(input_ids=torch.randint(3, 96, (1, 4)), attention_mask=mask,
                  position_ids=torch.tensor([[5, 6, 6, 7]]), logits_to_keep=4)
    (fl, _, _), (el, _, _) = _pair(model, inputs, cache_pair=(fc, ec))
    torch.testing.assert_close(fl, el, atol=ATOL, rtol=0)


def test_the_model_is_left_as_it_was(model):
    before = {name: (t.data_ptr(), t.clone()) for name, t in model.state_dict().items()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with torch.inference_mode():
        FastForward(model)(dict(input_ids=torch.tensor([[4, 5, 6]])), None)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(after[n].data_ptr() == ptr and torch.equal(after[n], value) for n, (ptr, value) in before.items())
    assert hooks == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert not any("forward" in vars(m) for m in model.modules())


def test_one_panel_copy_serves_every_row_count():
    """With the fp32 panel kernel: one copy of every linear weight (fused, padded to 16-row panels), whatever ran."""
    model = tiny_model("llama", seed=5)
    if not fp32.available():
        pytest.skip("the fp32 panel kernel needs a C compiler")
    fast = FastForward(model)
    fused = [(4 * 16 + 2 * 2 * 16, 64), (64, 64), (2 * 128, 64), (64, 128)] * 2 + [(96, 64)]  # (O, I) per call
    expected = sum(-(-out // 16) * 16 * inp * 4 for out, inp in fused)
    with torch.inference_mode():
        fast(dict(input_ids=torch.tensor([[4, 5, 6]])), None)
        fast(dict(input_ids=torch.tensor([[4]])), None)
    assert fast.report()["packed_bytes"] == expected
    assert runner.release_packed_weights(model) == expected


def test_without_the_panel_kernel_a_blocked_copy_follows_after_several_rows(monkeypatch):
    monkeypatch.setattr(fp32, "available", lambda: False)
    model = tiny_model("llama", seed=5)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    one_copy = sum(p.numel() * 4 for m in linears for p in m.parameters(recurse=False))
    fast = FastForward(model)
    assert fast.report()["packed_bytes"] == one_copy  # nothing ran yet: the transposed copies only
    with torch.inference_mode():
        fast(dict(input_ids=torch.tensor([[4]])), None)
        assert fast.report()["packed_bytes"] == one_copy  # one row reads the transposed copies
        fast(dict(input_ids=torch.tensor([[4, 5, 6]])), None)
    weights = sum(m.weight.numel() * 4 for m in linears)
    assert fast.report()["packed_bytes"] == one_copy + (weights if onednn_available() else 0)
    assert runner.release_packed_weights(model) == fast.report()["packed_bytes"]


def test_a_changed_weight_is_repacked():
    model = tiny_model("llama", seed=4)
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.inference_mode():
        FastForward(model)(dict(input_ids=ids), None)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # in place: same tensor, new version
    fast = FastForward(model)
    assert fast.pack_s > 0  # repacked, not served from the stale copy
    with torch.inference_mode():
        (fl, _, _), (el, _, _) = (fast(dict(input_ids=ids), None), EagerForward(model)(dict(input_ids=ids), None))
    torch.testing.assert_close(fl, el, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kind", "needle"), [("mistral", "sliding-window"), ("gemma2", "model_type"),
                                              ("deepseek_v3", "model_type")])
def test_unsupported_models_are_named_and_auto_keeps_the_reference(kind, needle, monkeypatch):
    model = tiny_model(kind)
    assert needle in unsupported_reason(model)
    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 0)
    assert choose_forward(model, None).name == "eager"
    with pytest.raises(ValueError, match=f"fast_forward=True does not apply.*{needle}"):
        choose_forward(model, True)


def test_bf16_and_small_models_keep_the_reference_under_auto(monkeypatch):
    model = tiny_model("llama")
    assert choose_forward(model, None).name == "eager"  # layers below MIN_LINEAR_ELEMENTS
    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 0)
    assert choose_forward(model, None).name == "fast"
    assert "fp32" in unsupported_reason(tiny_model("llama").to(torch.bfloat16))
    with pytest.raises(TypeError, match="True, False or None"):
        choose_forward(model, "yes")


def _generate(model, ids, **kw):
    return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, return_dict_in_generate=True, **kw)


def test_plain_decoding_on_the_fast_forward_equals_generate(model):
    ids, mask = left_padded_batch([[5, 6, 7, 8], [9, 10]])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = _generate(model, ids, attention_mask=mask, fast_forward=True)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.forward["forward"] == "fast"
    assert _generate(model, ids, attention_mask=mask, fast_forward=False).acceptance.forward == {"forward": "eager"}


def test_a_cache_the_fast_forward_cannot_use(model, monkeypatch):
    ids = torch.tensor([[4, 5, 6]])
    static = StaticCache(config=model.config, max_cache_len=32)
    with pytest.raises(ValueError, match=r"DynamicCache.*StaticCache"):
        _generate(model, ids, cache=static, fast_forward=True)
    out = _generate(model, ids, cache=StaticCache(config=model.config, max_cache_len=32), fast_forward=None)
    assert out.acceptance.forward["forward"] == "eager"
    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 0)  # auto would pick the fast forward for this model
    fresh = tiny_model("llama", seed=11)
    _generate(fresh, ids, cache=StaticCache(config=fresh.config, max_cache_len=32), fast_forward=None)
    assert fresh not in runner._PACKED  # a call that cannot use the copies never makes them
    assert _generate(model, ids, cache=DynamicCache(config=model.config), fast_forward=True).acceptance.forward[
        "forward"] == "fast"


@torch.inference_mode()
def test_appends_into_spare_columns_match_dynamic_cache_updates():
    """``attend.append`` against ``DynamicLayer.update`` through crops, row selection and a replaced tensor."""
    from transformers.cache_utils import DynamicLayer

    from hf_kvspec.forward.attend import append

    ours, reference = DynamicLayer(), DynamicLayer()

    def step(tokens, rows=3):
        k, v = torch.randn(rows, 2, tokens, 4), torch.randn(rows, 2, tokens, 4)
        got, expected = append(ours, k, v), reference.update(k, v)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    step(5)
    first = ours.keys
    step(1)
    assert ours.keys.data_ptr() == first.data_ptr()  # written in place after the held columns, no copy
    assert torch.equal(first, reference.keys[:, :, :5])  # an earlier view is unchanged
    for layer in (ours, reference):
        layer.crop(-3)
    step(4)
    for layer in (ours, reference):
        layer.batch_select_indices(torch.tensor([2, 0]))
    step(2, rows=2)
    ours.keys, reference.keys = ours.keys.clone() + 1, reference.keys.clone() + 1  # replaced by someone else
    step(1, rows=2)
    step(300, rows=2)  # past the buffer's capacity: grows
    assert ours.get_seq_length() == reference.get_seq_length() == 310


def test_norm_and_rotary_are_bitwise_the_modules_formulas():
    """The program's RMSNorm and rotary against transformers' formulas written out: equal bit for bit."""
    from hf_kvspec.forward import program

    torch.manual_seed(0)
    x, weight = torch.randn(2, 5, 96), torch.randn(96)
    assert torch.equal(program.rms_norm(x, weight, 1e-6), weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                                    + 1e-6)))
    q, cos, sin = torch.randn(2, 4, 5, 16), torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)
    rotate_half = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    assert torch.equal(program.rotate(q, cos, program.signed_sin(sin)), q * cos + rotate_half * sin)
