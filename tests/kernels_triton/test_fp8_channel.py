"""kernels_triton.fp8_channel against the formats/ oracle: quantization bit for bit, GEMM and linear
element by element within the bound derived from the arithmetic (tests/conftest.py gemm_bound: fp32
summation of exact products, at most 6 fp32 roundings in the epilogue, one output rounding each),
the per-row and per-column scales at the right rows and columns, argument errors. Runs under the
interpreter on CPU and on a GPU."""

import dataclasses
import re

import pytest
import torch

import formats
from _e4m3_testlib import (
    bits,
    check_gemm,
    check_linear,
    check_quantize,
    error_calls,
    gemm_bound,
    make_bias,
    make_weight,
    special_values,
    strided_views,
)
from conftest import DEVICE, assert_within_bound, make_input
from kernels_triton import fp8_channel as mod
from kernels_triton import record_launches

FMT = "fp8_channel"
BF16, FP16 = torch.bfloat16, torch.float16

# (M, K, dtype): K = 1 (one element per row), several K steps (under the interpreter BLOCK_K <= 1024,
# so K = 1100 takes two), M past one interpreter program's 256 rows (257)
QUANT_CASES = [(1, 128, BF16), (3, 1, FP16), (16, 1100, BF16), (100, 384, FP16), (257, 200, BF16)]


@pytest.mark.parametrize("M,K,dtype", QUANT_CASES)
def test_quantize_dynamic_matches_oracle_bit_for_bit(M, K, dtype):
    q = check_quantize(mod, FMT, make_input((M, K), dtype, block=32))
    assert q.scale.shape == (M,) and q.block_shape == (1, K)


def test_quantize_gives_each_row_its_own_scale():
    # rows 10x apart in magnitude: one per-tensor scale would leave the small rows' codes tiny
    x = make_input((6, 96), BF16, zero_blocks=False) * torch.tensor([1e-3, 1.0, 10.0, 1e2, 1e3, 1e4],
                                                                     device=DEVICE, dtype=BF16)[:, None]
    q = check_quantize(mod, FMT, x)
    assert len(set(q.scale.tolist())) == 6
    assert bool((q.data.float().abs().amax(1) == 448).all())  # every row's amax element lands on 448


@pytest.mark.parametrize("M,K,dtype,scale", [(3, 384, BF16, 0.05), (100, 128, FP16, 1e-3), (16, 96, BF16, 7.0)])
def test_quantize_static_scale_matches_oracle_including_saturation(M, K, dtype, scale):
    # scale=1e-3 pushes most |x| / scale past 448: the codes must saturate exactly like the oracle
    q = check_quantize(mod, FMT, make_input((M, K), dtype), scale=scale)
    assert bool((q.scale == torch.tensor(scale, dtype=torch.float32)).all())


def test_quantize_static_scale_as_tensor():
    check_quantize(mod, FMT, make_input((5, 64)), scale=torch.tensor(0.02, device=DEVICE))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_static_scale_tensor_gives_nan_rows_never_zeros(bad):
    # a tensor-valued static scale is not read on the host (formats.validate.static_scale): a bad
    # one becomes NaN on the device, so every row's scale and output is NaN
    w = make_weight(FMT, 8, 64, 32)
    y = mod.linear(make_input((3, 64)), w, scale=torch.tensor(bad, device=DEVICE))
    assert bool(y.isnan().all())
    with pytest.raises(ValueError, match="scale must be one finite positive number"):
        mod.linear(make_input((3, 64)), w, scale=bad)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_quantize_zero_tiny_huge_rows_match_oracle(dtype):
    x = special_values(12, 256, dtype, block=128)
    check_quantize(mod, FMT, x)
    # the two zero rows: scale AMAX_FLOOR / 448 (finite, > 0) and all codes 0
    q = mod.quantize_activation(x[:2])
    assert bool((q.data.view(torch.uint8) & 0x7F == 0).all()) and bool((q.scale > 0).all())


def test_zero_activation_row_outputs_the_bias_exactly():
    w = make_weight(FMT, 40, 128, 32)
    x = make_input((4, 128))
    x[2] = 0.0
    b = make_bias(40)
    y = mod.linear(x, w, b)
    assert torch.equal(y[2], b.to(BF16))  # 0 * sx * sw + bias, one rounding to bf16
    check_linear(mod, x, w, b)


