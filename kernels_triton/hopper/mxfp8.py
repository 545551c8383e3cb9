"""MXFP8 (OCP MX: e4m3 elements, one E8M0 scale per 32 along K) on Hopper (sm_90): the production
kernels and their route.

The lesson (``kernels_triton.mxfp8``) teaches this GEMM; this module runs it on the H200:

    quantize   the lesson's per-block quantizer (mxfp8.mxfp8_quantize_tile), with PDL (_pdl)
    M <= 16    a swapped-operand wgmma decode kernel (the weight on wgmma's 64-row side), chosen by
               ``decode_kernel``:
                 "bf16" (default)  _e4m3_decode: the weight dequantized to bf16 in registers, one
                                   bf16 dot per K step; at M <= DECODED_ACT_MAX_M the quantizer
                                   writes the dequantized activation itself (act_decoded_kernel)
                 "fp8"             _fp8_decode with 32-wide scale blocks: four 32-deep e4m3 wgmmas
                                   per 128-K step, each partial times 2^ew * 2^ex (the sum inside
                                   a partial is the fp8 wgmma's: bounded, not bit-identical)
               split-K by the SM count, then the ordered reduction when it splits
    M <= 128   the lesson's dequantize-in-registers GEMM, 64-deep K steps, split-K at M <= 64
               (hopper._tiles.e4m3_config)
    M > 128    a pre-pass dequantizing each operand once into bf16 (_dequantize_kernel), then the
               bf16 GEMM of _twopass

W8A16 (``linear(a16=True)``, ``gemm_w8a16``; the "mxfp8_w8a16" variant: x stays bf16/fp16, only
the weight is MXFP8) takes the FP4 W4A16 routes' choices (hopper._fp4_route), with this module's and
_e4m3_decode's kernels; nothing is quantized:

    M <= 16, bf16 x    act_decoded_kernel (A16) lays x out in the decode GEMM's dot order, then
                       e4m3_decode_gemm_kernel as above, split-K, the ordered reduction
    M <= 128           _gemm_kernel (A16): the weight tile dequantized in registers, x's tile
                       dotted as it is; split-K at M <= 64
    M > 128, bf16 x    _dequantize_kernel on the weight once, then the bf16 GEMM on x
    fp16 x, every M    _gemm_kernel (A16, SPLIT_A16): fp16 has 11 significant bits, so x is dotted
                       as its exact bf16 hi and lo halves (a bf16 copy, which the decode GEMM and
                       the pre-pass would dot, rounds it); the tile of M = 128 above 128 rows

Every product (bf16 x, or a half of fp16 x, times code * 2^e: at most 8 + 4 significant bits) is
exact in the fp32 accumulator, as in the lesson's W8A16 kernel (kernels_triton.mxfp8).

``route`` is that table as data; ``linear`` computes it once and launches exactly its kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats._mx import SCALE_RULES
from formats.constants import MX_BLOCK

from .._codecs import dequantize_e4m3, dequantize_e8m0, grouped_tile
from .._common import (check_activation, check_bias, check_gemm_operands, check_out_dtype, check_weight,
                       flatten_rows, interpreting, kernel_bias, launch)
from ..mxfp8 import mxfp8_quantize_tile as mx_e4m3_quantize
from ..tuning import quant_config
from ._route import Route, TileConfig, check_device, check_route, sm_count
from . import supported  # noqa: F401  (each format module answers supported(capability))
from ._e4m3_decode import DECODE_MAX_M, decode_tile, launch_e4m3_decode, launch_e4m3_decode_linear
from ._fp8_decode import MX_SCALE, launch_fp8_decode
from ._fp8_decode import decode_config as fp8_decode_config
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._tiles import PREPASS_MIN_M, e4m3_config
from ._twopass import (NO_ALPHA, epilogue, launch_bf16_gemm, launch_splitk_reduce, scratch_dtype, splitk_plan,
                       splitk_workspace, store_splitk_partial)

FMT = "mxfp8"
K_MULTIPLE = MX_BLOCK  # 32
VEC_SIZE = tl.constexpr(MX_BLOCK)  # elements per E8M0 scale
DECODE_KERNELS = ("bf16", "fp8")  # M <= 16: _e4m3_decode or _fp8_decode (module docstring)
# decode with the "bf16" kernel, M <= this: the quantizer writes the dequantized activation
# (act_decoded_kernel); above, codes and scales as gemm (faster at M = 1, slower at M = 16 on
# the H200; docs/perf_notes.md)
DECODED_ACT_MAX_M = 1
PORTABLE_BLOCK_K = 64  # the fused kernel's K step: the dequantized tiles live in registers before the dot
X_DTYPES = (torch.bfloat16, torch.float16)  # the activations linear takes (W8A8 quantizes them; W8A16 dots them)


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr, q_ptr, s_ptr,
    # dimensions
    M, num_groups,
    # strides
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
    # meta-parameters
    FLOOR_RULE: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    """Per 1x32 block: e from the block amax (ceil or floor rule), q = e4m3(x * 2^-e), s = e + 127."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)           # [BLOCK_M]
    offs_g = pid_k * GROUPS + tl.arange(0, GROUPS)              # [GROUPS] block index along K
    offs_k = offs_g[:, None] * VEC_SIZE + tl.arange(0, VEC_SIZE)[None, :]  # [GROUPS, 32]
    mask = (offs_m < M)[:, None, None] & (offs_g < num_groups)[None, :, None]
    pdl_wait(USE_PDL)  # x is the previous kernel's output
    # x tile [BLOCK_M, GROUPS, 32]: the last axis is one scale block, so its amax is one reduction
    x_off = offs_m[:, None, None].to(tl.int64) * stride_xm + offs_k[None, :, :].to(tl.int64) * stride_xk
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    q, s = mx_e4m3_quantize(x, FLOOR_RULE)  # codes [BLOCK_M, GROUPS, 32], E8M0 bytes [BLOCK_M, GROUPS]
    pdl_launch_dependents(USE_PDL)
    q_off = offs_m[:, None, None].to(tl.int64) * stride_qm + offs_k[None, :, :].to(tl.int64) * stride_qk
    tl.store(q_ptr + q_off, q, mask=mask)
    s_off = offs_m[:, None].to(tl.int64) * stride_sm + offs_g[None, :] * stride_sk
    tl.store(s_ptr + s_off, s, mask=(offs_m < M)[:, None] & (offs_g < num_groups)[None, :])


