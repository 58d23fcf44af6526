"""Weight-only quantized linear (``hf_kvspec/kernels/quantized.py``): the C kernel against the plain reference
``F.linear(x, dequantize(q), bias)``, the rounding bounds of quantization, refused inputs, and the compile cache."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from hf_kvspec.kernels import build, quantized
from hf_kvspec.kernels.quantized import (
    KernelBuildError,
    available,
    dequantize,
    qlinear,
    quantize_int4,
    quantize_int8,
)

needs_compiler = pytest.mark.skipif(build.find_compiler() is None and not available(),
                                    reason="no C compiler (gcc/cc) on PATH to build the quantized kernels")

# (O, I): odd row counts (the 4-row interleave pads), and for int8 in-features that are not multiples of 8
INT8_SHAPES = [(1, 8), (5, 100), (13, 3), (64, 576), (130, 1544)]
INT4_SHAPES = [(1, 128), (7, 128), (64, 640), (130, 1536)]
INT4_FORMATS = [(32, False), (64, False), (64, True), (128, False)]
FP32_EPS = torch.finfo(torch.float32).eps


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(out_features, in_features) * 0.05 + 0.01  # an offset, so groups are not centred


def _offsets_per_weight(q) -> torch.Tensor:
    """|offset| of each weight's group [O, I] (zero for int8)."""
    if q.bits == 8:
        return torch.zeros(q.shape)
    offsets = quantized._deinterleave_groups(q.offsets, q.shape[0]).float().abs()  # [O, G]
    return offsets.repeat_interleave(q.group_size, dim=1)


def _assert_matches_reference(x, q, bias):
    """Kernel vs ``F.linear(x, dequantize(q), bias)``: both sum the same I products in fp32, in different orders.

    Recursive summation of n terms errs by at most (n - 1) u sum|term| (u = eps / 2, Higham, Accuracy and
    Stability, 4.2), so two orders differ by at most 2 I u sum|term| = I eps sum|term|. int4 with one row sums
    ``q s`` and ``m`` separately (``s sum q x + m sum x``), whose magnitudes are bounded by |w| + 2|m|; the scale
    and bias add a few roundings (the + 8 and the bias term).
    """
    expected = F.linear(x, dequantize(q), bias)
    actual = qlinear(x, q, bias)
    magnitude = x.abs() @ (dequantize(q).abs() + 2 * _offsets_per_weight(q)).T  # [R, O]
    bound = (q.shape[1] + 8) * FP32_EPS * magnitude + FP32_EPS * (0 if bias is None else bias.abs())
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    excess = (actual - expected).abs() - bound
    assert excess.max() <= 0, f"{q.format} {q.shape} R={x.shape[0]}: worst excess over the bound {excess.max()}"


@needs_compiler
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=str)
def test_int8_kernel_matches_reference(shape):
    q = quantize_int8(_weight(*shape))
    bias = torch.randn(shape[0])
    for rows in range(1, 18):
        x = torch.randn(rows, shape[1])
        _assert_matches_reference(x, q, None)
        _assert_matches_reference(x, q, bias)


@needs_compiler
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
@pytest.mark.parametrize(("group_size", "symmetric"), INT4_FORMATS)
def test_int4_kernel_matches_reference(shape, group_size, symmetric):
    q = quantize_int4(_weight(*shape), group_size, symmetric)
    bias = torch.randn(shape[0])
    for rows in range(1, 18):
        x = torch.randn(rows, shape[1])
        _assert_matches_reference(x, q, None)
        _assert_matches_reference(x, q, bias)


@needs_compiler
def test_zero_rows_and_zero_weights():
    q = quantize_int8(torch.zeros(6, 16))
    assert torch.equal(qlinear(torch.randn(3, 16), q), torch.zeros(3, 6))
    assert qlinear(torch.randn(0, 16), q).shape == (0, 6)
    q4 = quantize_int4(torch.zeros(6, 32), 32)
    assert torch.equal(qlinear(torch.randn(2, 32), q4), torch.zeros(2, 6))


