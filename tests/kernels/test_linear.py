"""Decode kernels (``hf_kvspec/kernels/linear.py``) against ``F.linear``, the reference path."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_kvspec.kernels import copies, trials
from hf_kvspec.kernels.linear import KERNELS, DecodeKernels, onednn_available, plans, release_decode_kernels

FAST = [k for k in KERNELS if k != "stock" and (k != "onednn" or onednn_available())]


def _net(bias: bool = True, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 320, bias=bias), nn.ReLU(), nn.Linear(320, 1000, bias=bias)).eval()


def _plan(model, shape: str) -> dict:
    return plans()[trials.group_label(model)][f"{shape}@{torch.get_num_threads()}t"]


def _key(module, model) -> tuple:
    return trials.shape_key(module, trials.group_label(model))


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
    x = torch.randn(rows, 256)
    with torch.no_grad():
        expected = net(x)
        with DecodeKernels(net, force=kernel) as ctx:
            actual = net(x)
        assert ctx.calls[kernel] == 2 and ctx.calls["stock"] == 0  # both layers ran the kernel
    _close(actual, expected)


@pytest.mark.parametrize("kernel", FAST)
def test_leading_dims_and_non_contiguous_input(kernel):
    net = _net()
    x = torch.randn(6, 2, 256).transpose(0, 1)  # [2, 6, 48], non-contiguous
    with torch.no_grad():
        expected = net(x)
        with DecodeKernels(net, force=kernel):
            actual = net(x)
    assert actual.shape == (2, 6, 1000)
    _close(actual, expected)


def _module_state(net: nn.Module) -> list:
    """Everything of the user's modules a context could touch: instance dicts, hooks, parameters by identity."""
    return [(dict(vars(m)), list(m._forward_hooks), list(m._forward_pre_hooks),
             [id(p) for p in m.parameters(recurse=False)]) for m in net.modules()]


def test_modules_are_untouched_and_calls_are_routed_only_inside_the_context():
    net = _net()
    x = torch.randn(3, 256)
    before, state = _module_state(net), copy.deepcopy(net.state_dict())
    with torch.no_grad():
        with DecodeKernels(net, force=FAST[0]) as ctx:
            assert _module_state(net) == before  # no forward replaced, no hook added
            net(x)
            with DecodeKernels(net, force="stock"):
                net(x)
            net(x)  # the inner exit leaves the outer routing
        net(x)
    assert ctx.calls[FAST[0]] == 4 and ctx.calls["stock"] == 0
    assert _module_state(net) == before and "forward" not in vars(net[0])
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


def test_modules_are_untouched_after_an_exception_mid_call():
    net = _net()
    before = _module_state(net)
    with pytest.raises(RuntimeError, match="shapes"), torch.no_grad(), DecodeKernels(net, force=FAST[0]):
        net(torch.randn(2, 7))  # wrong in-features: stock raises inside the context
    assert _module_state(net) == before
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]) as ctx:
        net(torch.randn(2, 256))
    assert ctx.calls[FAST[0]] == 2  # the next context routes normally


def test_other_threads_are_not_routed():
    import threading

    net = _net()
    seen = []
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]) as ctx:
        worker = threading.Thread(target=lambda: seen.append(net(torch.randn(2, 256))))
        worker.start()
        worker.join()
    assert len(seen) == 1 and sum(ctx.calls.values()) == 0


def test_innermost_context_decides():
    net = _net()
    x = torch.randn(3, 256)
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]) as outer:
        with DecodeKernels(net, force="stock") as inner:
            net(x)
        assert inner.calls["stock"] == 2 and sum(outer.calls.values()) == 0
        net(x)
        assert outer.calls[FAST[0]] == 2


def test_rows_above_max_rows_run_stock():
    net = _net()
    with torch.no_grad(), DecodeKernels(net, force=FAST[0], max_rows=4) as ctx:
        net(torch.randn(5, 256))
        assert ctx.calls["stock"] == 2 and ctx.calls[FAST[0]] == 0
        net(torch.randn(4, 256))
        assert ctx.calls[FAST[0]] == 2