@triton.jit
def _dequantize_tile(q_ptr, s_ptr, rows, r_ok, k0, K, stride_qr, stride_qk, stride_sr, stride_sk,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rows`` x K columns [k0, k0 + BLOCK_K) of an MXFP8 matrix, decoded: fp32 [BLOCK_R, BLOCK_K].
    One scale byte is loaded per 32 elements and broadcast over its block by a reshape (loading it
    per element costs one load instruction per element)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + r64 * stride_qr + offs_k[None, :] * stride_qk,
                mask=r_ok[:, None] & (offs_k[None, :] < K), other=0)
    offs_g = k0 // VEC_SIZE + tl.arange(0, BLOCK_K // VEC_SIZE)
    sc = tl.load(s_ptr + r64 * stride_sr + offs_g[None, :] * stride_sk,
                 mask=r_ok[:, None] & (offs_g[None, :] < K // VEC_SIZE), other=127)
    v = dequantize_e4m3(q).reshape(BLOCK_R, BLOCK_K // VEC_SIZE, VEC_SIZE) * dequantize_e8m0(sc)[:, :, None]
    return v.reshape(BLOCK_R, BLOCK_K)


@triton.jit
def _gemm_kernel(
    # pointers
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr,
    ws_ptr,  # SPLIT_K > 1: fp32 workspace [SPLIT_K, M, N]; _twopass reduces it and adds the bias
    # dimensions
    M, N, K, K_PER,  # K_PER: K elements per split (a multiple of BLOCK_K; K when SPLIT_K == 1)
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_sxm, stride_sxk, stride_swn, stride_swk, stride_ym, stride_yn,
    # meta-parameters
    HAS_BIAS: tl.constexpr, DOT_BF16: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
    A16: tl.constexpr = False,  # W8A16: x is the bf16/fp16 activation itself; sx unused
    SPLIT_A16: tl.constexpr = False,  # A16 with fp16 x on a GPU: dot its exact bf16 hi and lo halves
):
    """One [BLOCK_M, BLOCK_N] tile of y. x/w codes and sx/sw E8M0 bytes are all uint8 (A16: x is
    bf16/fp16, any strides)."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the 32-element scale block")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER
    pdl_wait(USE_PDL)  # the quantized activation
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        if A16:
            # x as it is: a bf16 x times code * 2^e is exact in the bf16 dot; fp16 x (11 significant
            # bits) is x_hi + x_lo, both exact in bf16 (the remainder has <= 3 significant bits)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xa = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                         mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
            b = _dequantize_tile(w_ptr, sw_ptr, offs_n, n_ok, k0, K, stride_wn, stride_wk, stride_swn, stride_swk,
                                 BLOCK_N, BLOCK_K)
            if SPLIT_A16:
                b_t = tl.trans(b.to(tl.bfloat16))
                x_hi = xa.to(tl.float32).to(tl.bfloat16)
                acc = tl.dot(x_hi, b_t, acc)
                acc = tl.dot((xa.to(tl.float32) - x_hi.to(tl.float32)).to(tl.bfloat16), b_t, acc)
            elif DOT_BF16:
                acc = tl.dot(xa.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), acc)
            else:  # the interpreter: fp32 operands (exact; its bf16 dot is wrong)
                acc = tl.dot(xa.to(tl.float32), tl.trans(b), acc)
        else:
            # code * 2^e for both tiles (K is a multiple of 32; BLOCK_K need not divide it: masked)
            a = _dequantize_tile(x_ptr, sx_ptr, offs_m, m_ok, k0, K, stride_xm, stride_xk, stride_sxm, stride_sxk,
                                 BLOCK_M, BLOCK_K)
            b = _dequantize_tile(w_ptr, sw_ptr, offs_n, n_ok, k0, K, stride_wn, stride_wk, stride_swn, stride_swk,
                                 BLOCK_N, BLOCK_K)
            if DOT_BF16:
                # exact: code * 2^e has 4 significant bits (see the module docstring)
                acc = tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    pdl_launch_dependents(USE_PDL)

    if SPLIT_K > 1:  # a partial sum of this K range; the bias comes in the reduction
        store_splitk_partial(ws_ptr, acc, pid_k, offs_m, offs_n, M, N, m_ok[:, None] & n_ok[None, :])
        return

    # ----- epilogue: bias, cast, store (all scales were applied in the K loop) -----
    # (ROUND_BF16: the interpreter's fp32 -> bf16 cast truncates, so round to nearest even first)
    # (NO_ALPHA: every scale was applied in the K loop, so the two scale pointers are unused)
    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, R, K, stride_qr, stride_qk, stride_sr, stride_sk, stride_or,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pre-pass for large M: out [R, K] = code * 2^e, the GEMM's own _dequantize_tile, stored once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    r_ok = rows < R
    v = _dequantize_tile(q_ptr, s_ptr, rows, r_ok, k0, K, stride_qr, stride_qk, stride_sr, stride_sk, BLOCK_R, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + offs_k[None, :], v.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (offs_k[None, :] < K))


def _dequantize(q, s) -> torch.Tensor:
    """Dequantized [R, K] (bf16 on GPU, exact; fp32 in the interpreter) of MXFP8 codes q and scales s."""
    R, K = q.shape
    out = torch.empty((R, K), dtype=scratch_dtype(), device=q.device)
    if R:
        br, bk = (min(64, triton.next_power_of_2(R)), min(512, max(32, triton.next_power_of_2(K)))) \
            if interpreting() else (32, 128)
        launch(_dequantize_kernel, (triton.cdiv(R, br), triton.cdiv(K, bk)),
               q, s, out, R, K, q.stride(0), q.stride(1), s.stride(0), s.stride(1), out.stride(0),
               BLOCK_R=br, BLOCK_K=bk, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# The route: which kernels, which tile, why
# ---------------------------------------------------------------------------------------------
def _check_decode_kernel(decode_kernel) -> None:
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")


def _gemm_plan(M: int, N: int, K: int, n_sms: int, decode_kernel: str) -> tuple[str, TileConfig, str]:
    """(GEMM kind "decode_bf16" | "decode_fp8" | "prepass" | "portable", its tile, why) for M >= 1."""
    if M <= DECODE_MAX_M:
        if decode_kernel == "fp8":
            return "decode_fp8", fp8_decode_config(M, N, K, MX_SCALE, n_sms), \
                f"M={M} <= {DECODE_MAX_M}, decode_kernel='fp8': 32-deep fp8 wgmmas per scale block, split-K by the SM count ({n_sms})"
        return "decode_bf16", decode_tile(M, N, K, n_sms), \
            f"M={M} <= {DECODE_MAX_M}, decode_kernel='bf16': the weight dequantized to bf16 in registers, split-K by the SM count ({n_sms})"
    cfg = e4m3_config(M, N, K, block_k=PORTABLE_BLOCK_K, prepass=True)
    if cfg.PREPASS:
        return "prepass", cfg, f"M={M} > 128: dequantize each operand once into bf16, then the bf16 GEMM"
    return "portable", cfg, f"16 < M={M} <= 128: the dequantize-in-registers GEMM (split-K at M <= 64)"


def _gemm_kernels(kind: str, cfg: TileConfig, K: int) -> tuple[tuple[str, ...], int]:
    """(kernel names, split-K launched) of a GEMM plan."""
    if kind == "prepass":
        return ("_dequantize_kernel", "_dequantize_kernel", "bf16_gemm_kernel"), 1
    n_split = splitk_plan(K, cfg)[0]
    gemm = {"decode_bf16": "e4m3_decode_gemm_kernel", "decode_fp8": "fp8_decode_gemm_kernel"}.get(kind, "_gemm_kernel")
    return (gemm,) + (("splitk_reduce_kernel",) if n_split > 1 else ()), n_split


def _a16_plan(M: int, N: int, K: int, n_sms: int, x_dtype: torch.dtype) -> tuple[str, TileConfig, str]:
    """(W8A16 GEMM kind "a16_decode" | "a16_fused" | "a16_prepass", its tile, why) for M >= 1: the
    choices of the FP4 W4A16 routes (hopper._fp4_route), for the same reasons."""
    if M <= DECODE_MAX_M and x_dtype == torch.bfloat16:
        return "a16_decode", decode_tile(M, N, K, n_sms), (
            f"W8A16 bf16 at M={M} <= {DECODE_MAX_M}: act_decoded_kernel lays x out in the dot order, then the swapped "
            f"decode GEMM (the e4m3 weight decoded to bf16 in registers), split-K by the SM count ({n_sms})")
    fp16 = x_dtype == torch.float16
    # fp16 x keeps the fused kernel at every M: it dots x's exact bf16 hi and lo halves, where the
    # decode GEMM and the pre-pass would dot a bf16 copy of x (rounded)
    cfg = e4m3_config(min(M, PREPASS_MIN_M) if fp16 else M, N, K, block_k=PORTABLE_BLOCK_K, prepass=True)
    if cfg.PREPASS:
        return "a16_prepass", cfg, (
            f"W8A16 bf16 at M={M} > {PREPASS_MIN_M}: the weight dequantized once into bf16 (_dequantize_kernel), then "
            f"the bf16 GEMM on x as it is (the fused kernel would decode every weight tile M / BLOCK_M times)")
    if fp16:
        how = (f"fp16 at M={M}: the fused dequantize-in-registers kernel with x's exact hi/lo bf16 halves (two "
               f"dots per K step){' on the tile of M = 128' if M > PREPASS_MIN_M else ''}")
    else:
        how = (f"bf16 at {DECODE_MAX_M} < M={M} <= {PREPASS_MIN_M}: the fused dequantize-in-registers kernel on x "
               f"as it is")
    split = ", split-K" if splitk_plan(K, cfg)[0] > 1 else ""
    return "a16_fused", cfg, f"W8A16 {how}{split}"


def _a16_kernels(kind: str, cfg: TileConfig, K: int) -> tuple[tuple[str, ...], int]:
    """(kernel names, split-K launched) of a W8A16 plan."""
    if kind == "a16_prepass":
        return ("_dequantize_kernel", "bf16_gemm_kernel"), 1
    gemm, n_split = _gemm_kernels("decode_bf16" if kind == "a16_decode" else "portable", cfg, K)
    return (("act_decoded_kernel",) if kind == "a16_decode" else ()) + gemm, n_split


def _check_a16_options(decode_kernel: str, x_dtype) -> None:
    _check_decode_kernel(decode_kernel)
    if decode_kernel != "bf16":
        raise ValueError(f"decode_kernel must be 'bf16' with a16=True (the 'fp8' kernel dots e4m3 activation codes; "
                         f"W8A16 keeps x in bf16/fp16), got {decode_kernel!r}")
    if x_dtype not in X_DTYPES:
        raise ValueError(f"x_dtype must be torch.bfloat16 or torch.float16, got {x_dtype}")


def route(M: int, N: int, K: int, *, capability, sm_count: int, a16: bool = False, scale_rule: str = "ceil",
          decode_kernel: str = "bf16", x_dtype: torch.dtype = torch.bfloat16) -> Route:
    """The kernels ``linear`` launches for an [M, K] x [N, K]^T mxfp8 problem on sm_90.

    W8A16 (``a16=True``: x stays bf16/fp16, only the weight is MXFP8) follows the FP4 W4A16 routes
    (hopper._fp4_route): bf16 x at M <= 16 takes the swapped decode GEMM on x laid out in its dot
    order (act_decoded_kernel with A16, then e4m3_decode_gemm_kernel, split-K); M <= 128 the fused
    dequantize-in-registers _gemm_kernel (split-K at M <= 64); bf16 x above 128 rows the weight
    dequantized once into bf16, then the bf16 GEMM (the fused kernel would decode each weight
    tile M / BLOCK_M times). fp16 x takes the fused kernel at every M, dotting its exact bf16
    hi and lo halves (a bf16 copy of x, which the decode GEMM and the pre-pass dot, would round it).

    Args:
        M, N, K: the problem (K a multiple of 32).
        capability: the device's (major, minor); must be (9, 0) (``supported``).
        sm_count: the device's SM count (the decode kernels' split-K target).
        a16: W8A16 (x used as it is), the "mxfp8_w8a16" variant.
        scale_rule: ``linear``'s activation option ("ceil" or "floor"); it does not change the route.
        decode_kernel: "bf16" or "fp8", the M <= 16 kernel (module docstring); "bf16" with a16.
        x_dtype: the activation dtype, torch.bfloat16 or torch.float16 with a16 (it changes the W8A16
            route only; unused, unchecked without a16).
    Returns:
        Route(impl="hopper", kernels, tile, split_k, why).
    Raises:
        ValueError: a capability other than sm_90 (naming it and why), a negative size, an unknown
            scale_rule or decode_kernel; with a16=True, decode_kernel="fp8" or an x_dtype other than
            bf16 / fp16.
    """
    check_route(FMT, capability, a16, M, N, K)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    _check_decode_kernel(decode_kernel)
    if a16:
        _check_a16_options(decode_kernel, x_dtype)
    if M == 0 or N == 0:
        return Route("hopper", (), "", 1, "M=0 or N=0: nothing to launch")
    if a16:
        kind, cfg, why = _a16_plan(M, N, K, sm_count, x_dtype)
        kernels, n_split = _a16_kernels(kind, cfg, K)
        return Route("hopper", kernels, str(cfg), n_split, why, (("gemm", kind), ("config", cfg)))
    kind, cfg, gwhy = _gemm_plan(M, N, K, sm_count, decode_kernel)
    kernels, n_split = _gemm_kernels(kind, cfg, K)
    if kind == "decode_bf16" and M <= DECODED_ACT_MAX_M:
        kind, quant = "decode_bf16_act", ("act_decoded_kernel",)
        gwhy += f"; M <= {DECODED_ACT_MAX_M}: the quantizer writes the dequantized activation"
    else:
        quant = ("_quantize_kernel",)
    return Route("hopper", quant + kernels, str(cfg), n_split, gwhy, (("gemm", kind), ("config", cfg)))


def tile_config(M: int, N: int, K: int, device=None, *, decode_kernel: str = "bf16") -> TileConfig:
    """The GEMM tile ``gemm`` launches for M rows on ``device`` (None: the current GPU)."""
    _check_decode_kernel(decode_kernel)
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return _gemm_plan(max(M, 1), N, K, sm_count(dev), decode_kernel)[1]


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    """The lesson's quantize_activation (bit for bit ``formats.quantize(x, "mxfp8",
    role="activation", scale_rule=scale_rule)``) with PDL.

    Args:
        x: bfloat16/float16 [..., K], K a multiple of 32, any strides.
        scale_rule: "ceil" (default) or "floor" (OCP MX 6.3).
    Returns:
        QuantizedTensor(fmt="mxfp8", role="activation", data float8_e4m3fn [M, K], scale uint8 E8M0 [M, K/32]).
    Raises:
        ValueError: x not bf16/fp16, K not a positive multiple of 32, or an unknown scale_rule.
    """
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    check_activation(x, None, K_MULTIPLE, FMT)
    x2 = flatten_rows(x)
    M, K = x2.shape
    num_groups = K // MX_BLOCK
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, num_groups), dtype=torch.uint8, device=x.device)
    if M:
        block_m, block_k = quant_config(M, K, interpreting(), group=MX_BLOCK)
        groups = block_k // MX_BLOCK
        q = data.view(torch.uint8)
        launch(_quantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(num_groups, groups)),
               x2, q, scale, M, num_groups,
               x2.stride(0), x2.stride(1), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
               FLOOR_RULE=scale_rule == "floor", BLOCK_M=block_m, GROUPS=groups, **pdl_launch(x.device))
    return QuantizedTensor(FMT, "activation", data, scale, None, (1, MX_BLOCK), (M, K))


def _run_gemm(kind: str, cfg: TileConfig, xq, qweight, bias, y) -> torch.Tensor:
    """Launch one GEMM plan (not "decode_bf16_act") into y [M, N] (bias already kernel_bias's)."""
    if kind == "decode_bf16":
        return launch_e4m3_decode(xq.data.contiguous(), xq.scale.contiguous(), qweight.data.contiguous(),
                                  qweight.scale.contiguous(), bias, y, config=cfg)
    if kind == "decode_fp8":
        return launch_fp8_decode(xq.data.contiguous(), qweight.data.contiguous(), xq.scale, qweight.scale, bias, y,
                                 scale_k=MX_SCALE, config=cfg)
    x, w = xq.data.view(torch.uint8), qweight.data.view(torch.uint8)
    sx, sw = xq.scale, qweight.scale
    if kind == "prepass":
        return launch_bf16_gemm(_dequantize(x, sx), _dequantize(w, sw), y, bias=bias, config=cfg)
    return _launch_fused(x, sx, w, sw, bias, y, cfg)


def _launch_fused(x, sx, w, sw, bias, y, cfg: TileConfig) -> torch.Tensor:
    """_gemm_kernel (and split-K's reduction) into y [M, N]: x uint8 codes with E8M0 bytes sx, or
    (sx None, W8A16) the bf16/fp16 activation itself; w, sw the weight's uint8 codes and bytes."""
    M, N = y.shape
    K = w.shape[1]
    interp = interpreting()
    a16 = sx is None
    if a16:  # sx is an unused pointer argument; the weight's bytes stand in for it
        sx, stride_sx = sw, (0, 0)
    else:
        stride_sx = (sx.stride(0), sx.stride(1))
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    launch(_gemm_kernel, (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), n_split),
           x, w, sx, sw, bias if bias is not None else y, y, ws,
           M, N, K, k_per,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1),
           *stride_sx, sw.stride(0), sw.stride(1), y.stride(0), y.stride(1),
           HAS_BIAS=bias is not None, DOT_BF16=not interp, ROUND_BF16=interp and y.dtype == torch.bfloat16,
           BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
           SPLIT_K=n_split,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(y.device),
           **({"A16": True, "SPLIT_A16": x.dtype == torch.float16 and not interp} if a16 else {}))
    if n_split > 1:
        launch_splitk_reduce(ws, y, bias=bias)
    return y


