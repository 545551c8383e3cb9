"""kernels_triton.mxfp4 against the formats oracle: W4A4 and W4A16.

Quantization must equal the oracle bit for bit (codes and E8M0 bytes), for both scale rules. The
GEMMs are checked against formats.reference_linear (float64, rounded once): the kernel's products
are exact and only its fp32 accumulation rounds, so rel_err <= 4e-3 (bf16 output, about one ulp)
and <= 1e-3 (fp16) leave a wide margin; fp32 outputs are held to 1e-5, which also catches an
activation rounded through bf16 in the W4A16 path (that costs ~1e-3).

The oracle runs on CPU copies (on CUDA, torch evaluates ``tensor / python_scalar`` as a multiply
by the fp32 reciprocal, so its results there are not the specification's).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, assert_within_bound, device_name, gemm_bound, make_input, rel_err

import formats
from formats.codecs import pack_e2m1
from kernels_triton import mxfp4
from kernels_triton.mxfp4 import mxfp4_dequantize_tile

FMT = "mxfp4"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOL = {BF16: 4e-3, FP16: 1e-3, FP32: 1e-5}
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason=f"needs a CUDA GPU; found {device_name()}")


def oracle_q(x, **opts):
    return formats.quantize(x.cpu(), FMT, role="activation", **opts)


def weight(n, k, dtype=BF16):
    return formats.quantize(make_input((n, k), dtype), FMT).to(DEVICE)


def cpu(t):
    return None if t is None else t.cpu()


def assert_same_quantization(q, ref):
    assert q.fmt == FMT and q.role == "activation" and q.shape == ref.shape and q.global_scale is None
    assert q.data.dtype == torch.uint8 and q.scale.dtype == torch.uint8
    assert torch.equal(q.data.cpu(), ref.data), "e2m1 codes differ from the oracle"
    assert torch.equal(q.scale.cpu(), ref.scale), "E8M0 scale bytes differ from the oracle"


# ---------------------------------------------------------------------------------------------
# quantize_activation: bit for bit
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k,dtype,rule", [
    (0, 32, BF16, "ceil"), (1, 32, FP16, "ceil"), (3, 96, BF16, "floor"), (16, 128, FP16, "ceil"),
    (100, 96, FP16, "floor"), (257, 384, BF16, "ceil"), (257, 32, FP16, "floor"),
])
def test_quantize_activation_matches_oracle_bit_for_bit(m, k, dtype, rule):
    x = make_input((m, k), dtype)
    assert_same_quantization(mxfp4.quantize_activation(x, scale_rule=rule), oracle_q(x, scale_rule=rule))


def test_quantize_activation_takes_leading_dims_and_strided_x():
    x = make_input((2, 3, 192), BF16)[..., ::2]  # [2, 3, 96], stride 2 along K
    assert not x.is_contiguous()
    assert_same_quantization(mxfp4.quantize_activation(x), oracle_q(x))
    xt = make_input((64, 5), FP16).T  # [5, 64] with strides (1, 5)
    assert_same_quantization(mxfp4.quantize_activation(xt, scale_rule="floor"), oracle_q(xt, scale_rule="floor"))


@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_quantize_activation_extreme_blocks(rule):
    # per row: a zero block (amax floor 2^-100 -> exponent -102 under both rules), a block of tiny
    # values (1e-30, and 1e-39: fp32 subnormals), huge values near bf16's top (exponent +125),
    # powers of two times 6 (the ceil rule's boundary), and values exactly on e2m1 midpoints (ties
    # to even).
    x = torch.zeros(4, 160)
    x[:, 32:48] = torch.randn(4, 16) * 1e-30
    x[:, 64:96] = torch.randn(4, 32) * 1e37
    x[:, 96:128] = 6.0 * 2.0 ** torch.randint(-20, 20, (4, 32)).float()
    x[:, 128:160] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * torch.where(
        torch.rand(4, 32) > 0.5, 1.0, -1.0)
    # a block below the amax floor (2^-100): exponent -102 and signed-zero codes (0x0 / 0x8). The
    # floor also keeps e >= -102, so E8M0's clamp at -127 is never reached from finite input.
    x = torch.cat([x, torch.randn(4, 32) * 1e-33], dim=1)
    x[:, 48:64] = torch.randn(4, 16) * 1e-39  # fp32 subnormals (exact in bf16) inside a 1e-30 block
    x = x.to(BF16).to(DEVICE)
    q = mxfp4.quantize_activation(x, scale_rule=rule)
    assert_same_quantization(q, oracle_q(x, scale_rule=rule))
    assert q.scale.cpu()[:, 0].tolist() == [127 - 102] * 4  # zero block: amax floor 2^-100 -> 2^-102 (both rules)
    assert q.scale.cpu()[:, -1].tolist() == [127 - 102] * 4
    assert set((q.data.cpu()[:, -16:] & 0x77).flatten().tolist()) == {0}


# ---------------------------------------------------------------------------------------------
# W4A4 gemm on identical quantized operands
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,has_bias,out_dtype", [
    (0, 40, 32, True, BF16),
    (1, 1, 32, True, BF16),
    (3, 40, 96, False, FP16),
    (16, 200, 128, True, FP32),
    (100, 40, 384, True, FP16),
    (257, 200, 96, False, BF16),
    (257, 1, 384, True, FP16),
])
def test_gemm_matches_reference_on_identical_operands(m, n, k, has_bias, out_dtype):
    xq = oracle_q(make_input((m, k), BF16)).to(DEVICE)
    qw = weight(n, k)
    bias = torch.randn(n, device=DEVICE) if has_bias else None
    y = mxfp4.gemm(xq, qw, bias, out_dtype=out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    if m:
        ref = formats.reference_linear(xq.to("cpu"), qw.to("cpu"), cpu(bias), out_dtype=out_dtype)
        assert ref.abs().max() > 0
        assert_within_bound(y, ref, gemm_bound(xq, qw, bias, out_dtype, ref))  # conftest: derived


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_r = tl.arange(0, BLOCK_R)
    v = mxfp4_dequantize_tile(data_ptr, scale_ptr, offs_r, offs_r < R, 0, K, K // 2, K // 32, BLOCK_R, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_r[:, None] * K + offs_k[None, :], v, mask=(offs_r[:, None] < R) & (offs_k[None, :] < K))


def test_gemm_tile_decoder_reads_element_2i_from_the_low_nibble():
    # Row 0: code 2 (1.0) at even K positions, code 12 (-2.0) at odd ones; other rows random codes
    # with E8M0 bytes across the range (2^-127 .. 2^100). K = 96 with BLOCK_K = 128 masks the tail.
    r, k = 5, 96
    codes = torch.randint(0, 16, (r, k), dtype=torch.uint8)
    codes[0] = torch.tensor([2, 12], dtype=torch.uint8).repeat(k // 2)
    scale = torch.randint(0, 228, (r, k // 32), dtype=torch.uint8)
    scale[0, 0] = 0  # 2^-127, a float32 subnormal
    q = formats.QuantizedTensor(FMT, "weight", pack_e2m1(codes), scale, None, (1, 32), (r, k))
    out = torch.empty(r, k, device=DEVICE)
    _dequantize_kernel[(1,)](q.data.to(DEVICE), scale.to(DEVICE), out, r, k, BLOCK_R=8, BLOCK_K=128)
    ref = formats.dequantize(q)
    assert ref[0, 0] > 0 and ref[0, 1] < 0
    assert torch.equal(out.cpu(), ref)


# ---------------------------------------------------------------------------------------------
# W4A16
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,dtype,has_bias,out_dtype", [
    (1, 40, 32, BF16, True, BF16),
    (3, 1, 96, FP16, False, FP16),
    (100, 200, 128, FP16, True, FP32),  # fp32 output: an fp16 x rounded to bf16 would fail 1e-5
    (257, 40, 384, BF16, False, FP32),
    (0, 40, 64, FP16, True, FP16),
])
def test_gemm_w4a16_matches_reference(m, n, k, dtype, has_bias, out_dtype):
    x = make_input((m, k), dtype)
    qw = weight(n, k)
    bias = torch.randn(n, device=DEVICE) if has_bias else None
    y = mxfp4.gemm_w4a16(x, qw, bias, out_dtype=out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    if m:
        ref = formats.reference_linear(x.cpu(), qw.to("cpu"), cpu(bias), a16=True, out_dtype=out_dtype)
        assert_within_bound(y, ref, gemm_bound(x, qw, bias, out_dtype, ref))  # x exact (fp16: hi + lo)


def test_gemm_w4a16_fp16_activations_with_weight_scales_beyond_fp16_range():
    # E8M0 bytes 127 + 40: decoded weights ~2^40, far outside fp16; fp16 x with full 11-bit
    # mantissas. Exact products need neither operand converted to fp16 nor x rounded to bf16.
    k, n = 64, 24
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.full((n, k // 32), 127 + 40, dtype=torch.uint8)
    qw = formats.QuantizedTensor(FMT, "weight", pack_e2m1(codes), scale, None, (1, 32), (n, k)).to(DEVICE)
    x = (1.0 + torch.rand(6, k) * 0.999).to(FP16).to(DEVICE)  # mantissa bits bf16 cannot hold
    y = mxfp4.gemm_w4a16(x, qw, out_dtype=FP32)
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), a16=True, out_dtype=FP32)
    assert ref.abs().max() > 2.0**40
    assert rel_err(y.cpu(), ref) <= TOL[FP32]


def test_w4a16_catches_a_swapped_nibble_order():
    # x is not decoded in W4A16, so a nibble swap in the weight decoder changes y: y must be the
    # reference and differ from the reference built on the swapped weight.
    k, n = 32, 8
    qw = weight(n, k)
    x = make_input((4, k), BF16, zero_blocks=False)
    y = mxfp4.gemm_w4a16(x, qw, out_dtype=FP32).cpu()
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), a16=True, out_dtype=FP32)
    d = qw.data.cpu()
    swapped = formats.QuantizedTensor(FMT, "weight", (d >> 4) | (d << 4), qw.scale.cpu(), None, (1, 32), (n, k))
    ref_swapped = formats.reference_linear(x.cpu(), swapped, a16=True, out_dtype=FP32)
    assert rel_err(y, ref) <= TOL[FP32]
    assert rel_err(y, ref_swapped) > 0.1


# ---------------------------------------------------------------------------------------------
# linear end to end
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,has_bias,a16,rule", [
    (BF16, True, False, "ceil"), (FP16, False, False, "floor"), (BF16, False, True, "ceil"), (FP16, True, True, "ceil"),
])
def test_linear_matches_reference_with_leading_dims(dtype, has_bias, a16, rule):
    k, n = 96, 40
    x = make_input((2, 3, k), dtype)
    qw = weight(n, k)
    bias = torch.randn(n, device=DEVICE, dtype=dtype) if has_bias else None
    y = mxfp4.linear(x, qw, bias, a16=a16, scale_rule=rule)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    opts = {} if a16 else {"scale_rule": rule}
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), cpu(bias), a16=a16, **opts)
    xa = x if a16 else formats.quantize(x.cpu(), "mxfp4", role="activation", **opts)
    assert_within_bound(y, ref, gemm_bound(xa, qw, bias, dtype, ref))


@pytest.mark.parametrize("a16", [False, True])
def test_linear_non_contiguous_x_and_empty_x(a16):
    k, n = 64, 200
    qw = weight(n, k)
    x = make_input((2 * k, 5), BF16).T[:, ::2]  # [5, 64] with strides (1, 10)
    ref = formats.reference_linear(x.cpu(), qw.to("cpu"), a16=a16)
    assert rel_err(mxfp4.linear(x, qw, a16=a16).cpu(), ref) <= TOL[BF16]
    y = mxfp4.linear(torch.empty(2, 0, k, dtype=FP16, device=DEVICE), qw, a16=a16)
    assert y.shape == (2, 0, n) and y.dtype == FP16


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    qw = weight(8, 64)
    x = make_input((4, 64), BF16)
    other_device = "cpu" if DEVICE == "cuda" else "meta"
    cases = [
        (lambda: mxfp4.linear(make_input((4, 48), BF16), qw), r"multiple of 32.*48"),
        (lambda: mxfp4.linear(make_input((4, 96), BF16), qw), r"x\.shape\[-1\].*K=64.*96"),
        (lambda: mxfp4.linear(x.float(), qw, a16=True), r"x must be bfloat16 or float16.*float32"),
        (lambda: mxfp4.linear(x, qw, torch.zeros(9, device=DEVICE)), r"bias.*\(8,\).*\(9,\)"),
        (lambda: mxfp4.linear(x, formats.quantize(torch.randn(8, 64), "nvfp4").to(DEVICE)), r"qweight.*mxfp4.*nvfp4"),
        (lambda: mxfp4.linear(x.to(other_device), qw), r"x must be on the weight's device"),
        (lambda: mxfp4.quantize_activation(x, scale_rule="round"), r"scale_rule.*'round'"),
        (lambda: mxfp4.gemm(oracle_q(x).to(DEVICE), qw, out_dtype=torch.int8), r"out_dtype.*int8"),
        (lambda: mxfp4.gemm(oracle_q(make_input((4, 32), BF16)).to(DEVICE), qw), r"xq has K=32.*K=64"),
        (lambda: mxfp4.gemm(x, qw), r"xq must be a mxfp4 activation"),
        (lambda: mxfp4.gemm_w4a16(make_input((2, 4, 64), BF16), qw), r"x2d must be 2-D"),
        (lambda: mxfp4.gemm_w4a16(x, qw, out_dtype=torch.float64), r"out_dtype.*float64"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


# ---------------------------------------------------------------------------------------------
# GPU-only large shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@on_gpu
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (1, 8192, 8192), (16, 8192, 8192)])
def test_large_shapes_on_gpu(m, n, k):
    x = make_input((m, k), BF16)
    qw = weight(n, k)
    xq = mxfp4.quantize_activation(x)
    if m <= 16:
        assert_same_quantization(xq, oracle_q(x))
    y = mxfp4.gemm(xq, qw, out_dtype=BF16)
    assert rel_err(y, formats.reference_linear(xq, qw, out_dtype=BF16)) <= TOL[BF16]
    assert torch.equal(mxfp4.linear(x, qw), y)
    xh = x.to(FP16)
    y16 = mxfp4.gemm_w4a16(xh, qw, out_dtype=FP16)
    assert rel_err(y16, formats.reference_linear(xh, qw, a16=True, out_dtype=FP16)) <= TOL[FP16]