def test_autograd_calls_run_stock_and_get_gradients():
    net, reference = _net(), _net()
    net.train(), reference.train()
    x = torch.randn(3, 256)
    with DecodeKernels(net, force=FAST[0]) as ctx:
        net(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert ctx.allocated == 0 and ctx.calls[FAST[0]] == 0
    _close(net[0].weight.grad, reference[0].weight.grad)


def test_weight_changed_in_place_is_recopied():
    net = _net()
    x = torch.randn(2, 256)
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]):
        net(x)
        net[2].weight.mul_(-2.0)  # e.g. an optimizer step or load_state_dict between two generate calls
        actual = net(x)
    with torch.no_grad():
        expected = net(x)
    _close(actual, expected)


def test_copies_persist_across_contexts_and_release_frees_them():
    net = _net()
    x = torch.randn(2, 256)
    with torch.no_grad():
        with DecodeKernels(net, force=FAST[0]) as first:
            net(x)
        with DecodeKernels(net, force=FAST[0]) as second:
            net(x)
    assert first.allocated == (256 * 320 + 320 * 1000) * 4
    assert second.allocated == 0  # reused
    assert release_decode_kernels(net) == first.allocated
    assert release_decode_kernels(net) == 0


def test_memory_limit_leaves_layers_stock_with_one_warning():
    net = _net()
    x = torch.randn(2, 256)
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
    half = nn.Linear(256, 256).to(torch.bfloat16)
    subclass = _MyLinear(256, 256)
    hooked = nn.Linear(256, 256)
    hooked.forward = functools.partial(nn.Linear.forward, hooked)  # e.g. an accelerate hook
    marker = hooked.forward
    with DecodeKernels(nn.ModuleList([half, subclass, hooked]), force=FAST[0]) as ctx:
        assert ctx.modules == []
        assert "forward" not in vars(half) and "forward" not in vars(subclass)
        assert hooked.forward is marker
    assert hooked.forward is marker


class _FakeClock:
    """Each timed sweep of kernel k takes ``cost[k]`` seconds (the runner advances the clock per layer)."""

    def __init__(self, cost: dict[str, float]):
        self.now, self.cost = 0.0, cost

    def __call__(self) -> float:
        return self.now

    def runner(self, kernel, x, module):
        self.now += self.cost[kernel]
        return F.linear(x, module.weight, module.bias)


def test_the_first_call_of_a_bucket_calibrates_it_then_the_choice_is_fixed(monkeypatch):
    monkeypatch.setattr(trials, "PLANS", {})
    net = _net()
    x = torch.randn(6, 256)
    with torch.no_grad():
        expected = net(x)
        with DecodeKernels(net) as ctx:
            _close(net(x), expected)
            assert set(_plan(net, "1000x320+bias")) == {"5-8"}  # decided by the first call
            _close(net(x), expected)
    chosen = _plan(net, "1000x320+bias")["5-8"]
    assert chosen in KERNELS and ctx.calibration_s > 0 and sum(ctx.calls.values()) == 4
    with torch.no_grad(), DecodeKernels(net) as again:
        net(x)
    assert again.calls[chosen] >= 1 and sum(again.calls.values()) == 2 and again.calibration_s == 0  # no re-timing


@pytest.mark.parametrize(("fast_time", "expected"), [(0.5, "onednn"), (0.98, "stock"), (2.0, "stock")])
def test_calibration_picks_the_fastest_only_with_a_margin_over_stock(monkeypatch, fast_time, expected):
    monkeypatch.setattr(trials, "PLANS", {})
    layers = [nn.Linear(32, 48) for _ in range(3)]
    clock = _FakeClock({"stock": 1.0, "onednn": fast_time, "transposed": 5.0})
    chosen = trials.calibrate(("g", 48, 32, True, 1), 1, layers, ("stock", "transposed", "onednn"),
                              copy_for=lambda module, kernel: True, run=clock.runner, clock=clock)
    assert chosen == expected == trials.chosen(("g", 48, 32, True, 1), 1)
    # the fastest of the timed sweeps, three layers a sweep
    assert trials.SECONDS[("g", 48, 32, True, 1)][1]["stock"] == pytest.approx(3 * 1.0)


