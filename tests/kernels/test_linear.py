"""Decode kernels (``hf_kvspec/kernels/linear.py``) against ``F.linear``, the reference path."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from hf_kvspec.kernels import linear as kl
from hf_kvspec.kernels.linear import KERNELS, DecodeKernels, onednn_available, plans, release_decode_kernels

FAST = [k for k in KERNELS if k != "stock" and (k != "onednn" or onednn_available())]


def _net(bias: bool = True, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 80, bias=bias), nn.ReLU(), nn.Linear(80, 1000, bias=bias)).eval()


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_onednn_is_available_on_the_x86_ci_build():
    # the CPU wheel this project pins ships oneDNN; if this fails, the fast verify path silently is not there
    assert onednn_available() or not torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("kernel", FAST)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16, 33, 64])
def test_each_kernel_computes_linear(kernel, bias, rows):
    net = _net(bias)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        expected = net(x)
        with DecodeKernels(net, force=kernel) as ctx:
            actual = net(x)
        assert ctx.calls[kernel] == 2 and ctx.calls["stock"] == 0  # both layers ran the kernel
    _close(actual, expected)


@pytest.mark.parametrize("kernel", FAST)
def test_leading_dims_and_non_contiguous_input(kernel):
    net = _net()
    x = torch.randn(6, 2, 48).transpose(0, 1)  # [2, 6, 48], non-contiguous
    with torch.no_grad():
        expected = net(x)
        with DecodeKernels(net, force=kernel):
            actual = net(x)
    assert actual.shape == (2, 6, 1000)
    _close(actual, expected)


def test_forward_is_swapped_only_inside_the_context_and_nesting_keeps_the_outer():
    net = _net()
    layer = net[0]
    with DecodeKernels(net, force=FAST[0]):
        assert "forward" in vars(layer)
        with DecodeKernels(net, force="stock"):
            assert "forward" in vars(layer)
        assert "forward" in vars(layer)  # inner exit leaves the outer's swap
    assert "forward" not in vars(layer)


def test_innermost_context_decides():
    net = _net()
    x = torch.randn(3, 48)
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]) as outer:
        with DecodeKernels(net, force="stock") as inner:
            net(x)
        assert inner.calls["stock"] == 2 and sum(outer.calls.values()) == 0
        net(x)
        assert outer.calls[FAST[0]] == 2


def test_rows_above_max_rows_run_stock():
    net = _net()
    with torch.no_grad(), DecodeKernels(net, force=FAST[0], max_rows=4) as ctx:
        net(torch.randn(5, 48))
        assert ctx.calls["stock"] == 2 and ctx.calls[FAST[0]] == 0
        net(torch.randn(4, 48))
        assert ctx.calls[FAST[0]] == 2


def test_autograd_calls_run_stock_and_get_gradients():
    net, reference = _net(), _net()
    net.train(), reference.train()
    x = torch.randn(3, 48)
    with DecodeKernels(net, force=FAST[0]) as ctx:
        net(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert ctx.allocated == 0 and ctx.calls[FAST[0]] == 0
    _close(net[0].weight.grad, reference[0].weight.grad)


def test_weight_changed_in_place_is_recopied():
    net = _net()
    x = torch.randn(2, 48)
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]):
        net(x)
        net[2].weight.mul_(-2.0)  # e.g. an optimizer step or load_state_dict between two generate calls
        actual = net(x)
    with torch.no_grad():
        expected = net(x)
    _close(actual, expected)


def test_copies_persist_across_contexts_and_release_frees_them():
    net = _net()
    x = torch.randn(2, 48)
    with torch.no_grad():
        with DecodeKernels(net, force=FAST[0]) as first:
            net(x)
        with DecodeKernels(net, force=FAST[0]) as second:
            net(x)
    assert first.allocated == (48 * 80 + 80 * 1000) * 4
    assert second.allocated == 0  # reused
    assert release_decode_kernels(net) == first.allocated
    assert release_decode_kernels(net) == 0


def test_memory_limit_leaves_layers_stock_with_one_warning():
    net = _net()
    x = torch.randn(2, 48)
    with torch.no_grad():
        expected = net(x)
        with pytest.warns(RuntimeWarning, match="memory_fraction"), DecodeKernels(net, force=FAST[0],
                                                                                  memory_fraction=0.0) as ctx:
            actual = net(x)
    assert ctx.allocated == 0
    assert torch.equal(actual, expected)  # stock kernel: bit-identical


class _MyLinear(nn.Linear):
    pass


def test_ineligible_modules_are_left_alone():
    half = nn.Linear(8, 8).to(torch.bfloat16)
    subclass = _MyLinear(8, 8)
    hooked = nn.Linear(8, 8)
    hooked.forward = functools.partial(nn.Linear.forward, hooked)  # e.g. an accelerate hook
    marker = hooked.forward
    with DecodeKernels(nn.ModuleList([half, subclass, hooked]), force=FAST[0]) as ctx:
        assert ctx.modules == []
        assert "forward" not in vars(half) and "forward" not in vars(subclass)
        assert hooked.forward is marker
    assert hooked.forward is marker


def test_timed_choice_is_recorded_per_shape_and_bucket():
    net = _net()
    with torch.no_grad(), DecodeKernels(net):
        net(torch.randn(1, 48))
        net(torch.randn(6, 48))
    chosen = plans()
    name = f"1000x80+bias@{torch.get_num_threads()}t"
    assert set(chosen[name]) >= {"1", "5-8"}
    assert set(chosen[name].values()) <= set(KERNELS)


def test_bad_arguments():
    net = _net()
    with pytest.raises(ValueError, match="max_rows"):
        DecodeKernels(net, max_rows=0)
    with pytest.raises(ValueError, match="force"):
        DecodeKernels(net, force="cuda")


def test_stock_choice_makes_no_copy(monkeypatch):
    monkeypatch.setattr(kl, "_choose", lambda *args: "stock")
    monkeypatch.setattr(kl, "_PLANS", {})
    net = _net()
    with torch.no_grad(), warnings.catch_warnings(), DecodeKernels(net) as ctx:
        warnings.simplefilter("error")
        net(torch.randn(3, 48))
    assert ctx.allocated == 0


def test_inference_mode_copies_are_usable_afterwards_under_no_grad():
    net = _net()
    x = torch.randn(2, 48)
    with DecodeKernels(net, force=FAST[0]):
        with torch.inference_mode():
            net(x)
        with torch.no_grad():
            actual = net(x)
    with torch.no_grad():
        _close(actual, net(x))
