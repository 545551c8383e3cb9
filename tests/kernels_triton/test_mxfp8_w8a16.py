"""kernels_triton.mxfp8's W8A16 path (the "mxfp8_w8a16" variant: MXFP8 weights, bf16/fp16 x as it
is) against formats.reference_linear(..., a16=True): gemm_w8a16 and linear(a16=True), bf16 and fp16
x, bias, NaN/Inf, the route and the argument errors. Runs under the interpreter on CPU and on a GPU.

Bounds (conftest.gemm_bound, with x the float activation): every product x[m, k] * w[n, k] is exact
(x has 8 (bf16) or 11 (fp16) significant bits, the decoded weight e4m3 * 2^e 4, so the product fits
fp32's 24; on GPU fp16 x is split exactly into two bf16 halves, each product exact again), the K
products are summed in fp32 (K 2^-24 sum |x| |w|, Higham's gamma_K), the bias is added in fp32 (one
rounding), and the result is rounded once to the output dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, assert_within_bound, gemm_bound, make_input

import formats
import kernels_triton
from kernels_triton import mxfp8, record_launches

FMT = "mxfp8"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _cpu(t):
    return None if t is None else t.cpu()


def _weight(n: int, k: int) -> formats.QuantizedTensor:
    return formats.quantize(make_input((n, k)), FMT).to(DEVICE)


def _check(y, x, qw, bias, out_dtype, what):
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), _cpu(bias), a16=True, out_dtype=out_dtype)
    assert y.shape == ref.shape and y.dtype == out_dtype, (y.shape, y.dtype)
    assert_within_bound(y, ref, gemm_bound(x, qw, _cpu(bias), out_dtype, ref), what)


# (M, N, K, x dtype, bias, out dtype): one row, a few rows, more rows than one tile; K = 96 is not a
# multiple of a 64-deep K step (masked tail); M = 0 launches nothing
@pytest.mark.parametrize("m,n,k,dtype,has_bias,out_dtype", [
    (1, 40, 64, BF16, True, FP32), (3, 24, 96, FP16, False, FP32), (130, 40, 256, BF16, False, BF16),
    (17, 72, 160, FP16, True, FP16), (0, 8, 32, FP16, True, FP32),
])
def test_gemm_w8a16_matches_reference(m, n, k, dtype, has_bias, out_dtype):
    x = make_input((m, k), dtype)
    qw = _weight(n, k)
    bias = torch.randn(n, device=DEVICE) if has_bias else None
    y = mxfp8.gemm_w8a16(x, qw, bias, out_dtype=out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    if m:
        _check(y, x, qw, bias, out_dtype, f"W8A16 {dtype} M={m}")


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_linear_a16_is_gemm_w8a16_with_leading_dims_and_bias(dtype):
    x = make_input((2, 5, 96), dtype)
    qw = _weight(40, 96)
    bias = torch.randn(40, device=DEVICE).to(dtype)  # a bias in x's dtype, widened in fp32
    y = mxfp8.linear(x, qw, bias, a16=True)
    assert y.shape == (2, 5, 40) and y.dtype == dtype
    _check(y, x, qw, bias, dtype, f"linear a16 {dtype}")
    assert torch.equal(y.reshape(10, 40), mxfp8.gemm_w8a16(x.reshape(10, 96), qw, bias))
    # the package-level entry point takes the same option
    assert torch.equal(kernels_triton.linear(x, qw, bias, a16=True), y)


def test_linear_a16_non_contiguous_x_and_empty_x():
    x = make_input((96, 33), BF16).T  # [33, 96], K stride 33
    qw = _weight(24, 96)
    _check(mxfp8.linear(x, qw, a16=True), x, qw, None, BF16, "transposed x")
    y = mxfp8.linear(torch.empty(2, 0, 96, dtype=FP16, device=DEVICE), qw, a16=True)
    assert y.shape == (2, 0, 24) and y.dtype == FP16


def test_fp16_x_keeps_its_low_bits_and_weights_beyond_fp16_range():
    """fp16 x with all 11 significant bits used (bf16 holds 8: rounding x to bf16 errs by ~2^-9) and
    weight scales around 2^40 (beyond fp16's 65504): the result must still be within the fp32
    bound, which a kernel that rounds x to bf16 or casts the weight to fp16 misses."""
    m, n, k = 4, 16, 64
    x = (1 + torch.arange(m * k, dtype=FP32).reshape(m, k) % 2047 / 2048).to(FP16).to(DEVICE)  # 11-bit mantissas
    qw = formats.quantize(make_input((n, k), FP32) * 2.0 ** 40, FMT).to(DEVICE)
    y = mxfp8.gemm_w8a16(x, qw, out_dtype=FP32)
    _check(y, x, qw, None, FP32, "fp16 x, weights ~2^40")
    assert bool(y.isfinite().all())


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_nan_and_inf_stay_non_finite_where_the_oracle_is(dtype):
    """A NaN or Inf in x makes its row of y non-finite (a NaN in x: NaN); a NaN weight (E8M0 byte
    0xFF, e4m3 code 0x7F) makes its column NaN; every other element matches the oracle's bound."""
    m, n, k = 6, 24, 96
    x = make_input((m, k), dtype)
    x[1, 5] = float("nan")
    x[3, 70] = float("inf")
    x[4, 2] = float("-inf")
    qw = formats.quantize(make_input((n, k)), FMT)
    qw.scale[7, 1] = 0xFF  # a NaN block scale
    qw.data.view(torch.uint8)[11, 40] = 0x7F  # a NaN code
    qw = qw.to(DEVICE)
    y = mxfp8.gemm_w8a16(x, qw, out_dtype=FP32).cpu()
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), a16=True, out_dtype=FP32)
    bad = ~ref.isfinite()
    assert bad[[1, 3, 4]].all() and bad[:, [7, 11]].all() and not bad[[0, 2, 5]][:, [0, 1, 2]].any()
    assert torch.equal(~y.isfinite(), bad), "non-finite elements differ from the oracle's"
    assert bool(y[ref.isnan()].isnan().all()), "a NaN of the oracle came out as a number or Inf"
    ok_rows, ok_cols = [0, 2, 5], [c for c in range(n) if c not in (7, 11)]
    w = qw.to("cpu")
    sub = dataclasses.replace(w, data=w.data[ok_cols], scale=w.scale[ok_cols], shape=(len(ok_cols), k))
    xs = x[ok_rows]
    r = ref[ok_rows][:, ok_cols]
    assert_within_bound(y[ok_rows][:, ok_cols], r, gemm_bound(xs, sub, None, FP32, r), "finite part")