def test_calibration_times_every_layer_of_the_shape_at_the_buckets_largest_row_count():
    layers = [nn.Linear(32, 48) for _ in range(4)]
    seen = []
    trials.calibrate(("h", 48, 32, True, 1), 2, layers, ("stock", "transposed"), copy_for=lambda m, k: True,
                     run=lambda kernel, x, module: seen.append((kernel, x.shape[0], id(module))))
    for kernel in ("stock", "transposed"):
        calls = [s for s in seen if s[0] == kernel]
        assert {s[1] for s in calls} == {trials.BUCKETS[2][1]}
        assert len(calls) == (trials.ROUNDS + 1) * len(layers)  # warm-up + timed sweeps over every layer
        assert {s[2] for s in calls} == {id(m) for m in layers}


def test_a_kernel_without_memory_for_its_copies_is_not_a_candidate():
    layers = [nn.Linear(32, 48) for _ in range(2)]
    clock = _FakeClock({"stock": 1.0, "onednn": 0.1, "transposed": 0.5})
    chosen = trials.calibrate(("i", 48, 32, True, 1), 1, layers, KERNELS,
                              copy_for=lambda module, kernel: kernel != "onednn", run=clock.runner, clock=clock)
    assert chosen == "transposed"


@pytest.mark.skipif(not onednn_available(), reason="needs two non-stock kernels")
def test_copies_no_bucket_chose_are_dropped(monkeypatch):
    monkeypatch.setattr(trials, "PLANS", {})
    monkeypatch.setattr(trials, "pick", lambda seconds: "transposed")
    net = _net()
    layer = net[2]
    with torch.no_grad(), DecodeKernels(net):
        net[2](torch.randn(3, 320))  # calibration made copies for every candidate, then kept the chosen one
    assert _plan(net, "1000x320+bias") == {"2-4": "transposed"}
    assert copies.kernels_held(layer) == {"transposed"}


def test_bad_arguments():
    net = _net()
    with pytest.raises(ValueError, match="max_rows"):
        DecodeKernels(net, max_rows=0)
    with pytest.raises(ValueError, match="force"):
        DecodeKernels(net, force="cuda")


def test_stock_choice_makes_no_copy(monkeypatch):
    net = _net()
    key = _key(net[2], net[2])
    monkeypatch.setattr(trials, "PLANS", {key: {1: "stock"}})
    with torch.no_grad(), DecodeKernels(net[2]) as ctx:
        net[2](torch.randn(3, 320))
    assert ctx.allocated == 0 and ctx.calls["stock"] == 1


def test_a_calibration_that_picks_stock_drops_the_copies(monkeypatch):
    monkeypatch.setattr(trials, "PLANS", {})
    monkeypatch.setattr(trials, "pick", lambda seconds: "stock")
    net = _net()
    layer, x = net[2], torch.randn(3, 320)
    with torch.no_grad(), DecodeKernels(layer, force=FAST[0]):
        layer(x)
    assert copies.kernels_held(layer) == {FAST[0]}
    with torch.no_grad(), DecodeKernels(layer) as ctx:
        layer(x)
    assert trials.chosen(_key(layer, layer), 1) == "stock" and ctx.calls["stock"] == 1
    assert copies.kernels_held(layer) == set()


def test_a_write_through_data_is_seen_when_the_next_context_opens():
    net = _net()
    x = torch.randn(2, 256)
    with torch.no_grad():
        with DecodeKernels(net, force=FAST[0]):
            net(x)
        version = net[2].weight._version
        net[2].weight.data.mul_(-2.0)  # e.g. peft's merge_adapter: no version bump on the parameter
        assert net[2].weight._version == version
        with DecodeKernels(net, force=FAST[0]):
            actual = net(x)
        expected = net(x)
    _close(actual, expected)


def test_inference_tensor_weights():
    with torch.inference_mode():
        net = _net()
        x = torch.randn(2, 256)
        expected = net(x)
        with DecodeKernels(net, force=FAST[0]) as ctx:
            actual = net(x)
    assert net[0].weight.is_inference() and ctx.calls[FAST[0]] == 2
    _close(actual, expected)
    assert not any(copy.is_inference() for copy in copies._STORE[net[0]].tensors.values())