def test_quantize_non_contiguous_and_leading_dims():
    for x in strided_views(33, 160, BF16, block=32):
        check_quantize(mod, FMT, x)
    x3 = make_input((2, 5, 3, 64), FP16).transpose(0, 1)  # [5, 2, 3, 64], non-contiguous
    q = check_quantize(mod, FMT, x3)
    assert q.shape == (30, 64)


def test_quantize_empty_rows():
    q = check_quantize(mod, FMT, make_input((0, 128)))
    assert q.data.shape == (0, 128) and q.scale.shape == (0,)
    check_quantize(mod, FMT, make_input((2, 0, 64)), scale=0.5)


# (M, N, K, bias, out_dtype): partial tiles in M and N, K = 1 and K past one tile, bias on/off,
# every output dtype
GEMM_CASES = [
    (1, 200, 128, True, BF16),
    (3, 40, 384, False, FP16),
    (16, 1, 1024, True, FP16),
    (100, 40, 96, True, BF16),
    (257, 200, 384, False, BF16),
    (5, 24, 1, True, torch.float32),
    (257, 1, 200, True, torch.float32),
]


@pytest.mark.parametrize("path", ["portable", "native"])
@pytest.mark.parametrize("M,N,K,has_bias,out_dtype", GEMM_CASES)
def test_gemm_matches_reference_on_identical_operands(M, N, K, has_bias, out_dtype, path):
    if path == "native" and K % 32:
        K = 32 * max(1, K // 32)  # any K works (the tail reads code 0); keep the dot_scaled tiles whole here
    w = make_weight(FMT, N, K, 32)
    xq = formats.quantize(make_input((M, K)), FMT, role="activation")
    bias = make_bias(N, BF16) if has_bias else None
    y = mod.gemm(xq, w, bias, out_dtype=out_dtype, path=path)
    ref = formats.reference_linear(xq, w, bias, out_dtype=out_dtype)
    assert y.shape == ref.shape == (M, N) and y.dtype == out_dtype and ref.abs().max() > 0
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, out_dtype, ref), f"gemm {path}")


def test_gemm_empty_m_returns_empty():
    w = make_weight(FMT, 40, 128, 32)
    y = check_gemm(mod, formats.quantize(make_input((0, 128)), FMT, role="activation"), w, None, BF16)
    assert y.shape == (0, 40)


@pytest.mark.parametrize("path", ["portable", "native"])
def test_gemm_applies_each_scale_to_its_own_row_and_column(path):
    # Doubling weight row 7's scale must double output column 7 only; doubling activation row 3's
    # scale must double output row 3 only (powers of two: the doubled outputs are exact). A kernel
    # that swapped sx and sw, or read them with the other index, fails this.
    w = make_weight(FMT, 40, 256, 32)
    xq = formats.quantize(make_input((16, 256), zero_blocks=False), FMT, role="activation")
    y = mod.gemm(xq, w, out_dtype=torch.float32, path=path)
    sw = w.scale.clone()
    sw[7] *= 2
    y_w = mod.gemm(xq, dataclasses.replace(w, scale=sw), out_dtype=torch.float32, path=path)
    changed = (y_w != y).any(0)
    assert changed.nonzero().flatten().tolist() == [7] and torch.equal(y_w[:, 7], 2 * y[:, 7])
    sx = xq.scale.clone()
    sx[3] *= 2
    y_x = mod.gemm(dataclasses.replace(xq, scale=sx), w, out_dtype=torch.float32, path=path)
    assert (y_x != y).any(1).nonzero().flatten().tolist() == [3] and torch.equal(y_x[3], 2 * y[3])


@pytest.mark.parametrize("shape,dtype,has_bias", [((2, 3, 256), BF16, True), ((7, 384), FP16, False), ((0, 128), BF16, True)])
def test_linear_matches_reference(shape, dtype, has_bias):
    w = make_weight(FMT, 40, shape[-1], 32)
    x = make_input(shape, dtype, block=32)
    check_linear(mod, x, w, make_bias(40) if has_bias else None)


