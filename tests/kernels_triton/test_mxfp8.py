"""kernels_triton.mxfp8 against the formats/ oracle: 1x32 E8M0 quantization bit for bit (ceil and
floor rules), the dequantize-in-registers GEMM and linear within the issue's tolerances, argument
errors. Runs under the interpreter on CPU and on a GPU."""

import dataclasses
import re

import pytest
import torch

import formats
from _e4m3_testlib import (
    assert_within_bound,
    check_gemm,
    check_linear,
    check_quantize,
    error_calls,
    fp8_mma,
    gemm_bound,
    make_bias,
    make_weight,
    require_gpu,
    special_values,
    strided_views,
    tolerance,
)
from conftest import DEVICE, make_input, rel_err
from kernels_triton import mxfp8 as mod
from kernels_triton._common import interpreting
from kernels_triton.hopper._e4m3_decode import decode_config as bf16_decode_config
from kernels_triton.hopper._e4m3_decode import launch_e4m3_decode
from kernels_triton.hopper._fp8_decode import (MX_DECODE_TILE, MX_SCALE, fp8_decode_applies, fp8_decode_config,
                                        launch_fp8_decode)

FMT = "mxfp8"
BLOCK = 32
BF16, FP16 = torch.bfloat16, torch.float16

# (M, K, dtype): every M of the issue; K at one block, several blocks, 96 (3 blocks) and 1056
# (33 blocks: more than one quantization tile along K, the last one partial)
QUANT_CASES = [(1, 32, BF16), (3, 96, FP16), (16, 1056, BF16), (100, 32, FP16), (257, 96, BF16), (257, 256, FP16)]


@pytest.mark.parametrize("M,K,dtype", QUANT_CASES)
def test_quantize_ceil_rule_matches_oracle_bit_for_bit(M, K, dtype):
    check_quantize(mod, FMT, make_input((M, K), dtype, block=BLOCK))


@pytest.mark.parametrize("M,K,dtype", [(3, 32, BF16), (100, 96, FP16), (257, 160, BF16)])
def test_quantize_floor_rule_matches_oracle_bit_for_bit(M, K, dtype):
    # the floor rule is up to one binade finer, so block maxima saturate to 448: exercised here
    check_quantize(mod, FMT, make_input((M, K), dtype, block=BLOCK), scale_rule="floor")


@pytest.mark.parametrize("dtype,rule", [(BF16, "ceil"), (FP16, "floor"), (BF16, "floor")])
def test_quantize_zero_tiny_huge_blocks_match_oracle(dtype, rule):
    check_quantize(mod, FMT, special_values(12, 128, dtype, block=BLOCK), scale_rule=rule)


def test_quantize_non_contiguous_and_leading_dims():
    for x in strided_views(33, 96, BF16, block=BLOCK):
        check_quantize(mod, FMT, x)
    x3 = make_input((2, 3, 64), FP16).transpose(0, 1)
    assert check_quantize(mod, FMT, x3).shape == (6, 64)


def test_quantize_empty_rows():
    q = check_quantize(mod, FMT, make_input((0, 96)))
    assert q.scale.shape == (0, 3) and q.scale.dtype == torch.uint8


# (M, N, K, bias, out_dtype): each M and N of the issue; K = 96 and 544 are not multiples of the
# interpreter's BLOCK_K, so the K mask is exercised. On sm_90, M <= 16 runs the swapped decode
# kernel (_fp8_decode, SCALE_K = 32) with its K step the widest of 128 / 64 / 32 dividing K:
# K = 544 (32-wide steps) splits over 4 programs, 320 (64-wide) over none, 1024 and 2048 (128-wide)
# over 2 and 4 (hopper/test_hopper_mxfp8.py).
GEMM_CASES = [
    (1, 200, 32, True, BF16),
    (3, 40, 96, False, FP16),
    (16, 1, 544, True, FP16),
    (5, 72, 320, True, FP16),
    (7, 200, 1024, True, BF16),
    (16, 128, 2048, False, torch.float32),
    (100, 200, 96, True, BF16),
    (257, 40, 256, False, BF16),
    (257, 200, 128, True, torch.float32),
]