def _run_a16(kind: str, cfg: TileConfig, x2, qweight, bias, y) -> torch.Tensor:
    """Launch one W8A16 plan (``_a16_plan``) on x2 [M, K] (bf16/fp16, any strides) into y [M, N]
    (bias already kernel_bias's). ValueError for fp16 x2 on a plan that dots a bf16 copy of x."""
    if kind in ("a16_decode", "a16_prepass") and x2.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 for the W8A16 route {kind!r} (it dots x as bf16; fp16 x takes the "
                         f"fused kernel: route(..., a16=True, x_dtype=torch.float16)), got {x2.dtype}")
    w, sw = qweight.data.view(torch.uint8), qweight.scale
    if kind == "a16_decode":
        return launch_e4m3_decode_linear(x2, w.contiguous(), sw.contiguous(), bias, y, config=cfg, a16=True)
    if kind == "a16_prepass":  # the bf16 GEMM's operands share one dtype: x as it is on a GPU, fp32 (exact) interpreted
        return launch_bf16_gemm(x2.to(scratch_dtype()), _dequantize(w, sw), y, bias=bias, config=cfg)
    return _launch_fused(x2, None, w, sw, bias, y, cfg)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, decode_kernel: str = "bf16") -> torch.Tensor:
    """y = dequant(xq) . dequant(qweight)^T (+ bias) on sm_90, by the route's GEMM (module docstring).

    Args:
        xq: mxfp8 activation QuantizedTensor [M, K]; qweight: mxfp8 weight [N, K], linear layout.
        bias: optional float32/bf16/fp16 [N], added in fp32 in the epilogue.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        decode_kernel: "bf16" or "fp8", the M <= 16 kernel.
    Returns:
        [M, N] tensor of out_dtype.
    Raises:
        ValueError: wrong formats/roles, K mismatch, different devices, bad bias, out_dtype or
            decode_kernel, or a device that is not sm_90.
    """
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    _check_decode_kernel(decode_kernel)
    check_device(FMT, qweight.device)
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    kind, cfg, _ = _gemm_plan(M, N, K, sm_count(qweight.device), decode_kernel)
    return _run_gemm(kind, cfg, xq, qweight, kernel_bias(bias), y)