# --- quantize / dequantize ---------------------------------------------------------------------------------------

# dequantize computes q * s (+ m) in fp32 and quantize divides by s: each adds at most one rounding of |w|
ROUNDING_SLACK = 4 * FP32_EPS


@pytest.mark.parametrize("shape", INT8_SHAPES, ids=str)
def test_int8_error_is_at_most_half_a_step(shape):
    weight = _weight(*shape)
    q = quantize_int8(weight)
    scales = q.scales[: shape[0], None]
    error = (weight - dequantize(q)).abs()
    assert (error <= scales / 2 + ROUNDING_SLACK * weight.abs()).all()


def test_nbytes_counts_codes_and_scales():
    weight = _weight(64, 576)
    assert quantize_int8(weight).nbytes == 64 * 576 + 64 * 4
    assert quantize_int4(weight, 64).nbytes == 64 * 576 // 2 + 2 * (64 * 576 // 64) * 2


@pytest.mark.parametrize(("group_size", "symmetric"), INT4_FORMATS)
def test_int4_error_is_at_most_half_a_step(group_size, symmetric):
    weight = _weight(96, 1536)
    q = quantize_int4(weight, group_size, symmetric)
    scales = quantized._deinterleave_groups(q.scales, 96).float().repeat_interleave(group_size, dim=1)
    error = (weight - dequantize(q)).abs()
    assert (error <= scales / 2 * (1 + ROUNDING_SLACK) + ROUNDING_SLACK * weight.abs()).all()


def test_int4_packing_round_trips_every_code():
    codes = torch.randint(0, 16, (9, 128), dtype=torch.uint8)
    assert torch.equal(quantized._unpack_int4(quantized._pack_int4(codes), (9, 128)), codes)


def test_constant_groups_dequantize_exactly():
    weight = torch.full((4, 64), 0.25)
    assert torch.equal(dequantize(quantize_int4(weight, 32)), weight)
    assert torch.equal(dequantize(quantize_int8(weight)), weight)


# --- refused inputs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("weight", "match"), [
    (torch.randn(8), "2-D floating"),
    (torch.ones(4, 8, dtype=torch.int32), "2-D floating"),
    (torch.tensor([[1.0, float("nan")]]), "inf or nan"),
])
def test_bad_weights_are_refused(weight, match):
    with pytest.raises(ValueError, match=match):
        quantize_int8(weight)


@pytest.mark.parametrize(("in_features", "group_size"), [(100, 32), (96, 64), (128, 48), (64, 0)])
def test_int4_refuses_groups_that_do_not_tile_the_row(in_features, group_size):
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.randn(4, in_features), group_size)


def test_int4_refuses_weights_beyond_fp16_scales():
    with pytest.raises(ValueError, match="quantize_int8"):
        quantize_int4(torch.full((1, 32), 1e5), 32)


@needs_compiler
@pytest.mark.parametrize(("x", "bias", "match"), [
    (torch.randn(2, 32, dtype=torch.float64), None, r"\.float\(\)"),
    (torch.randn(1, 2, 32), None, "reshape"),
    (torch.randn(2, 31), None, "31 features"),
    (torch.randn(32, 2).T, None, "contiguous"),
    (torch.randn(2, 32), torch.randn(5), r"bias must be .*\[6\]"),
    (torch.randn(2, 32), torch.randn(6, dtype=torch.float64), "bias must be"),
])
def test_bad_calls_are_refused(x, bias, match):
    q = quantize_int8(torch.randn(6, 32))
    with pytest.raises(ValueError, match=match):
        qlinear(x, q, bias)