@pytest.mark.parametrize("M,N,K,has_bias,out_dtype", GEMM_CASES)
def test_gemm_matches_reference_on_identical_operands(M, N, K, has_bias, out_dtype):
    w = make_weight(FMT, N, K, BLOCK)
    xq = formats.quantize(make_input((M, K), block=BLOCK), FMT, role="activation")
    check_gemm(mod, xq, w, make_bias(N, BF16) if has_bias else None, out_dtype)


def test_gemm_floor_rule_operands():
    w = make_weight(FMT, 40, 128, BLOCK, scale_rule="floor")
    xq = formats.quantize(make_input((16, 128)), FMT, role="activation", scale_rule="floor")
    check_gemm(mod, xq, w, None, BF16)


def test_gemm_empty_m_returns_empty():
    w = make_weight(FMT, 40, 64, BLOCK)
    y = check_gemm(mod, formats.quantize(make_input((0, 64)), FMT, role="activation"), w, None, BF16)
    assert y.shape == (0, 40)


def test_gemm_uses_each_e8m0_scale_where_it_belongs():
    # Raise one weight block's exponent by 3 (x8) and lower one activation block's by 2: the kernel
    # must follow the new reference, so a wrong k // 32 index cannot pass.
    w = make_weight(FMT, 40, 128, BLOCK)
    xq = formats.quantize(make_input((16, 128), zero_blocks=False), FMT, role="activation")
    before = formats.reference_linear(xq, w, out_dtype=torch.float32)
    sw, sx = w.scale.clone(), xq.scale.clone()
    sw[7, 2] += 3
    sx[4, 1] -= 2
    y = check_gemm(mod, dataclasses.replace(xq, scale=sx), dataclasses.replace(w, scale=sw), None, torch.float32)
    assert rel_err(y, before) > 0.01


def test_gemm_nan_and_extreme_scales_in_decode_rows():
    # M = 9, K = 1024 with a bias, through gemm (on sm_90 a decode kernel, split-K; the lesson on
    # the CPU, native on SM12x) and through both sm_90 decode kernels directly (launch_fp8_decode
    # split 2, launch_e4m3_decode split 3; on the CPU too, skipped only on other GPUs, where gemm
    # never launches them).
    # Row 2's scale bytes are all 0x00 (2^-127) against a weight whose bytes are all 230 (2^103):
    # each product is code_x * code_w * 2^-24. Row 2's codes have magnitudes in [0.5, 1) (exponent
    # field 6), so code * 2^-127 and code * 2^-126 are multiples of 2^-131 with 4 significant bits:
    # exact in bf16 too (the bf16 decode kernel's operands; its subnormal grid is 2^-133, and
    # smaller codes would round there, as the lesson's bf16 cast does on a GPU: _e4m3_decode).
    # Row 4 gets one 0xFF scale byte (NaN) over finite
    # codes, weight row 7 one NaN code (0x7F), weight row 11 one 0xFF scale: exactly row 4 and
    # columns 7 and 11 of y are NaN, the rest matches the oracle within the bound.
    # Row 2 must also equal, bit for bit, row 2 of a twin GEMM with sx[2] = 1 (2^-126) and every
    # finite weight byte one lower (229, 2^102): 2^-127 * 2^103 and 2^-126 * 2^102 are the same 2^-24,
    # exact in fp32 either way (the decode kernel multiplies the two scales first: one exact product;
    # the lesson decodes code * 2^-127, a multiple of 2^-149 with 4 significant bits, exact in fp32,
    # and multiplies exact values), so every product, partial and sum is the same number in the same
    # order. Decoding 0x00 as 0 (y = bias) or as 2^-126 (twice the GEMM) changes row 2.
    M, N, K = 9, 40, 1024
    w = make_weight(FMT, N, K, BLOCK)
    xq = formats.quantize(make_input((M, K), zero_blocks=False), FMT, role="activation")
    sx, sw, wd = xq.scale.clone(), torch.full_like(w.scale, 230), w.data.clone()
    xd = xq.data.clone()
    xd.view(torch.uint8)[2] = (xd.view(torch.uint8)[2] & 0x87) | 0x30  # sign and mantissa kept
    xq = dataclasses.replace(xq, data=xd)
    sx[2] = 0
    sx[4, 17] = 0xFF
    wd.view(torch.uint8)[7, 300] = 0x7F
    sw[11, 3] = 0xFF
    sx_twin, sw_twin = sx.clone(), torch.where(sw == 0xFF, sw, sw - 1)
    sx_twin[2] = 1
    xq, w = dataclasses.replace(xq, scale=sx), dataclasses.replace(w, data=wd, scale=sw)
    xq_twin, w_twin = dataclasses.replace(xq, scale=sx_twin), dataclasses.replace(w, scale=sw_twin)
    bias = make_bias(N)
    ref = formats.reference_linear(xq, w, bias, out_dtype=torch.float32)
    nan = torch.zeros(M, N, dtype=torch.bool)
    nan[4], nan[:, 7], nan[:, 11] = True, True, True
    assert torch.equal(ref.isnan().cpu(), nan)
    rows, cols = [i for i in range(M) if i != 4], [j for j in range(N) if j not in (7, 11)]
    # row 2's GEMM part is far above the fp32 spacing of y (~2^-21 here), so the twin check can fail
    assert formats.reference_linear(xq, w, out_dtype=torch.float32)[2, cols].abs().max().item() > 2.0 ** -16
    keep = lambda t: t.cpu()[rows][:, cols]  # noqa: E731
    bound = keep(gemm_bound(xq, w, bias, torch.float32, ref))

    def gemm(a, b):
        return mod.gemm(a, b, bias, out_dtype=torch.float32)

    def decode(a, b):
        y = torch.empty(M, N, dtype=torch.float32, device=b.data.device)
        cfg = dataclasses.replace(fp8_decode_config(M, N, K, **MX_DECODE_TILE), SPLIT_K=2,
                                  num_stages=1 if interpreting() else 4)
        return launch_fp8_decode(a.data, b.data, a.scale, b.scale, bias, y, scale_k=MX_SCALE, config=cfg)

    def bf16_decode(a, b):
        y = torch.empty(M, N, dtype=torch.float32, device=b.data.device)
        cfg = dataclasses.replace(bf16_decode_config(M, N, K, b.data.device), SPLIT_K=3)
        return launch_e4m3_decode(a.data, a.scale, b.data, b.scale, bias, y, config=cfg)

    decoders = [decode, bf16_decode] if DEVICE == "cpu" or fp8_decode_applies(M, torch.device(DEVICE)) else []
    runs = [gemm] + decoders
    for run in runs:
        y, twin = run(xq, w).cpu(), run(xq_twin, w_twin).cpu()
        assert torch.equal(y.isnan(), nan), run.__name__
        assert torch.equal(y[2, cols].view(torch.int32), twin[2, cols].view(torch.int32)), run.__name__
        assert_within_bound(keep(y), keep(ref), bound, run.__name__)


