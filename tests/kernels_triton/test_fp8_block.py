"""kernels_triton.fp8_block against the formats/ oracle: 1x128-group quantization bit for bit (with
and without UE8M0 scales), the per-K-block scaled GEMM and linear within the issue's tolerances,
argument errors. Runs under the interpreter on CPU and on a GPU."""

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
from conftest import make_input, rel_err
from kernels_triton import fp8_block as mod

FMT = "fp8_block"
BLOCK = 128
BF16, FP16 = torch.bfloat16, torch.float16

# (M, K, dtype): every M of the issue; K at one block, several blocks, and 384 (3 blocks, not a power of two)
QUANT_CASES = [(1, 128, BF16), (3, 384, FP16), (16, 1024, BF16), (100, 128, FP16), (257, 384, BF16), (257, 512, FP16)]


@pytest.mark.parametrize("M,K,dtype", QUANT_CASES)
def test_quantize_matches_oracle_bit_for_bit(M, K, dtype):
    check_quantize(mod, FMT, make_input((M, K), dtype, block=BLOCK))


@pytest.mark.parametrize("M,K,dtype", [(3, 128, BF16), (100, 384, FP16), (257, 256, BF16)])
def test_quantize_ue8m0_scales_match_oracle(M, K, dtype):
    q = check_quantize(mod, FMT, make_input((M, K), dtype, block=BLOCK), ue8m0=True)
    mantissa = q.scale.view(torch.int32) & 0x7FFFFF
    assert bool((mantissa == 0).all()), "UE8M0 scales must be powers of two"


@pytest.mark.parametrize("dtype,ue8m0", [(BF16, False), (FP16, True)])
def test_quantize_zero_tiny_huge_groups_match_oracle(dtype, ue8m0):
    check_quantize(mod, FMT, special_values(12, 384, dtype, block=BLOCK), ue8m0=ue8m0)


def test_quantize_non_contiguous_and_leading_dims():
    for x in strided_views(33, 256, FP16, block=BLOCK):
        check_quantize(mod, FMT, x)
    x3 = make_input((3, 4, 128), BF16).transpose(0, 1)
    assert check_quantize(mod, FMT, x3).shape == (12, 128)


def test_quantize_empty_rows():
    q = check_quantize(mod, FMT, make_input((0, 256)))
    assert q.scale.shape == (0, 2)


# (M, N, K, bias, out_dtype). N = 200 spans two 128-row weight blocks (the second one partial),
# so sw[n // 128] is exercised inside one tile. On sm_90, M <= 16 runs the swapped decode kernel
# (_fp8_decode), and K = 1024 / 2048 split it over 2 / 4 programs along K (hopper/test_hopper_fp8_block.py).
GEMM_CASES = [
    (1, 200, 128, True, BF16),
    (3, 40, 384, False, FP16),
    (16, 1, 256, True, FP16),
    (7, 200, 1024, True, BF16),
    (16, 128, 2048, False, torch.float32),
    (100, 200, 384, True, BF16),
    (257, 40, 128, False, BF16),
    (257, 200, 256, True, torch.float32),
]


@pytest.mark.parametrize("M,N,K,has_bias,out_dtype", GEMM_CASES)
def test_gemm_matches_reference_on_identical_operands(M, N, K, has_bias, out_dtype):
    w = make_weight(FMT, N, K, BLOCK)
    xq = formats.quantize(make_input((M, K), block=BLOCK), FMT, role="activation")
    check_gemm(mod, xq, w, make_bias(N, FP16) if has_bias else None, out_dtype)


@pytest.mark.parametrize("M,K,has_bias", [(16, 256, False), (1, 1024, True)])
def test_gemm_ue8m0_operands(M, K, has_bias):
    w = make_weight(FMT, 200, K, BLOCK, ue8m0=True)
    xq = formats.quantize(make_input((M, K), block=BLOCK), FMT, role="activation", ue8m0=True)
    check_gemm(mod, xq, w, make_bias(200) if has_bias else None, BF16)


def test_gemm_empty_m_returns_empty():
    w = make_weight(FMT, 40, 128, BLOCK)
    y = check_gemm(mod, formats.quantize(make_input((0, 128)), FMT, role="activation"), w, None, FP16)
    assert y.shape == (0, 40)


def test_gemm_uses_each_block_scale_where_it_belongs():
    # Scale only weight block (rows 128..199, K block 1) by 4 and one activation group by 2: the
    # kernel must follow the new reference and leave the old one, so a wrong n // 128 or kb index
    # in the scale loads cannot pass.
    w = make_weight(FMT, 200, 256, BLOCK)
    xq = formats.quantize(make_input((16, 256), block=BLOCK), FMT, role="activation")
    before = formats.reference_linear(xq, w, out_dtype=torch.float32)
    sw = w.scale.clone()
    sw[1, 1] *= 4
    sx = xq.scale.clone()
    sx[5, 0] *= 2
    w2, xq2 = dataclasses.replace(w, scale=sw), dataclasses.replace(xq, scale=sx)
    y = check_gemm(mod, xq2, w2, None, torch.float32)
    assert rel_err(y, before) > 0.05


@pytest.mark.parametrize("shape,dtype,has_bias", [((2, 3, 256), BF16, True), ((5, 384), FP16, False), ((0, 128), FP16, True)])
def test_linear_matches_reference(shape, dtype, has_bias):
    w = make_weight(FMT, 40, shape[-1], BLOCK)
    check_linear(mod, make_input(shape, dtype, block=BLOCK), w, make_bias(40) if has_bias else None)


def test_linear_ue8m0_and_non_contiguous_x():
    w = make_weight(FMT, 200, 256, BLOCK)
    x = make_input((9, 512), BF16, block=BLOCK)[:, ::2]
    check_linear(mod, x, w, make_bias(200), ue8m0=True)


@pytest.mark.parametrize("case", [c[0] for c in error_calls(mod, FMT, 128, BLOCK, "fp8_tensor")])
def test_argument_errors_name_the_argument(case):
    call, word = {name: (call, word) for name, call, word in error_calls(mod, FMT, 128, BLOCK, "fp8_tensor")}[case]
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
    w = make_weight(FMT, N, K, BLOCK)
    x = make_input((M, K), BF16, block=BLOCK)
    xq = check_quantize(mod, FMT, x)
    check_gemm(mod, xq, w, make_bias(N), BF16)
    # fp32 output shows the accumulation error alone: each 128-deep partial is promoted to fp32
    y = mod.gemm(xq, w, out_dtype=torch.float32)
    assert rel_err(y, formats.reference_linear(xq, w, out_dtype=torch.float32)) <= FP8_DIRECT_DOT_FP32_TOL
    check_linear(mod, x, w, None)
