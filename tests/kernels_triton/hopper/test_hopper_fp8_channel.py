"""kernels_triton.hopper.fp8_channel (the sm_90 fp8_channel kernels) against the formats/ oracle.

What is checked:
- the two-stage per-token quantizer equals formats.quantize bit for bit (codes and scales), with
  dynamic and static scales, bf16 and fp16, zero / tiny / huge / NaN / Inf rows, and several
  K partials per row (Pk > 1), on any device;
- every route of sm_90 (132 SMs, the H200) launches exactly the kernels it names (record_launches)
  and its result is within conftest.gemm_bound of formats.reference_linear: decode with and without
  split-K, the portable tl.dot GEMM, the TMA prefill kernel, the K % 16 fallback. On the CPU the
  routes run under the interpreter (execute()); on an sm_90 GPU the same calls run the real kernels,
  and linear / gemm are checked there too (elsewhere they skip, naming the device);
- a row holding NaN/Inf makes that output row NaN and no other, on each GEMM kind;
- the route as data (kernels, why, errors), the quantizer's grid;
- the kernels build for sm_90 without a GPU (wgmma in the GEMMs, TMA copies in the prefill kernel,
  griddepcontrol in the PDL quantizers).

The bound (conftest.gemm_bound): products of e4m3 codes are exact; the fp32 (on Hopper's fp8 MMA:
128-product runs) accumulation, at most 6 fp32 roundings in the epilogue (sx * sw, the product,
the bias; split-K: the scaled partial and the ordered sum of at most K / 512 partials, inside the
K 2^-24 |x| . |w| term), one output rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

import formats
from _e4m3_testlib import assert_same_quantization, gemm_bound, make_bias, make_weight, special_values
from _sm90_build import PRELUDE, run_sm90_build
from conftest import DEVICE, assert_within_bound, device_name, make_input
from kernels_triton import record_launches
from kernels_triton._common import device_capability
from kernels_triton.hopper import fp8_channel as H
from kernels_triton.hopper._fp8_prefill import TENSOR_PREFILL_TILE

FMT = "fp8_channel"
BF16, FP16 = torch.bfloat16, torch.float16
SM90, H200_SMS = (9, 0), 132
_CAP = device_capability(DEVICE)  # None on the CPU (the interpreter)
# the hopper kernels (wgmma, TMA) run under the interpreter or on sm_90, nowhere else
needs_interp_or_sm90 = pytest.mark.skipif(
    _CAP is not None and tuple(_CAP) != SM90,
    reason=f"the sm_90 kernels run under the interpreter or on an sm_90 GPU; found {device_name()}")
needs_sm90 = pytest.mark.skipif(_CAP is None or tuple(_CAP) != SM90,
                                reason=f"hopper.fp8_channel.linear runs on an sm_90 GPU; found {device_name()}")


# ---------------------------------------------------------------------------------------------
# The quantizer, bit for bit
# ---------------------------------------------------------------------------------------------
def _rows_with_nonfinite(M: int, K: int, dtype) -> torch.Tensor:
    x = make_input((M, K), dtype)
    x[1, K // 3] = float("nan")
    x[2, K - 1] = float("inf")
    x[3, 0] = float("-inf")
    x[4] = 0.0
    return x


# plans (BLOCK_M, BLOCK_K, Pk): None the device's own; several K partials per row; Pk past the K tiles
PLANS = [None, (4, 32, 3), (1, 32, 7), (8, 64, 2), (16, 32, 99)]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_quantizer_matches_oracle_bit_for_bit(plan, dtype, scale):
    x = _rows_with_nonfinite(10, 200, dtype)
    opts = {} if scale is None else {"scale": scale}
    q = H._quantize(x, scale, plan)
    o = formats.quantize(x, FMT, role="activation", **opts)
    assert_same_quantization(q, o)
    assert bool(o.data.view(torch.uint8)[5:].ne(0).any())  # not a comparison of zeros alone
    if scale is None:  # the non-finite rows' scales are NaN, the zero row's the floor over 448
        assert bool(q.scale[1:4].isnan().all()) and bool(torch.isfinite(q.scale[4:]).all())


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_quantizer_zero_tiny_huge_rows_and_saturation(dtype):
    x = special_values(12, 256, dtype, block=128)
    for plan in (None, (4, 64, 3)):
        assert_same_quantization(H._quantize(x, None, plan), formats.quantize(x, FMT, role="activation"))
        # a small static scale saturates most codes at +-448, as the oracle does
        assert_same_quantization(H._quantize(x, 1e-3, plan), formats.quantize(x, FMT, role="activation", scale=1e-3))


def test_quantize_activation_strided_and_leading_dims():
    x = make_input((3, 4, 192), BF16)
    assert_same_quantization(H.quantize_activation(x), formats.quantize(x.reshape(12, 192), FMT, role="activation"))
    xt = make_input((96, 7), FP16, zero_blocks=False).t()  # non-contiguous [7, 96]
    assert_same_quantization(H.quantize_activation(xt), formats.quantize(xt, FMT, role="activation"))
    q = H.quantize_activation(make_input((0, 64)))
    assert q.data.shape == (0, 64) and q.scale.shape == (0,)
    with pytest.raises(ValueError, match="scale must be one finite positive number"):
        H.quantize_activation(make_input((2, 64)), scale=-1.0)


def test_quant_plan_spreads_k_over_more_programs_than_rows():
    """On the H200 (132 SMs) from M = 64 up: stage 1's grid holds at least one program per SM (or
    one per tile, where there are fewer tiles), and no program walks more than a quarter of a row;
    the lesson's quantizer gives each of the M programs the whole row twice."""
    for M in (64, 128, 256, 1024):
        for K in (4096, 8192):
            bm, bk, pk = H.quant_plan(M, K, False, H200_SMS)
            tiles = -(-M // bm) * -(-K // bk)
            programs = -(-M // bm) * pk
            longest_walk = -(-(-(-K // bk)) // pk) * bk  # K tiles of one stage-1 program, in elements
            assert programs >= min(H200_SMS, tiles) and longest_walk * 4 <= K, (M, K, bm, bk, pk)
            assert 1 <= pk <= H.MAX_PARTIALS
    assert H.quant_plan(16, 8192, True)[2] == 1  # the interpreter: one partial per row


# ---------------------------------------------------------------------------------------------
# Every route of sm_90 against the oracle
# ---------------------------------------------------------------------------------------------
# (M, N, K, scale, dtype, bias dtype, the GEMM kernel, split-K): decode split in two (N = 64: one
# 64-row tile, K = 1024: 8 K tiles), decode unsplit, the portable tl.dot GEMM past decode (with a
# static scale), the TMA prefill kernel, the portable GEMM where K % 16 != 0
CASES = [
    (1, 64, 1024, None, BF16, torch.float32, "fp8_decode_gemm_kernel", 2),
    (5, 40, 96, 0.05, FP16, torch.bfloat16, "fp8_decode_gemm_kernel", 1),
    (16, 72, 256, None, BF16, None, "fp8_decode_gemm_kernel", 1),
    (17, 72, 96, None, FP16, torch.float16, "_portable_gemm_kernel", 1),
    (130, 40, 256, 0.02, BF16, torch.float32, "_portable_gemm_kernel", 1),
    (300, 40, 64, None, BF16, torch.bfloat16, "fp8_prefill_kernel", 1),
    (300, 24, 40, None, FP16, None, "_portable_gemm_kernel", 1),
]


def _route(M, N, K, scale=None):
    return H.route(M, N, K, capability=SM90, sm_count=H200_SMS, scale=scale)


@needs_interp_or_sm90
@pytest.mark.parametrize("M,N,K,scale,dtype,bias_dtype,gemm_kernel,split", CASES)
def test_route_launches_its_kernels_and_matches_oracle(M, N, K, scale, dtype, bias_dtype, gemm_kernel, split):
    x = make_input((M, K), dtype)
    w = make_weight(FMT, N, K, 32)
    bias = None if bias_dtype is None else make_bias(N, bias_dtype)
    r = _route(M, N, K, scale)
    assert gemm_kernel in r.kernels and r.split_k == split
    assert ("splitk_reduce_kernel" in r.kernels) == (split > 1)
    assert ("_row_amax_kernel" in r.kernels) == (scale is None)
    with record_launches() as log:
        y = H.execute(r, x, w, bias, scale=scale, quant_plan_override=(4, 32, 3) if M > 16 else None)
    assert tuple(log) == r.kernels
    opts = {} if scale is None else {"scale": scale}
    ref = formats.reference_linear(x, w, bias, **opts)
    assert y.shape == (M, N) and y.dtype == dtype and ref.abs().max().item() > 0
    xq = formats.quantize(x.cpu(), FMT, role="activation", **opts)
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, dtype, ref), f"{gemm_kernel} M={M}")


@needs_interp_or_sm90
@pytest.mark.parametrize("M,N,K", [(7, 40, 96), (20, 40, 96), (260, 40, 64)])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_nonfinite_rows_stay_in_their_rows(M, N, K, scale):
    x = _rows_with_nonfinite(M, K, BF16)
    w = make_weight(FMT, N, K, 32)
    bias = make_bias(N)
    y = H.execute(_route(M, N, K, scale), x, w, bias, scale=scale)
    assert bool(y[1:4].isnan().all()), "a NaN/Inf row must give a NaN output row"
    keep = [0] + list(range(4, M))
    opts = {} if scale is None else {"scale": scale}
    ref = formats.reference_linear(x[keep], w, bias, **opts)
    xq = formats.quantize(x[keep].cpu(), FMT, role="activation", **opts)
    assert_within_bound(y[keep], ref, gemm_bound(xq, w, bias, BF16, ref), "finite rows")
    # the zero row (4) gives the bias exactly, rounded once
    assert torch.equal(y[4], bias.to(BF16))


@needs_interp_or_sm90
def test_row_and_column_scales_meet_their_own_rows_and_columns():
    """Rows 10^3 apart and columns 10^2 apart: a scale applied to the wrong row or column is off by
    orders of magnitude; each GEMM kind (decode, portable, prefill)."""
    K, N = 64, 24
    row = torch.tensor([1e-3, 1.0, 1e3], device=DEVICE)
    col = torch.tensor([1e-2, 1.0, 1e2], device=DEVICE).repeat(N // 3)
    w = formats.quantize((make_input((N, K), BF16, zero_blocks=False).float() * col[:, None]).to(BF16), FMT,
                         role="weight")
    for M in (3, 18, 258):
        x = (make_input((M, K), BF16, zero_blocks=False).float() * row.repeat(M // 3 + 1)[:M, None]).to(BF16)
        y = H.execute(_route(M, N, K), x, w)
        ref = formats.reference_linear(x, w)
        xq = formats.quantize(x.cpu(), FMT, role="activation")
        assert_within_bound(y, ref, gemm_bound(xq, w, None, BF16, ref), f"M={M}")


# ---------------------------------------------------------------------------------------------
# The route as data
# ---------------------------------------------------------------------------------------------
def test_route_names_kernels_and_why():
    r = _route(1, 8192, 8192)
    assert r.impl == "hopper" and r.kernels[:3] == ("_row_amax_kernel", "_quantize_kernel", "fp8_decode_gemm_kernel")
    assert "swapped wgmma decode kernel" in r.why and "per-row amax partials" in r.why
    r = _route(4096, 8192, 8192, scale=0.1)
    assert r.kernels == ("_quantize_kernel", "fp8_prefill_kernel") and dict(r.options)["config"] == TENSOR_PREFILL_TILE
    assert "TMA-descriptor prefill kernel" in r.why and "static scale" in r.why
    r = _route(128, 8192, 8192)
    assert r.kernels[-1] == "_portable_gemm_kernel" and r.split_k == 1 and dict(r.options)["config"].SPLIT_K == 1
    assert H.route(4096, 8192, 8192, capability=SM90, sm_count=H200_SMS, tma_aligned=False).kernels[-1] == \
        "_portable_gemm_kernel"
    assert _route(0, 64, 64).kernels == ()
    assert _route(3, 0, 64).kernels == ("_row_amax_kernel", "_quantize_kernel")


def test_route_kernels_exist_in_the_module():
    import triton

    from kernels_triton.hopper import _fp8_decode, _fp8_prefill, _twopass
    names = {n for m in (H, _fp8_decode, _fp8_prefill, _twopass) for n, o in vars(m).items()
             if isinstance(o, triton.runtime.jit.KernelInterface) and n.endswith("_kernel")}
    for M in (1, 16, 17, 64, 256, 257, 4096):
        for scale in (None, 0.1):
            assert set(_route(M, 1024, 2048, scale).kernels) <= names


@pytest.mark.parametrize("cap", [None, (8, 9), (12, 0), (10, 0)])
def test_route_refuses_other_devices_and_a16(cap):
    with pytest.raises(ValueError, match="kernels_triton.hopper.fp8_channel runs on sm_90 only"):
        H.route(16, 64, 64, capability=cap, sm_count=1)
    with pytest.raises(ValueError, match="a16=True .* got 'fp8_channel'"):
        H.route(16, 64, 64, capability=SM90, sm_count=1, a16=True)


@pytest.mark.skipif(_CAP is not None and tuple(_CAP) == SM90,
                    reason="on sm_90 linear runs (test_linear_on_sm90_matches_oracle)")
def test_linear_and_gemm_refuse_a_device_that_is_not_sm90():
    w = make_weight(FMT, 8, 64, 32)
    with pytest.raises(ValueError, match="kernels_triton.hopper.fp8_channel runs on sm_90 only, got a tensor on"):
        H.linear(make_input((2, 64)), w)
    xq = formats.quantize(make_input((2, 64)), FMT, role="activation")
    with pytest.raises(ValueError, match="kernels_triton.hopper.fp8_channel runs on sm_90 only"):
        H.gemm(xq, w)


def test_linear_checks_its_arguments_first():
    w = make_weight(FMT, 8, 64, 32)
    with pytest.raises(ValueError, match="K"):
        H.linear(make_input((2, 32)), w)
    with pytest.raises(ValueError, match="fp8_channel"):
        H.linear(make_input((2, 64)), formats.quantize(make_input((8, 64)), "fp8_tensor", role="weight"))


def test_the_registry_serves_fp8_channel_with_hopper_on_sm90():
    from dispatch import registry
    from dispatch.devices import KNOWN_DEVICES

    c = registry.choose("fp8_channel", 16, 4096, 4096, KNOWN_DEVICES["h200"])
    assert c.impl == "hopper", c.reason


# ---------------------------------------------------------------------------------------------
# On sm_90: linear and gemm themselves
# ---------------------------------------------------------------------------------------------
@needs_sm90
@pytest.mark.parametrize("M", [1, 16, 17, 128, 300, 2048])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_linear_on_sm90_matches_oracle(M, scale):
    N, K = 256, 1024
    x = make_input((M, K), BF16)
    w = make_weight(FMT, N, K, 32)
    bias = make_bias(N)
    opts = {} if scale is None else {"scale": scale}
    with record_launches() as log:
        y = H.linear(x, w, bias, **opts)
    r = H.route(M, N, K, capability=SM90, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                scale=scale)
    assert tuple(log) == r.kernels
    ref = formats.reference_linear(x, w, bias, **opts)
    xq = formats.quantize(x.cpu(), FMT, role="activation", **opts)
    assert_within_bound(y, ref, gemm_bound(xq, w, bias, BF16, ref), f"linear M={M}")
    xqd = H.quantize_activation(x, **opts)  # the oracle's bits (test_quantizer_matches_oracle_bit_for_bit)
    yg = H.gemm(xqd, w, bias, out_dtype=torch.float32)
    ref32 = formats.reference_linear(xqd, w, bias, out_dtype=torch.float32)
    assert_within_bound(yg, ref32, gemm_bound(xq, w, bias, torch.float32, ref32), f"gemm M={M}")


# ---------------------------------------------------------------------------------------------
# The sm_90 build, without a GPU
# ---------------------------------------------------------------------------------------------
_BUILD = PRELUDE + r'''
from kernels_triton.hopper import _fp8_decode as D, _fp8_prefill as P, fp8_channel as H
from kernels_triton import fp8_channel as L
cfg = D.decode_config(16, 8192, 8192, D.TENSOR_SCALE, 132)
sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*fp32",
       "y_ptr": "*bf16", "ws_ptr": "*fp32", **i32("M N K K_PER stride_xm stride_wn stride_ym stride_sxm stride_sxk stride_swn stride_swk")}
for split in (1, 2):
    ce = dict(HAS_BIAS=True, IMPRECISE_ACC=128, SCALE_K=0, BLOCK_N=cfg.BLOCK_N, BLOCK_M=16, BLOCK_K=cfg.BLOCK_K,
              SPLIT_K=split, DOT_FP8=True, ROUND_BF16=False, USE_PDL=True, CHANNEL=True)
    rows[f"decode{split}"] = build(D.fp8_decode_gemm_kernel, sig, ce, num_warps=cfg.num_warps,
                                   num_stages=cfg.num_stages, launch_pdl=True)
c = P.TENSOR_PREFILL_TILE
sig = {"x_desc": f"tensordesc<fp8e4nv[{c.BLOCK_M}, {c.BLOCK_K}]>", "w_desc": f"tensordesc<fp8e4nv[{c.BLOCK_N}, {c.BLOCK_K}]>",
       "sx_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16",
       **i32("M N K stride_ym stride_sxm stride_sxk stride_swn stride_swk")}
ce = dict(HAS_BIAS=True, SCALE_K=0, IMPRECISE_ACC=128, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
          GROUP_M=c.GROUP_M, DOT_FP8=True, ROUND_BF16=False, CHANNEL=True)
rows["prefill"] = build(P.fp8_prefill_kernel, sig, ce, num_warps=c.num_warps, num_stages=c.num_stages)
c = H._gemm_plan(128, 8192, 8192, 132, True)[1]
sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*fp32",
       "y_ptr": "*bf16", **i32("M N K stride_xm stride_xk stride_wn stride_wk stride_ym stride_yn")}
ce = dict(HAS_BIAS=True, DOT_FP8=True, ROUND_BF16=False, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
          GROUP_M=c.GROUP_M, IMPRECISE_ACC=128)
rows["portable"] = build(L._portable_gemm_kernel, sig, ce, num_warps=c.num_warps, num_stages=c.num_stages)
for M in (1, 128):
    bm, bk, pk = H.quant_plan(M, 8192, False, 132)
    rows[f"amax{M}"] = build(H._row_amax_kernel, {"x_ptr": "*bf16", "partials_ptr": "*fp32", **i32("M K stride_xm stride_xk")},
                             dict(BLOCK_M=bm, BLOCK_K=bk, USE_PDL=True), num_warps=4, launch_pdl=True)
    for static in (False, True):
        rows[f"quantize{M}{static}"] = build(
            H._quantize_kernel, {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32", "static_ptr": "*fp32",
                                 "partials_ptr": "*fp32", **i32("M K num_pk stride_xm stride_xk stride_qm stride_qk")},
            dict(STATIC_SCALE=static, BLOCK_M=bm, BLOCK_K=bk, PK_BLOCK=triton.next_power_of_2(pk), USE_PDL=True),
            num_warps=4, launch_pdl=True)
json.dump(rows, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_sm90_build_of_the_channel_kernels(tmp_path):
    """Compile-only (no GPU): the CHANNEL decode kernel (with and without split-K) and the portable
    GEMM issue wgmma, the CHANNEL prefill kernel wgmma and TMA copies with room for two CTAs per SM,
    the quantizers griddepcontrol (PDL)."""
    out = tmp_path / "build.json"
    run_sm90_build(["-c", _BUILD, out], tmp_path)
    rows = json.loads(out.read_text())
    for name in ("decode1", "decode2", "prefill", "portable"):
        assert rows[name]["wgmma"] > 0, f"{name}: no wgmma ({rows[name]})"
    assert rows["prefill"]["tma"] > 0, rows["prefill"]
    assert 2 * (rows["prefill"]["shared"] + 1024) <= 228 * 1024, rows["prefill"]
    for name, r in rows.items():
        if name.startswith(("amax", "quantize", "decode")):
            assert r["pdl"] > 0, f"{name}: no griddepcontrol ({r})"


@pytest.mark.parametrize("scale_k", [128, 32])
def test_channel_launchers_refuse_block_scales(scale_k):
    """The CHANNEL epilogue exists for per-tensor-shaped K loops only (scale_k 0): any other
    scale kind with channel=True is refused on the host, naming both."""
    from kernels_triton.hopper._fp8_decode import launch_fp8_decode
    from kernels_triton.hopper._fp8_prefill import launch_fp8_prefill

    xq = formats.quantize(make_input((4, 256)), FMT, role="activation")
    w = make_weight(FMT, 128, 256, 32)
    y = torch.empty((4, 128), dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match=rf"channel=True \(fp8_channel's row and column scales\) needs scale_k=0, "
                                         rf"got {scale_k}"):
        launch_fp8_decode(xq.data, w.data, xq.scale, w.scale, None, y, scale_k=scale_k, channel=True)
    if scale_k == 128:  # the prefill kernel takes 0 or 128
        with pytest.raises(ValueError, match=r"channel=True .* needs scale_k=0, got 128"):
            launch_fp8_prefill(xq.data, w.data, xq.scale, w.scale, None, y, scale_k=128, channel=True)