@pytest.mark.parametrize("shape,dtype,has_bias", [((2, 3, 96), BF16, True), ((5, 256), FP16, False), ((0, 32), BF16, True)])
def test_linear_matches_reference(shape, dtype, has_bias):
    w = make_weight(FMT, 40, shape[-1], BLOCK)
    check_linear(mod, make_input(shape, dtype, block=BLOCK), w, make_bias(40) if has_bias else None)


def test_linear_floor_rule_and_non_contiguous_x():
    w = make_weight(FMT, 200, 64, BLOCK)
    x = make_input((64, 9), FP16).t()
    check_linear(mod, x, w, make_bias(200), scale_rule="floor")


@pytest.mark.parametrize("case", [c[0] for c in error_calls(mod, FMT, 128, BLOCK, "fp8_block")] + ["scale_rule"])
def test_argument_errors_name_the_argument(case):
    calls = {name: (call, word) for name, call, word in error_calls(mod, FMT, 128, BLOCK, "fp8_block")}
    calls["scale_rule"] = (lambda: mod.quantize_activation(make_input((2, 64)), scale_rule="round"), "scale_rule")
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
    w = make_weight(FMT, N, K, BLOCK)
    x = make_input((M, K), BF16, block=BLOCK)
    xq = check_quantize(mod, FMT, x)
    check_gemm(mod, xq, w, make_bias(N), BF16)
    # fp32 output shows the accumulation error alone (the bf16 operands are exact; the decode
    # kernel's 32-deep partials are fp8 MMA sums: tolerance())
    y = mod.gemm(xq, w, out_dtype=torch.float32)
    tol = tolerance(torch.float32, FMT, M) if fp8_mma(FMT, M) else 1e-4
    assert rel_err(y, formats.reference_linear(xq, w, out_dtype=torch.float32)) <= tol
    check_linear(mod, x, w, None)