@pytest.mark.parametrize("capability", [None, (9, 0), (8, 9), (12, 0), (12, 1)], ids=str)
def test_route_is_the_portable_gemm_alone_everywhere(capability):
    """W8A16 quantizes nothing and never takes the block-scaled MMA (FP8xFP8 only): one portable
    GEMM on every device, and the reason says so; path="native" is refused by name."""
    r = mxfp8.route(16, 64, 128, capability=capability, a16=True)
    assert r.kernels == ("_portable_gemm_kernel",), r.describe()
    if capability is not None:
        assert "W8A16" in r.why and "e4m3" in r.why
    assert mxfp8.route(0, 64, 128, capability=capability, a16=True).kernels == ()
    with pytest.raises(ValueError, match="mxfp8 W8A16 has no native kernel"):
        mxfp8.route(16, 64, 128, capability=capability, a16=True, path="native")


def test_launches_are_the_route():
    x, qw = make_input((3, 64), BF16), _weight(16, 64)
    with record_launches() as log:
        mxfp8.linear(x, qw, a16=True)
    cap = kernels_triton._common.device_capability(qw.device)
    assert tuple(log) == mxfp8.route(3, 16, 64, capability=cap, a16=True).kernels


def test_errors_name_the_argument():
    x, qw = make_input((2, 64), BF16), _weight(8, 64)
    cases = [
        (lambda: mxfp8.linear(x.float(), qw, a16=True), r"x must be bfloat16 or float16.*float32"),
        (lambda: mxfp8.linear(make_input((2, 96), BF16), qw, a16=True), r"K=64"),
        (lambda: mxfp8.linear(x, qw, a16=True, path="native"), r"W8A16 has no native kernel"),
        (lambda: mxfp8.gemm_w8a16(make_input((2, 4, 64), BF16), qw), r"x2d must be 2-D"),
        (lambda: mxfp8.gemm_w8a16(x, qw, out_dtype=torch.float64), r"out_dtype.*float64"),
        (lambda: mxfp8.gemm_w8a16(x, qw, torch.ones(7, device=DEVICE)), r"bias"),
        (lambda: mxfp8.gemm_w8a16(x, formats.quantize(make_input((8, 64)), "mxfp4").to(DEVICE)), r"mxfp8"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