def test_tampered_packed_weights_are_refused():
    # the kernel reads raw pointers: a QuantizedWeight whose tensors do not fit its shape must never reach it
    q = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="do not match"):
        dataclasses.replace(q, shape=(8, 128))
    with pytest.raises(ValueError, match="do not match"):
        dataclasses.replace(q, codes=q.codes[:1])
    with pytest.raises(ValueError, match="do not match"):
        dataclasses.replace(quantize_int8(torch.randn(8, 64)), scales=torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not match"):
        dataclasses.replace(q, bits=3)


@needs_compiler
def test_calls_that_need_a_backward_are_refused():
    q = quantize_int8(torch.randn(6, 32))
    x, bias = torch.randn(2, 32, requires_grad=True), torch.nn.Parameter(torch.randn(6))
    with pytest.raises(ValueError, match="no backward"):
        qlinear(x, q)
    with pytest.raises(ValueError, match="no backward"):
        qlinear(x.detach(), q, bias)
    with torch.no_grad():  # an nn.Linear's bias Parameter is fine where no graph is built
        torch.testing.assert_close(qlinear(x, q, bias), F.linear(x, dequantize(q), bias), rtol=1e-5, atol=1e-5)


# --- the compile cache ------------------------------------------------------------------------------------------

@needs_compiler
def test_built_once_then_loaded_and_a_corrupt_file_is_rebuilt(tmp_path, capfd):
    plan = build.plan_build("qgemv", tmp_path, flags=build.BASE_FLAGS)  # the portable build: quicker to compile
    build.load_library(plan)
    assert "compiling" in capfd.readouterr().err
    stamp = plan.output.stat().st_mtime_ns
    # a later call: same key, the file is only loaded
    build.load_library(build.plan_build("qgemv", tmp_path, flags=build.BASE_FLAGS))
    assert "compiling" not in capfd.readouterr().err and plan.output.stat().st_mtime_ns == stamp
    # a truncated file (mapping it would raise SIGBUS) and one of garbage: both caught by the checksum, rebuilt.
    # Replaced, never written in place: this process has the path mapped
    for corrupt in (plan.output.read_bytes()[:4096], b"not a shared library"):
        (tmp_path / "corrupt.so").write_bytes(corrupt)
        (tmp_path / "corrupt.so").replace(plan.output)
        library = build.load_library(plan)
        assert "compiling" in capfd.readouterr().err and library.qk_abi_version() == build.ABI_VERSION
        assert build._intact(plan.output)
    names = sorted(p.name for p in plan.output.parent.iterdir())
    assert names == [plan.output.name, plan.output.name + ".sha256"]  # no temporary files left


def test_the_key_follows_the_source_and_flags(tmp_path):
    if build.find_compiler() is None:
        pytest.skip("no C compiler")
    vector = build.plan_build("qgemv", tmp_path, flags=build.BASE_FLAGS + build.VECTOR_FLAGS)
    scalar = build.plan_build("qgemv", tmp_path, flags=build.BASE_FLAGS)
    assert vector.output != scalar.output and vector.output.parent == tmp_path / "kernels"


def test_no_compiler_is_a_named_error_and_not_available(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with pytest.raises(KernelBuildError, match="apt-get install gcc"):
        build.plan_build("qgemv", tmp_path)
    monkeypatch.setattr(quantized, "_kernels", _raises_build_error)
    assert available() is False


@functools.cache
def _raises_build_error():
    raise KernelBuildError("no compiler")


@needs_compiler
def test_portable_build_matches_the_vector_build(tmp_path):
    # the scalar C path is what CPUs without AVX2/FMA/F16C run; it must compute the same products
    scalar = quantized._declare(build.load_library(build.plan_build("qgemv", tmp_path, flags=build.BASE_FLAGS)))
    for q in (quantize_int8(_weight(13, 100)), quantize_int4(_weight(13, 128), 64)):
        x, bias = torch.randn(5, q.shape[1]), torch.randn(q.shape[0])
        expected = F.linear(x, dequantize(q), bias)
        bound = (q.shape[1] + 8) * FP32_EPS * (x.abs() @ (dequantize(q).abs() + 2 * _offsets_per_weight(q)).T)
        assert ((quantized._launch(scalar, x, q, bias) - expected).abs() <= bound + FP32_EPS * bias.abs()).all()