def test_overlapping_contexts_close_out_of_order():
    net = _net()
    x = torch.randn(2, 256)
    first, second = DecodeKernels(net, force=FAST[0]), DecodeKernels(net, force="stock")
    with torch.no_grad():
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        net(x)
        assert second.calls["stock"] == 2 and sum(first.calls.values()) == 0
        second.__exit__(None, None, None)
        net(x)
    assert second.calls["stock"] == 2  # closed: no context routes any more


def test_reentering_one_instance():
    net = _net()
    kernels = DecodeKernels(net, force=FAST[0])
    with torch.no_grad(), kernels:
        with kernels:
            pass
        net(torch.randn(2, 256))  # still open after the inner exit
    assert kernels.calls[FAST[0]] == 2


def test_autocast_runs_stock():
    net = _net()
    x = torch.randn(2, 256)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = net(x)
        with DecodeKernels(net, force=FAST[0]) as ctx:
            actual = net(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert ctx.calls[FAST[0]] == 0 and torch.equal(actual, expected)


def test_a_deep_copy_made_inside_a_context_runs_stock_afterwards():
    net = _net()
    x = torch.randn(2, 256)
    with torch.no_grad():
        with DecodeKernels(net, force=FAST[0]):
            clone = copy.deepcopy(net)
        assert torch.equal(clone(x), net(x))


def test_no_memory_for_copies_calibrates_to_stock(monkeypatch):
    monkeypatch.setattr(trials, "PLANS", {})
    monkeypatch.setattr(copies, "available_bytes", lambda: 0)
    monkeypatch.setattr(copies, "held_bytes", lambda: 0)  # copies other tests left behind: no room either
    net = _net()
    x = torch.randn(3, 256)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="memory_fraction"), DecodeKernels(net) as ctx:
        net(x)
    assert set(_plan(net, "1000x320+bias").values()) == {"stock"}
    assert ctx.allocated == 0


def test_copies_of_a_layer_that_became_ineligible_are_freed():
    net = _net()
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]):
        net(torch.randn(2, 256))
    net.to(torch.bfloat16)
    with DecodeKernels(net):
        pass
    assert copies.kernels_held(net[0]) == set()


def test_snapshot_positions_stay_in_bounds_for_weights_past_float32_precision():
    weight = torch.zeros(1, 2**24 + 3)  # positions from a float linspace would round past the end here
    weight[0, -1] = 7.0
    snapshot = copies._snapshot(weight)
    assert snapshot.shape == (16,) and snapshot[-1] == 7.0


def test_one_calibration_serves_every_layer_of_the_shape(monkeypatch):
    monkeypatch.setattr(trials, "PLANS", {})
    calls = []
    real = trials.calibrate
    monkeypatch.setattr(trials, "calibrate", lambda *args, **kw: calls.append(len(args[2])) or real(*args, **kw))
    torch.manual_seed(0)
    deep = nn.Sequential(*[nn.Linear(256, 256) for _ in range(10)]).eval()
    x = torch.randn(3, 256)
    with torch.no_grad():
        expected = deep(x)
        with DecodeKernels(deep) as ctx:
            _close(deep(x), expected)
            _close(deep(x), expected)
    assert calls == [10] and sum(ctx.calls.values()) == 20  # one sweep over all ten layers, then plain calls


def test_small_layers_stay_stock_unless_asked():
    small = nn.Linear(64, 128)  # 8k weights: the swap's own cost would exceed any saving
    with DecodeKernels(small, force=FAST[0]) as default:
        assert default.modules == [] and "forward" not in vars(small)
    with DecodeKernels(small, force=FAST[0], min_weight_elements=0) as forced:
        assert forced.modules == [small]


def test_settled_calls_take_the_fast_path_and_notice_weight_changes():
    net = _net()
    x = torch.randn(2, 256)
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]) as ctx:
        net(x)
        assert (id(net[2]), 2) in ctx.resolved
        net[2].weight.mul_(0.5)  # in place: the version changes, the fast path must not serve the old copy
        actual = net(x)
    with torch.no_grad():
        _close(actual, net(x))