def execute(r: Route, x: torch.Tensor, qweight: QuantizedTensor, bias=None, *,
            scale_rule: str = "ceil") -> torch.Tensor:
    """Run the route ``r`` (this module's ``route`` for x's rows) on checked operands: the
    quantizer, then the GEMM plan the route names (a W8A16 route: no quantizer, x as it is; scale_rule
    unused). ``linear`` is route + execute; tests run a route of sm_90 here under the interpreter.
    Raises ValueError for fp16 x on a W8A16 route of bf16 x (its decode GEMM and pre-pass dot x as
    bf16)."""
    N = qweight.shape[0]
    x2 = flatten_rows(x)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if not r.kernels:
        return y.reshape(*x.shape[:-1], N)
    opts = dict(r.options)
    kind, cfg = opts["gemm"], opts["config"]
    bias = kernel_bias(bias)
    if kind.startswith("a16_"):
        _run_a16(kind, cfg, x2, qweight, bias, y)
    elif kind == "decode_bf16_act":
        launch_e4m3_decode_linear(x2, qweight.data.contiguous(), qweight.scale.contiguous(), bias, y,
                                  floor_rule=scale_rule == "floor", config=cfg)
    else:
        _run_gemm(kind, cfg, quantize_activation(x2, scale_rule=scale_rule), qweight, bias, y)
    return y.reshape(*x.shape[:-1], N)


