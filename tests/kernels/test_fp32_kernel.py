"""The fp32 few-row GEMM (``hf_kvspec/kernels/fp32.py`` over ``fgemm.c``): the C kernel against the plain reference
``F.linear(x, unpack(w), bias)`` for odd shapes and every row count the kernel tiles differently, exact results
where no rounding happens, the packing's round trip, refused inputs, and the portable build."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from hf_kvspec.kernels import build, fp32
from hf_kvspec.kernels.fp32 import (
    KernelBuildError,
    available,
    fp32_linear,
    pack_fp32,
    reference_linear,
    unpack,
)

needs_compiler = pytest.mark.skipif(build.find_compiler() is None and not available(),
                                    reason="no C compiler (gcc/cc) on PATH to build the fp32 kernel")

# (O, I): outputs that fill no panel, one, several and a ragged last one (the masked stores); inputs below, at and
# above the kernel's slice of 256 (rows > 6 run in slices), odd ones; the bundled model's qkv and down shapes
SHAPES = [(1, 1), (5, 3), (16, 8), (17, 100), (40, 257), (130, 513), (960, 576), (576, 1536)]
# every tile height 1..6, every split into 2 and 3 tiles, and prefill sizes (many tiles)
ROWS = [*range(1, 18), 33, 100]
FP32_EPS = torch.finfo(torch.float32).eps


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * 0.05 + 0.01


def _assert_matches_reference(x, weight, bias):
    """Kernel vs ``F.linear(x, unpack(w), bias)``: both sum the same I products and the bias in fp32, in different
    orders. Recursive summation of n terms errs by at most (n - 1) u sum|term| (u = eps / 2; Higham, Accuracy and
    Stability, 4.2; blocked orders and FMAs only lower it), so two orders of the I + 1 terms differ by at most
    I eps sum|term|; (I + 2) leaves one rounding of slack."""
    expected = reference_linear(x, weight, bias)
    actual = fp32_linear(x, weight, bias)
    magnitude = x.abs() @ unpack(weight).abs().T + (0 if bias is None else bias.abs())  # [R, O]
    bound = (weight.shape[1] + 2) * FP32_EPS * magnitude
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    excess = (actual - expected).abs() - bound
    assert excess.max() <= 0, f"{weight.shape} R={x.shape[0]}: worst excess over the bound {excess.max()}"


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(shape):
    weight = pack_fp32(_weight(*shape))
    bias = torch.randn(shape[0])
    generator = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=generator)
        _assert_matches_reference(x, weight, None)
        _assert_matches_reference(x, weight, bias)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 65])
def test_exact_where_nothing_rounds(rows):
    # small integers: every product and partial sum is an integer below 2**24, so any summation order is exact
    generator = torch.Generator().manual_seed(2)
    weight = torch.randint(-8, 9, (37, 300), generator=generator).float()
    x = torch.randint(-8, 9, (rows, 300), generator=generator).float()
    bias = torch.randint(-100, 100, (37,), generator=generator).float()
    packed = pack_fp32(weight)
    assert torch.equal(fp32_linear(x, packed), F.linear(x, weight))
    assert torch.equal(fp32_linear(x, packed, bias), F.linear(x, weight, bias))


@needs_compiler
def test_empty_rows_inputs_and_outputs():
    weight = pack_fp32(_weight(6, 16))
    assert fp32_linear(torch.randn(0, 16), weight).shape == (0, 6)
    bias = torch.randn(5)
    no_inputs = pack_fp32(torch.zeros(5, 0))
    assert torch.equal(fp32_linear(torch.randn(3, 0), no_inputs, bias), bias.expand(3, 5))
    assert torch.equal(fp32_linear(torch.randn(3, 0), no_inputs), torch.zeros(3, 5))
    assert fp32_linear(torch.randn(2, 16), pack_fp32(torch.zeros(0, 16))).shape == (2, 0)


@needs_compiler
def test_output_is_fresh_and_inputs_untouched():
    weight, x, bias = _weight(33, 40), torch.randn(4, 40), torch.randn(33)
    packed = pack_fp32(weight)
    before = (packed.panels.clone(), x.clone(), bias.clone())
    out = fp32_linear(x, packed, bias)
    assert out.is_contiguous() and not out.requires_grad
    assert all(torch.equal(a, b) for a, b in zip(before, (packed.panels, x, bias)))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_two_threads_give_the_one_thread_result(rows):
    # the panels are split among threads; each output is still one thread's sum in the same order: bitwise equal
    assert fp32._kernels().fk_openmp() == 1
    weight, bias = pack_fp32(_weight(1000, 300)), torch.randn(1000)
    x = torch.randn(rows, 300)
    one = fp32_linear(x, weight, bias, threads=1)
    assert torch.equal(fp32_linear(x, weight, bias, threads=2), one)
    _assert_matches_reference(x, weight, bias)


# --- packing ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unpack_inverts_pack(shape):
    weight = _weight(*shape)
    packed = pack_fp32(weight)
    assert torch.equal(unpack(packed), weight)
    panels = -(-shape[0] // fp32.PANEL)
    assert packed.panels.shape == (panels, shape[1], fp32.PANEL) and packed.panels.is_contiguous()
    assert packed.nbytes == panels * fp32.PANEL * shape[1] * 4


def test_padding_rows_are_zero_and_layout_is_panel_major():
    weight = _weight(20, 3)
    panels = pack_fp32(weight).panels  # [2, 3, 16]
    assert torch.equal(panels[1, :, 4:], torch.zeros(3, 12))
    assert panels[1, 2, 3] == weight[19, 2] and panels[0, 1, 5] == weight[5, 1]


def test_pack_takes_other_float_dtypes_and_copies():
    weight = _weight(8, 8).double()
    packed = pack_fp32(weight)
    assert packed.panels.dtype == torch.float32 and torch.equal(unpack(packed), weight.float())
    weight.zero_()
    assert unpack(packed).abs().sum() > 0


# --- refused inputs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight", [torch.randn(8), torch.ones(4, 8, dtype=torch.int32), [[1.0, 2.0]]])
def test_bad_weights_are_refused(weight):
    with pytest.raises(ValueError, match="2-D floating"):
        pack_fp32(weight)


@needs_compiler
@pytest.mark.parametrize(("x", "bias", "match"), [
    (torch.randn(2, 32, dtype=torch.float64), None, r"\.float\(\)"),
    (torch.randn(1, 2, 32), None, "reshape"),
    (torch.randn(2, 31), None, "31 features"),
    (torch.randn(32, 2).T, None, "contiguous"),
    (torch.randn(2, 32), torch.randn(5), r"bias must be .*\[6\]"),
    (torch.randn(2, 32), torch.randn(6, dtype=torch.float64), "bias must be"),
    (torch.randn(2, 32), torch.randn(12)[::2], "bias must be"),
])
def test_bad_calls_are_refused(x, bias, match):
    with pytest.raises(ValueError, match=match):
        fp32_linear(x, pack_fp32(torch.randn(6, 32)), bias)


def test_an_unpacked_weight_is_refused():
    with pytest.raises(ValueError, match="pack_fp32"):
        fp32_linear(torch.randn(2, 32), torch.randn(6, 32))


# --- the build --------------------------------------------------------------------------------------------------

def test_no_compiler_is_a_named_error_and_not_available(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with pytest.raises(KernelBuildError, match="apt-get install gcc"):
        build.plan_build("fgemm", tmp_path)
    monkeypatch.setattr(fp32, "_kernels", _raises_build_error)
    assert available() is False


@functools.cache
def _raises_build_error():
    raise KernelBuildError("no compiler")


@needs_compiler
def test_portable_build_matches_the_reference(tmp_path):
    # the scalar C path is what CPUs without AVX2/FMA run; it must compute the same products
    scalar = fp32._declare(build.load_library(build.plan_build("fgemm", tmp_path, flags=build.BASE_FLAGS)))
    assert scalar.fk_vector_path() == 0
    weight, bias = pack_fp32(_weight(21, 100)), torch.randn(21)
    for rows in (1, 7):
        x = torch.randn(rows, 100)
        bound = 102 * FP32_EPS * (x.abs() @ unpack(weight).abs().T + bias.abs())
        assert ((fp32._launch(scalar, x, weight, bias) - reference_linear(x, weight, bias)).abs() <= bound).all()


@needs_compiler
def test_the_vector_path_is_built_where_the_cpu_has_it():
    vector = {"avx2", "fma", "f16c"} <= build.cpu_flags()
    assert fp32._kernels().fk_vector_path() == int(vector)