def test_each_model_is_calibrated_apart(monkeypatch):
    """A draft whose weights stay in cache must not decide for its target's cold layers of the same shape."""
    monkeypatch.setattr(trials, "PLANS", {})
    target, draft = _net(seed=0), _net(seed=1)
    with torch.no_grad(), DecodeKernels(target, draft):
        target(torch.randn(3, 256))
        draft(torch.randn(3, 256))
    assert set(plans()) == {trials.group_label(target), trials.group_label(draft)}


def test_a_parameter_replaced_inside_a_context_is_not_served_a_stale_copy():
    torch.manual_seed(0)
    layer = nn.Linear(512, 512, bias=False)
    x = torch.randn(2, 512)
    with torch.no_grad(), DecodeKernels(layer, force=FAST[0]):
        layer(x)
        layer.weight = nn.Parameter(layer.weight.t())  # same memory, shape and version: only the tensor differs
        _close(layer(x), F.linear(x, layer.weight))
        for scale in (2.0, 3.0, 4.0):  # .data replaced again and again (module.to(), safe adapter merges)
            layer.weight.data = layer.weight.data * scale
            _close(layer(x), F.linear(x, layer.weight))


def test_a_deleted_models_plans_are_forgotten(monkeypatch):
    import gc

    monkeypatch.setattr(trials, "PLANS", {})
    net = _net()
    label = trials.group_label(net)
    with torch.no_grad(), DecodeKernels(net):
        net(torch.randn(3, 256))
    assert label in plans()
    del net
    gc.collect()
    assert label not in plans()
    assert trials.group_label(_net()) != label  # a new model, even at a reused address, starts afresh


def test_a_dtype_change_inside_a_context_runs_stock():
    net = _net()
    with torch.no_grad(), DecodeKernels(net, force=FAST[-1]) as ctx:
        net(torch.randn(2, 256))
        net.double()
        out = net(torch.randn(2, 256, dtype=torch.float64))
    assert out.dtype == torch.float64 and ctx.calls[FAST[-1]] == 2


def test_a_forward_replaced_by_the_user_inside_the_context_survives_its_exit():
    net = _net()
    with DecodeKernels(net, force=FAST[0]):
        hooked = functools.partial(nn.Linear.forward, net[0])
        net[0].forward = hooked
    assert net[0].forward is hooked


def test_report_gives_bytes_and_plans():
    net = _net()
    release_decode_kernels(net)
    with torch.no_grad(), DecodeKernels(net, force=FAST[0]) as ctx:
        net(torch.randn(2, 256))
    report = ctx.report()
    assert report["bytes_allocated"] == 4 * (256 * 320 + 320 * 1000)  # one fp32 copy per layer
    assert report["bytes_held"] >= report["bytes_allocated"] and report["calls"][FAST[0]] == 2


def test_route_on_enter_false_routes_only_inside_routing_blocks():
    net = _net()
    x = torch.randn(3, 256)
    kernels = DecodeKernels(net, force=FAST[0], route_on_enter=False)
    with pytest.raises(RuntimeError, match="context open"), kernels.routing():
        pass
    with torch.no_grad(), kernels:
        net(x)
        assert sum(kernels.calls.values()) == 0
        with kernels.routing():
            net(x)
        net(x)
    assert kernels.calls[FAST[0]] == 2 and sum(kernels.calls.values()) == 2


def test_a_plan_file_spares_the_next_process_the_calibration(monkeypatch, tmp_path):
    plans_file = tmp_path / "plans.json"
    monkeypatch.setattr(trials, "PLANS", {})
    net = _net()
    x = torch.randn(3, 256)
    with torch.no_grad(), DecodeKernels(net, plans_file=plans_file) as first:
        net(x)
    chosen = _plan(net, "1000x320+bias")["2-4"]
    assert first.calibration_s > 0 and chosen in trials.load_plans(plans_file).values()
    monkeypatch.setattr(trials, "PLANS", {})  # as in a new process
    monkeypatch.setattr(trials, "calibrate", lambda *a, **k: pytest.fail("calibrated although the file knew"))
    with torch.no_grad(), DecodeKernels(net, plans_file=plans_file) as second:
        _close(net(x), F.linear(F.relu(F.linear(x, net[0].weight, net[0].bias)), net[2].weight, net[2].bias))
    assert second.calibration_s == 0 and _plan(net, "1000x320+bias")["2-4"] == chosen


