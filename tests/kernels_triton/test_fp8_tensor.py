"""kernels_triton.fp8_tensor against the formats/ oracle: quantization bit for bit, GEMM and linear
within the issue's tolerances, argument errors. Runs under the interpreter on CPU and on a GPU."""

import dataclasses
import re

import pytest
import torch

import formats
from _e4m3_testlib import (
    check_gemm,
    check_linear,
    check_quantize,
    error_calls,
    FP8_DIRECT_DOT_FP32_TOL,
    make_bias,
    make_weight,
    require_gpu,
    special_values,
    strided_views,
)
from conftest import DEVICE, make_input, rel_err
from kernels_triton import fp8_tensor as mod

FMT = "fp8_tensor"
BF16, FP16 = torch.bfloat16, torch.float16

# (M, K, dtype): every M of the issue, K from 1 (no block structure) to several tiles, dtypes paired
QUANT_CASES = [(1, 128, BF16), (3, 1, FP16), (16, 1024, BF16), (100, 384, FP16), (257, 200, BF16), (257, 384, FP16)]


@pytest.mark.parametrize("M,K,dtype", QUANT_CASES)
def test_quantize_dynamic_matches_oracle_bit_for_bit(M, K, dtype):
    check_quantize(mod, FMT, make_input((M, K), dtype, block=32))


@pytest.mark.parametrize("M,K,dtype,scale", [(3, 384, BF16, 0.05), (100, 128, FP16, 1e-3), (16, 96, BF16, 7.0)])
def test_quantize_static_scale_matches_oracle_including_saturation(M, K, dtype, scale):
    # scale=1e-3 pushes most |x| / scale past 448: the codes must saturate exactly like the oracle
    q = check_quantize(mod, FMT, make_input((M, K), dtype), scale=scale)
    assert q.scale.item() == torch.tensor(scale, dtype=torch.float32).item()


def test_quantize_static_scale_as_tensor():
    check_quantize(mod, FMT, make_input((5, 64)), scale=torch.tensor(0.02, device=DEVICE))


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_quantize_zero_tiny_huge_rows_match_oracle(dtype):
    x = special_values(12, 256, dtype, block=128)
    check_quantize(mod, FMT, x)
    # zero and tiny rows only: bf16's 1e-38 is below the amax floor 2^-100, so all codes are 0
    check_quantize(mod, FMT, x[:3], nonzero=dtype == FP16)


def test_quantize_all_zero_tensor_gives_floor_scale_and_zero_codes():
    o = check_quantize(mod, FMT, torch.zeros(4, 64, dtype=BF16, device=DEVICE))
    assert bool((o.data.float() == 0).all())


def test_quantize_non_contiguous_and_leading_dims():
    for x in strided_views(33, 160, BF16, block=32):
        check_quantize(mod, FMT, x)
    x3 = make_input((2, 5, 3, 64), FP16).transpose(0, 1)  # [5, 2, 3, 64], non-contiguous
    q = check_quantize(mod, FMT, x3)
    assert q.shape == (30, 64)


def test_quantize_empty_rows():
    q = check_quantize(mod, FMT, make_input((0, 128)))
    assert q.data.shape == (0, 128)
    check_quantize(mod, FMT, make_input((2, 0, 64)), scale=0.5)


# (M, N, K, bias, out_dtype): each M and N of the issue, bias on/off, both output dtypes (+ fp32)
GEMM_CASES = [
    (1, 200, 128, True, BF16),
    (3, 40, 384, False, FP16),
    (16, 1, 1024, True, FP16),
    (100, 40, 96, True, BF16),
    (257, 200, 384, False, BF16),
    (257, 1, 200, True, torch.float32),
]


@pytest.mark.parametrize("M,N,K,has_bias,out_dtype", GEMM_CASES)
def test_gemm_matches_reference_on_identical_operands(M, N, K, has_bias, out_dtype):
    w = make_weight(FMT, N, K, 32)
    xq = formats.quantize(make_input((M, K)), FMT, role="activation")
    check_gemm(mod, xq, w, make_bias(N, BF16) if has_bias else None, out_dtype)


def test_gemm_empty_m_returns_empty():
    w = make_weight(FMT, 40, 128, 32)
    y = check_gemm(mod, formats.quantize(make_input((0, 128)), FMT, role="activation"), w, None, BF16)
    assert y.shape == (0, 40)


def test_gemm_applies_both_scales():
    # The comparison can fail: doubling the weight scale must move the kernel off the old reference
    # and onto the new one.
    w = make_weight(FMT, 40, 256, 32)
    xq = formats.quantize(make_input((16, 256)), FMT, role="activation")
    before = formats.reference_linear(xq, w, out_dtype=torch.float32)
    w2 = dataclasses.replace(w, scale=w.scale * 2)
    y = check_gemm(mod, xq, w2, None, torch.float32)
    assert rel_err(y, before) > 0.5


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


@pytest.mark.parametrize("case", [c[0] for c in error_calls(mod, FMT, 128, 1, "mxfp8")] + ["static_scale"])
def test_argument_errors_name_the_argument(case):
    calls = {name: (call, word) for name, call, word in error_calls(mod, FMT, 128, 1, "mxfp8")}
    calls["static_scale"] = (lambda: mod.quantize_activation(make_input((2, 64)), scale=-1.0), "scale")
    call, word = calls[case]
    with pytest.raises(ValueError, match=re.escape(word)):
        call()


# ---------------------------------------------------------------------------------------------
# GPU only: the large shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("M,N,K", [(4096, 4096, 4096), (1, 8192, 8192), (16, 8192, 8192)])
def test_large_shapes_on_gpu(M, N, K):
    require_gpu()
    w = make_weight(FMT, N, K, 32)
    x = make_input((M, K), BF16)
    xq = check_quantize(mod, FMT, x)
    check_gemm(mod, xq, w, make_bias(N), BF16)
    # fp32 output exposes the accumulation itself: Triton's default imprecise fp8 accumulation on
    # Hopper measured ~4e-3 at this size; promotion every 128 products must stay far below.
    y = mod.gemm(xq, w, out_dtype=torch.float32)
    assert rel_err(y, formats.reference_linear(xq, w, out_dtype=torch.float32)) <= FP8_DIRECT_DOT_FP32_TOL
    check_linear(mod, x, w, None)