def gemm_w8a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x2d . dequant(qweight)^T (+ bias) with unquantized activations (W8A16, the "mxfp8_w8a16"
    variant) on sm_90, by the kernels of ``route(..., a16=True, x_dtype=x2d.dtype)``.

    Args:
        x2d: bfloat16/float16 [M, K] (any strides), on the weight's device.
        qweight: mxfp8 weight QuantizedTensor [N, K] (e4m3 codes, E8M0 bytes [N, K/32], linear layout).
        bias: optional float32/bf16/fp16 [N], added in fp32.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default x2d's dtype.
    Returns:
        [M, N] tensor of out_dtype: every product exact (bf16 x times e4m3 * 2^e in the bf16 dot;
        fp16 x as its exact bf16 hi and lo halves), fp32 sums (formats.reference_linear(..., a16=True)
        up to the fp32 summation order), one rounding to out_dtype.
    Raises:
        ValueError: naming the argument: x2d not a 2-D bf16/fp16 tensor, K not a multiple of 32 or
            not the weight's K, a wrong weight format or layout, devices, bias, out_dtype, or a device
            that is not sm_90.
    """
    check_weight(qweight, FMT)
    N, K = qweight.shape
    check_activation(x2d, K, K_MULTIPLE, FMT, device=qweight.device)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    out_dtype = out_dtype or x2d.dtype
    check_out_dtype(out_dtype)
    check_bias(bias, N, qweight.device)
    cap = check_device(FMT, qweight.device)
    M = x2d.shape[0]
    r = route(M, N, K, capability=cap, sm_count=sm_count(qweight.device), a16=True, x_dtype=x2d.dtype)
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if r.kernels:
        opts = dict(r.options)
        _run_a16(opts["gemm"], opts["config"], x2d, qweight, kernel_bias(bias), y)
    return y


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, scale_rule: str = "ceil", decode_kernel: str = "bf16") -> torch.Tensor:
    """y = x . W^T (+ bias) on sm_90: W8A8 (x quantized to MXFP8 on the fly) or, with a16=True,
    W8A16 (x used as it is: gemm_w8a16); route() once, then exactly its kernels.

    Args:
        x: bfloat16/float16 [..., K], K a multiple of 32, any strides.
        qweight: mxfp8 weight QuantizedTensor [N, K] (linear layout) on x's device.
        bias: optional float32/bf16/fp16 [N].
        a16: keep the activations in bf16/fp16 (weight-only quantization, "mxfp8_w8a16").
        scale_rule: activation scale rule, "ceil" or "floor" (see quantize_activation); unused with a16.
        decode_kernel: "bf16" or "fp8", the M <= 16 kernel (module docstring); "bf16" with a16.
    Returns:
        [..., N] tensor of x's dtype.
    Raises:
        ValueError: naming the argument: wrong weight format, x dtype, K not a multiple of 32 or
            not the weight's K, devices, bias shape or dtype, scale_rule, decode_kernel ("fp8" with
            a16), or a device that is not sm_90.
    """
    check_weight(qweight, FMT)
    N, K = qweight.shape
    check_activation(x, K, K_MULTIPLE, FMT, device=qweight.device)
    check_bias(bias, N, qweight.device)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if a16:
        _check_a16_options(decode_kernel, x.dtype)
        return gemm_w8a16(flatten_rows(x), qweight, bias).reshape(*x.shape[:-1], N)
    cap = check_device(FMT, qweight.device)
    r = route(x.numel() // K, N, K, capability=cap, sm_count=sm_count(qweight.device), scale_rule=scale_rule,
              decode_kernel=decode_kernel)
    return execute(r, x, qweight, bias, scale_rule=scale_rule)