BAD_PLAN_FILES = {  # issue 40 item 5: each used to crash (AttributeError) or be ignored without a word
    "not json": "{not json",
    "plans a string": '{"plans": "x"}',
    "plans a list": '{"plans": ["stock"]}',
    "a list": "[1, 2]",
    "unknown kernel": '{"plans": {"k": "warp-drive"}}',
    "not utf-8": b"\xff\xfe{",
}


@pytest.mark.parametrize("content", BAD_PLAN_FILES.values(), ids=BAD_PLAN_FILES.keys())
def test_an_ill_typed_plan_file_warns_once_naming_it_and_recalibrates(monkeypatch, tmp_path, content):
    monkeypatch.setattr(trials, "PLANS", {})
    monkeypatch.setattr(trials, "_WARNED", set())
    plans_file = tmp_path / "plans.json"
    plans_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    net = _net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), DecodeKernels(net, plans_file=plans_file) as ctx:
            net(torch.randn(3, 256))
    mine = [w for w in caught if "kernel plan file" in str(w.message)]
    assert len(mine) == 1 and str(plans_file) in str(mine[0].message)
    assert ctx.calibration_s > 0
    assert trials.load_plans(plans_file)  # rewritten whole with the new choices


def test_a_plan_directory_is_an_unreadable_plan_file(monkeypatch, tmp_path):
    monkeypatch.setattr(trials, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match=f"kernel plan file {tmp_path}.*IsADirectoryError"):
        assert trials.load_plans(tmp_path) == {}


def test_an_unwritable_plan_file_warns_once_and_keeps_plans_in_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(trials, "PLANS", {})
    monkeypatch.setattr(trials, "_WARNED", set())
    blocked = tmp_path / "file"
    blocked.write_text("")
    net = _net()
    plans_file = blocked / "plans.json"  # a file where a folder should be: as unwritable as a read-only folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seconds = []
        for rows in (3, 12):  # the second context calibrates another bucket: a new plan to store, a second failure
            with torch.no_grad(), DecodeKernels(net, plans_file=plans_file) as ctx:
                net(torch.randn(3, 256))
                net(torch.randn(rows, 256))
            seconds.append(ctx.calibration_s)
    assert len([w for w in caught if "could not store" in str(w.message)]) == 1
    assert seconds[0] > 0 and _plan(net, "1000x320+bias")["2-4"] and _plan(net, "1000x320+bias")["9-16"]


def test_calibrate_settles_every_bucket_up_front(monkeypatch):
    monkeypatch.setattr(trials, "PLANS", {})
    net = _net()
    kernels = DecodeKernels(net)
    with pytest.raises(RuntimeError, match="context open"):
        kernels.calibrate()
    with torch.no_grad(), kernels:
        assert kernels.calibrate(max_rows=16) > 0
        assert set(_plan(net, "1000x320+bias")) == {"1", "2-4", "5-8", "9-16"}
        assert kernels.calibrate(max_rows=16) == 0  # nothing left to time


class _CollectedMidLoop(dict):
    """A plan table whose iteration runs a model's finalizer after the first entry, as a collection can."""

    def items(self):
        for index, item in enumerate(super().items()):
            if index == 0:
                trials._forget("A#0")
            yield item


def test_plans_survive_a_model_collected_while_they_are_listed(monkeypatch):
    table = _CollectedMidLoop({("A#0", 8, 4, False, 1): {0: "stock"}, ("B#1", 8, 4, False, 1): {1: "onednn"}})
    monkeypatch.setattr(trials, "PLANS", table)
    monkeypatch.setattr(trials, "SECONDS", {("A#0", 8, 4, False, 1): {0: {"stock": 1.0}}})
    listed = trials.plans()  # no "dictionary changed size during iteration"
    assert listed["B#1"] == {"8x4@1t": {"2-4": "onednn"}}
    trials._forget("A#0")
    assert ("A#0", 8, 4, False, 1) not in trials.PLANS and not trials.SECONDS