def test_linear_static_scale_and_non_contiguous_x():
    w = make_weight(FMT, 24, 128, 32)
    x = make_input((128, 10), FP16).t()  # [10, 128] with stride (1, 10)
    check_linear(mod, x, w, None, scale=0.02)
    check_linear(mod, make_input((2, 3, 128)), w, make_bias(24), scale=0.01)


def test_nonfinite_row_stays_in_its_row():
    w = make_weight(FMT, 24, 128, 32)
    x = make_input((5, 128))
    x[1, 9] = float("nan")
    x[3, 100] = float("inf")
    for opts in ({}, {"scale": 0.02}):
        y = mod.linear(x, w, **opts)
        assert (~torch.isfinite(y)).all(1).tolist() == [False, True, False, True, False]
        ref = formats.reference_linear(x.cpu(), w.to("cpu"), **opts)
        keep = torch.tensor([0, 2, 4])
        xq = formats.quantize(x[keep].cpu(), FMT, role="activation", **opts)
        assert_within_bound(y[keep], ref[keep], gemm_bound(xq, w, None, BF16, ref[keep]), "finite rows")


def test_linear_unchecked_is_linear_without_the_checks():
    w = make_weight(FMT, 40, 256, 32)
    x = make_input((2, 3, 256))
    b = make_bias(40)
    with record_launches() as checked:
        y = mod.linear(x, w, b, scale=0.03)
    with record_launches() as unchecked:
        y2 = mod.linear_unchecked(x, w, b, scale=0.03)
    assert torch.equal(y, y2) and checked == unchecked == ["_quantize_kernel", "_portable_gemm_kernel"]
    # linear names a bad argument; linear_unchecked trusts its caller
    with pytest.raises(ValueError, match="x must be bfloat16"):
        mod.linear(x.float(), w)


def test_route_names_the_launches():
    w = make_weight(FMT, 40, 128, 32)
    x = make_input((5, 128))
    for path in ("portable", "native"):
        r = mod.route(5, 40, 128, capability=None, path=path)
        with record_launches() as got:
            mod.linear(x, w, path=path)
        assert list(r.kernels) == got and r.tile == str(mod.tile_config(5, 40, 128, path, None))
    assert mod.route(0, 40, 128).kernels == ()
    assert mod.route(5, 0, 128).kernels == ("_quantize_kernel",)  # no output columns: no GEMM to launch
    assert mod.route(5, 40, 128, capability=(12, 0)).kernels[-1] == "_native_gemm_kernel"
    assert mod.route(5, 40, 128, capability=(9, 0)).kernels[-1] == "_portable_gemm_kernel"
    with pytest.raises(ValueError, match=r"a16=True \(weight-only W4A16 / W8A16\) exists for .*'fp8_channel'"):
        mod.route(5, 40, 128, a16=True)


@pytest.mark.parametrize("case", [c[0] for c in error_calls(mod, FMT, 128, 1, "mxfp8")]
                         + ["static_scale", "weight_scale_length", "xq_scale_length"])
def test_argument_errors_name_the_argument(case):
    calls = {name: (call, word) for name, call, word in error_calls(mod, FMT, 128, 1, "mxfp8")}
    w = make_weight(FMT, 8, 128, 32)
    xq = formats.quantize(make_input((4, 128)), FMT, role="activation")
    calls["static_scale"] = (lambda: mod.quantize_activation(make_input((2, 64)), scale=-1.0), "scale")
    calls["weight_scale_length"] = (lambda: mod.linear(make_input((2, 128)), dataclasses.replace(w, scale=w.scale[:-1])),
                                    "qweight.scale must have shape (8,)")
    calls["xq_scale_length"] = (lambda: mod.gemm(dataclasses.replace(xq, scale=xq.scale[:1]), w),
                                "xq.scale must have shape (4,)")
    call, word = calls[case]
    with pytest.raises(ValueError, match=re.escape(word)):
        call()


def test_scales_compare_bit_for_bit_not_by_value():
    # the quantizer's scales are IEEE quotients amax / 448 (div_rn), the oracle's too: equal bits
    x = make_input((9, 200), BF16)
    assert torch.equal(bits(mod.quantize_activation(x).scale), bits(formats.quantize(x, FMT, role="activation").scale))
