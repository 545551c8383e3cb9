"""NVFP4 in Triton, the lesson: the activation quantizer, the portable GEMM, the native SM12x GEMM,
the route, the launchers and the public functions, in that order (the same in every lesson).

What NVFP4 stores (formats/nvfp4.py is the spec and the oracle): e2m1 codes packed two per byte
along K (uint8 [rows, K/2], element 2i in the low nibble), one e4m3 scale per 16 elements and one
fp32 global scale g per tensor: x[m, k] ~= e2m1(qx[m, k]) * e4m3(sx[m, k // 16]) / g_x.

1. The quantizer, bit for bit as the oracle (tile math: ``nvfp4_quantize_tile``):

       g    = 2688 / max(amax(x), AMAX_FLOOR)       dynamic (2688 = 448 * 6), or a static global_scale
       s    = e4m3(div_rn(amax_block, 6) * g)        per 16-element block
       code = e2m1(div_rn(x * g, dequantize(s)))    code 0 where s == 0

   The dynamic g needs the amax of the whole tensor first: ``_amax_partials_kernel`` writes one
   partial amax per program (no atomics: the result does not depend on timing) and every program of
   ``_quantize_kernel`` reduces them itself. Rounding uses the bit-arithmetic encoders of _codecs
   (Triton's fp8 cast is wrong in the interpreter) and IEEE division (tl.math.div_rn).

2. The portable GEMM (``_portable_gemm_kernel``; tile math: ``nvfp4_dequantize_tile``): dequantize
   each operand tile in registers, then a plain tl.dot. An e2m1 value has 2 significant bits and an
   e4m3 scale 4, so their product has at most 6 and is exact in bf16 (the GPU's dot dtype; fp32 under
   the interpreter, whose bf16 tl.dot is wrong); only the fp32 accumulation rounds:

       for k0 in range(0, K, BLOCK_K):
           a = e2m1(A bytes) * e4m3(A scales)[:, k // 16]            [BLOCK_M, BLOCK_K]
           w = e2m1(W bytes) * e4m3(W scales)[:, k // 16]            [BLOCK_N, BLOCK_K]
           acc += tl.dot(a, w^T)                                     fp32 [BLOCK_M, BLOCK_N]
       y = acc * (1 / g_x) * (1 / g_w) + bias

   W4A16 (``gemm_w4a16``, ``linear(a16=True)``, always portable): A is x itself; on GPU an fp16 tile
   is split exactly into bf16 hi + lo (lo = bf16(x - hi), at most 3 significant bits), dotted twice.

3. The native SM12x GEMM (``_native_gemm_kernel``): tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
   lowers to mma.sync m16n8k64 kind::mxf4nvf4.block_scale.scale_vec::4X ... ue4m3, which applies
   the e4m3 scales inside the instruction; alpha multiplies the accumulator once, in the epilogue.
   The weight scales may be linear or swizzled 128x4 (b12x's layout; ``scale_offsets``).

Where each GEMM runs (_common.gemm_path): native on SM120/SM121 with a Triton that lowers it; the
portable kernel elsewhere and under the interpreter (whose dot_scaled decodes e4m3 scales as E8M0).
Tiles: ``tile=`` / ``quant_tile=`` (kernels_triton.tuning), else ``tile_config`` /
``default_quant_tile``. Constraints: K % 16 == 0; x bf16/fp16 [..., K], any leading dims and strides.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR
from formats.validate import nan_unless_positive, static_global_scale

from ._codecs import (abs_or_inf, amax_or_nan, dequantize_e2m1, dequantize_e4m3, dequantize_e4m3_finite, encode_e2m1,
                      encode_e4m3, grouped_tile, nan_if_nonfinite, scale_offsets)
from ._common import (Route, TileConfig, check_activation, check_gemm_operands,
                      check_linear, check_out_dtype, check_sizes, default_quant_tile, device_capability,
                      epilogue, flatten_rows, interpreter_config, interpreting, kernel_bias, launch, route_path,
                      weight_scale_bytes)

FMT = "nvfp4"
VEC_SIZE = NVFP4_BLOCK  # 16 elements share one e4m3 scale
MAX_PARTIALS = 256  # programs of the amax kernel on a GPU (every quantize program reads all their results)
MAX_PARTIALS_INTERPRETED = 4  # under the interpreter: few programs, each over several row tiles

_FLOOR = tl.constexpr(AMAX_FLOOR)
_G_NUM = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)  # 2688.0


# == 1. The activation quantizer ==================================================================
@triton.jit
def nvfp4_quantize_tile(x, g, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x fp32 [BLOCK_M, BLOCK_K] and the global scale g -> (e2m1 codes uint8 [BLOCK_M, BLOCK_K], one
    per element; e4m3 scale codes uint8 [BLOCK_M, BLOCK_K / 16])."""
    # per-16 block scale s = e4m3(amax_b / 6 * g)
    xb = x.reshape(BLOCK_M, BLOCK_K // 16, 16)
    amax_b = amax_or_nan(tl.max(abs_or_inf(xb), axis=2), _FLOOR)  # NaN for a block with NaN/Inf
    s_code = encode_e4m3(tl.math.div_rn(amax_b, 6.0) * g)
    s_val = dequantize_e4m3(s_code)[:, :, None]
    # element codes e2m1(x * g / s), 0 where s == 0 (the quotient would be NaN or inf) or s is NaN
    # (0x7F: the block, or with dynamic g the tensor, held a NaN/Inf; the non-finite rule)
    codes = encode_e2m1(tl.math.div_rn(xb * g, tl.where(s_val > 0, s_val, 1.0)))
    return tl.where(s_val > 0, codes, 0).to(tl.uint8).reshape(BLOCK_M, BLOCK_K), s_code


@triton.jit
def _amax_partials_kernel(x_ptr, partial_ptr, M, K, stride_xm, stride_xk,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """partial[pid] = max |x| over the row tiles pid, pid + P, ... (all of K); +Inf marks a NaN/Inf."""
    amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for m0 in range(tl.program_id(0) * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk
            amax = tl.maximum(amax, abs_or_inf(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)))
    tl.store(partial_ptr + tl.program_id(0), tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def _quantize_kernel(
    x_ptr,  # bf16/fp16 [M, K], any strides
    partial_ptr,  # float32 [num_partials] (DYNAMIC) or the static g, float32 [1]
    q_ptr, s_ptr,  # out: packed uint8 [M, K/2], e4m3 scale bytes uint8 [M, K/16]
    g_out_ptr,  # out: float32 [1], the global scale used
    M, K, num_partials,
    stride_xm, stride_xk, stride_qm, stride_sm,
    DYNAMIC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)

    # ----- global scale: reduce the partial amaxes (dynamic) or read the static g
    if DYNAMIC:
        offs_p = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(partial_ptr + offs_p, mask=offs_p < num_partials, other=0.0), axis=0)
        # g = 2688 / max(amax, AMAX_FLOOR), one IEEE division as the oracle; NaN if amax is +Inf
        g = tl.math.div_rn(tl.zeros_like(amax) + _G_NUM, amax_or_nan(amax, _FLOOR))
    else:
        # a static g given as a tensor is not checked on the host (that would sync): a bad one
        # (<= 0, Inf, NaN) becomes NaN here, so every consumer of g yields NaN, never zeros
        g = tl.load(partial_ptr)
        g = nan_if_nonfinite(tl.where(g > 0, g, float("nan")))
    tl.store(g_out_ptr, g, mask=(pid_m == 0) & (pid_k == 0))

    # ----- x tile [BLOCK_M, BLOCK_K] as float32 (exact for bf16/fp16), quantized
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)
    m_mask = offs_m < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
    codes, s_code = nvfp4_quantize_tile(x, g, BLOCK_M, BLOCK_K)

    # ----- two codes per byte, element 2j in the low nibble (split pairs the columns 2j, 2j + 1);
    # store bytes [BLOCK_M, BLOCK_K / 2] and scale codes [BLOCK_M, BLOCK_K / 16]
    even, odd = tl.split(codes.reshape(BLOCK_M, BLOCK_K // 2, 2))
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_kb[None, :], even | (odd << 4),
             mask=m_mask[:, None] & (offs_kb[None, :] < K // 2))
    offs_ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(s_ptr + rows[:, None] * stride_sm + offs_ks[None, :], s_code,
             mask=m_mask[:, None] & (offs_ks[None, :] < K // 16))


# == 2. The portable GEMM: dequantize in registers, then tl.dot ===================================
@triton.jit
def nvfp4_dequantize_tile(data_ptr, scale_ptr, offs_r, r_mask, k0, K, stride_dr, stride_sr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NAN_SCALES: tl.constexpr = True):
    """Rows ``offs_r`` x K [k0, k0 + BLOCK_K) of a packed NVFP4 matrix, block scales applied, as
    float32 [BLOCK_R, BLOCK_K]; out-of-range rows and K columns read as 0. NAN_SCALES: scale code
    0x7F dequantizes to NaN (False only for load-checked weight scales: dequantize_e4m3_finite)."""
    rows = offs_r.to(tl.int64)
    # packed bytes [BLOCK_R, BLOCK_K // 2]: byte j holds elements 2j (low nibble) and 2j + 1 (high)
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_kb[None, :],
                mask=r_mask[:, None] & (offs_kb[None, :] < K // 2), other=0)
    # join stacks along a new last axis: [BLOCK_R, BLOCK_K // 2, 2], so the row-major reshape puts
    # the low nibble of byte j at column 2j and the high one at 2j + 1, the storage order
    v = tl.join(dequantize_e2m1(b & 0xF), dequantize_e2m1(b >> 4)).reshape(BLOCK_R, BLOCK_K)
    # scales [BLOCK_R, BLOCK_K // 16]; a masked scale reads 0 and multiplies a masked 0
    offs_ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    s = tl.load(scale_ptr + rows[:, None] * stride_sr + offs_ks[None, :],
                mask=r_mask[:, None] & (offs_ks[None, :] < K // 16), other=0)
    sv = dequantize_e4m3(s) if NAN_SCALES else dequantize_e4m3_finite(s)
    # each scale over its 16 elements: [BLOCK_R, BLOCK_K / 16, 16] * [.., .., 1]
    return (v.reshape(BLOCK_R, BLOCK_K // 16, 16) * sv[:, :, None]).reshape(BLOCK_R, BLOCK_K)


@triton.jit
def _portable_gemm_kernel(
    a_ptr, a_scale_ptr,  # activation: packed uint8 [M, K/2] + e4m3 scale bytes [M, K/16], or (A16) x [M, K]
    w_ptr, w_scale_ptr,  # weight: packed uint8 [N, K/2] + e4m3 scale bytes [N, K/16]
    gx_ptr, gw_ptr,  # the global scales, float32 [1] each (A16: gx = 1)
    bias_ptr, c_ptr,  # bias [N] (any float dtype), output [M, N]
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_wn, stride_wsn, stride_cm,
    A16: tl.constexpr,  # the activation is unquantized bf16/fp16 (W4A16)
    SPLIT_A16: tl.constexpr,  # A16 with fp16 x on GPU: dot the exact bf16 hi and lo halves
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # bf16 on GPU, fp32 under the interpreter
    ROUND_BF16: tl.constexpr,  # interpreter + bf16 output: round to nearest even before the cast
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N

    # ----- K loop: acc [BLOCK_M, BLOCK_N] fp32 += A tile [BLOCK_M, BLOCK_K] . W tile^T [BLOCK_K, BLOCK_N]
    # (the A tile first: its temporaries are dead before the wider W tile is dequantized)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A16:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak,
                        mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
            if SPLIT_A16:  # fp16 x = hi + lo, both exact in bf16
                x32 = x.to(tl.float32)
                a = x32.to(tl.bfloat16)
                a_lo = (x32 - a.to(tl.float32)).to(tl.bfloat16)  # exact: <= 3 significant bits
            else:  # bf16 x on GPU: already the dot dtype; interpreter: widened to fp32 (exact)
                a = x.to(tl.float32).to(DOT_DTYPE)
        else:
            a = nvfp4_dequantize_tile(a_ptr, a_scale_ptr, offs_m, m_mask, k0, K, stride_am, stride_asm, BLOCK_M,
                                      BLOCK_K).to(DOT_DTYPE)
        w = nvfp4_dequantize_tile(w_ptr, w_scale_ptr, offs_n, n_mask, k0, K, stride_wn, stride_wsn,
                                  BLOCK_N, BLOCK_K, not A16)  # W4A16: at its register limit
        w_t = tl.trans(w.to(DOT_DTYPE))
        acc = tl.dot(a, w_t, acc)
        if SPLIT_A16:
            acc = tl.dot(a_lo, w_t, acc)

    # ----- epilogue: alpha = (1/g_x)(1/g_w) (NaN for a bad global scale), bias, cast, masked store
    y = epilogue(acc, offs_n, n_mask, gx_ptr, gw_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=True,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# == 3. The native SM12x GEMM: tl.dot_scaled, the block-scaled MMA ================================
# [native-kernel]
@triton.jit
def _native_gemm_kernel(
    a_ptr, a_scale_ptr,  # activation: packed e2m1 uint8 [M, K/2], e4m3 scale bytes [M, K/16] (linear)
    w_ptr, w_scale_ptr,  # weight: packed e2m1 uint8 [N, K/2], e4m3 scale bytes (linear or swizzled 128x4)
    gx_ptr, gw_ptr,  # the global scales, float32 [1] each
    bias_ptr, c_ptr,  # bias [N], output [M, N]
    M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,  # the K strides are 1
    W_SWIZZLED: tl.constexpr,  # weight scales in the swizzled 128x4 layout
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    n_scales = K // 16

    # ----- K loop: acc [BLOCK_M, BLOCK_N] fp32 += (A . SA) [BLOCK_M, BLOCK_K] . (W . SW)^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # packed bytes, two e2m1 codes each, low nibble first: [rows, BLOCK_K // 2]
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kb_ok = offs_kb < K // 2
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_kb[None, :], mask=m_ok[:, None] & kb_ok[None, :], other=0)
        w = tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_kb[None, :], mask=n_ok[:, None] & kb_ok[None, :], other=0)
        # block scales, one per 16 elements: [rows, BLOCK_K // 16] (masked: 0 x 0 = 0)
        offs_ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        ks_ok = offs_ks < n_scales
        sa = tl.load(a_scale_ptr + scale_offsets(offs_m, offs_ks, n_scales, stride_asm, False),
                     mask=m_ok[:, None] & ks_ok[None, :], other=0)
        sw = tl.load(w_scale_ptr + scale_offsets(offs_n, offs_ks, n_scales, stride_wsn, W_SWIZZLED),
                     mask=n_ok[:, None] & ks_ok[None, :], other=0)
        # one block-scaled MMA per 64-deep slice; the scales never leave the instruction
        acc = tl.dot_scaled(a, sa.to(tl.float8e4nv, bitcast=True), "e2m1",
                            w.T, sw.to(tl.float8e4nv, bitcast=True), "e2m1", acc)

    # ----- epilogue: global scales, bias, cast, masked store
    y = epilogue(acc, offs_n, n_ok, gx_ptr, gw_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=True,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    tl.store(c_ptr + rows_m[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
# [/native-kernel]


# == 4. The route: which kernels, which tile, why =================================================
def tile_config(M: int, N: int, K: int, path=None, capability=None, *, a16: bool = False) -> TileConfig:
    """The GEMM's tile without ``tile=``, for ``path`` on a device of ``capability`` (None: the
    interpreter): as large as the problem there (BLOCK_K >= 64, triton#11776); on a GPU 64 x 64,
    BLOCK_K 128 natively and 64 portably (its dequantized fp32 tiles live in registers)."""
    path = route_path(path, FMT, capability, a16=a16)[0]
    if capability is None:
        return interpreter_config(M, N, K, min_block_k=64)
    return TileConfig(64, 64, 128 if path == "native" else 64)


def _plan(M: int, N: int, K: int, capability, *, a16: bool = False, path: Optional[str] = None,
          tile: Optional[TileConfig] = None, global_scale=None) -> tuple[Route, str, TileConfig]:
    """(the route, its GEMM path, its tile): the one place a call's kernels are decided."""
    check_sizes(M, N, K)
    path, why = route_path(path, FMT, capability, a16=a16)
    tile = tile or tile_config(M, N, K, path, capability, a16=a16)
    quant = () if a16 or M == 0 else ("_amax_partials_kernel",) * (global_scale is None) + ("_quantize_kernel",)
    if M == 0 or N == 0:
        return Route("triton", quant, why=f"{FMT}: an empty output, no GEMM to launch"), path, tile
    return Route("triton", quant + (f"_{path}_gemm_kernel",), str(tile), 1, why), path, tile


def route(M: int, N: int, K: int, *, capability=None, sm_count: int = 1, a16: bool = False,
          path: Optional[str] = None, tile: Optional[TileConfig] = None, global_scale=None) -> Route:
    """The Route ``linear`` launches for x [M, K] and a weight [N, K] on a device of ``capability``
    (None: the interpreter), with linear's options (a static global_scale drops the amax kernel;
    sm_count changes nothing). Pure. ValueError: a negative size, or a path route_path refuses."""
    return _plan(M, N, K, capability, a16=a16, path=path, tile=tile, global_scale=global_scale)[0]


# == 5. The launchers (operands checked by the caller) ============================================
def amax_partials(M: int, block_m: int, interpreted: Optional[bool] = None) -> int:
    """The partial amaxes g is reduced from: one per ``block_m`` row tile, at most MAX_PARTIALS(_INTERPRETED)
    (``interpreted``: whether the kernels run in Triton's interpreter; None: as in this process)."""
    interpreted = interpreting() if interpreted is None else interpreted
    return min(triton.cdiv(M, block_m), MAX_PARTIALS_INTERPRETED if interpreted else MAX_PARTIALS)


def _quantize(x2: torch.Tensor, global_scale, quant_tile) -> QuantizedTensor:
    """quantize_activation on x2 [M, K]: the amax kernel (dynamic g), then the quantize kernel."""
    (M, K), device = x2.shape, x2.device
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((M, K // VEC_SIZE), dtype=torch.uint8, device=device)
    dynamic = global_scale is None
    g_in = None if dynamic else static_global_scale(global_scale, device)
    if M == 0:  # no launch; the oracle's g for an empty tensor is 2688 / AMAX_FLOOR
        g = (torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=torch.float32, device=device)
             / torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=device)) if dynamic else nan_unless_positive(g_in)
    else:
        block_m, block_k = quant_tile or default_quant_tile(M, K, VEC_SIZE)
        num_partials = 1
        if dynamic:
            num_partials = amax_partials(M, block_m)
            g_in = torch.empty((num_partials,), dtype=torch.float32, device=device)
            launch(_amax_partials_kernel, (num_partials,), x2, g_in, M, K, x2.stride(0), x2.stride(1),
                   BLOCK_M=block_m, BLOCK_K=block_k)
        g = torch.empty((1,), dtype=torch.float32, device=device)
        launch(_quantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(K, block_k)),
               x2, g_in, data, scale, g, M, K, num_partials,
               x2.stride(0), x2.stride(1), data.stride(0), scale.stride(0),
               DYNAMIC=dynamic, BLOCK_P=max(16, triton.next_power_of_2(num_partials)), BLOCK_M=block_m, BLOCK_K=block_k)
    return QuantizedTensor(FMT, "activation", data, scale.view(torch.float8_e4m3fn), g.reshape(()),
                           (1, VEC_SIZE), (M, K))


def _launch_gemm(path: str, tile: TileConfig, a, qweight, bias, out_dtype) -> torch.Tensor:
    """y [M, N] = the GEMM of ``path`` with ``tile``. a: the activation, an NVFP4 QuantizedTensor
    (W4A4) or the bf16/fp16 x [M, K] itself (W4A16: the portable kernel, g_x = 1)."""
    a16 = not isinstance(a, QuantizedTensor)
    M, (N, K) = a.shape[0], qweight.shape
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    if a16:
        sa, gx = None, torch.ones(1, dtype=torch.float32, device=qweight.device)
    else:
        a, sa, gx = a.data.contiguous(), a.scale.contiguous().view(torch.uint8), a.global_scale.reshape(1).float()
    gw = qweight.global_scale.reshape(1).to(torch.float32)
    bias = kernel_bias(bias)
    grid = (triton.cdiv(M, tile.BLOCK_M) * triton.cdiv(N, tile.BLOCK_N),)
    common = dict(HAS_BIAS=bias is not None, ROUND_BF16=interpreting() and out_dtype == torch.bfloat16,
                  BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    bias_arg = bias if bias is not None else y  # an unused pointer still needs a tensor
    # [native-launch]
    if path == "native":
        sw, swizzled = weight_scale_bytes(qweight, FMT, VEC_SIZE)  # linear or swizzled 128x4 scale bytes
        launch(_native_gemm_kernel, grid, a, sa, qweight.data.contiguous(), sw, gx, gw, bias_arg, y, M, N, K,
               a.stride(0), sa.stride(0), qweight.data.stride(0), 0 if swizzled else sw.stride(0), y.stride(0),
               W_SWIZZLED=swizzled, **common)
        return y
    # [/native-launch]
    w = qweight.data.contiguous()
    sw = qweight.scale.contiguous().view(torch.uint8)
    split = bool(a16 and a.dtype == torch.float16 and not interpreting())
    launch(_portable_gemm_kernel, grid, a, sw if a16 else sa, w, sw, gx, gw, bias_arg, y, M, N, K,
           a.stride(0), a.stride(1) if a16 else 1, 0 if a16 else sa.stride(0), w.stride(0), sw.stride(0), y.stride(0),
           A16=a16, SPLIT_A16=split, DOT_DTYPE=tl.float32 if interpreting() else tl.bfloat16, **common)
    return y


# == 6. The public functions: check, then launch ==================================================
def quantize_activation(x: torch.Tensor, *, global_scale: Union[None, float, torch.Tensor] = None,
                        quant_tile: Optional[tuple[int, int]] = None) -> QuantizedTensor:
    """x bf16/fp16 [..., K] (K % 16 == 0, any strides; NaN/Inf: docs/formats.md's non-finite rule)
    -> QuantizedTensor(nvfp4 activation, data uint8 [M, K/2], scale float8_e4m3fn [M, K/16],
    global_scale float32 0-d), bit for bit ``formats.quantize(x, "nvfp4", role="activation",
    global_scale=global_scale)``. global_scale: a static g (number or one-element tensor); None:
    2688 / max(amax(x), 2^-100). quant_tile: (BLOCK_M, BLOCK_K) of a program. ValueError: x not
    bf16/fp16, K not a positive multiple of 16, a bad global_scale."""
    check_activation(x, None, VEC_SIZE, FMT)
    return _quantize(flatten_rows(x), global_scale, quant_tile)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None,
         tile: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] of out_dtype (bf16, fp16, fp32) = dequant(xq) . dequant(qweight)^T (+ bias [N], any
    float dtype, added in fp32); fp32 accumulation, alpha = (1/g_x)(1/g_w) once. xq: NVFP4 activation
    [M, K]; qweight: NVFP4 weight [N, K] (linear scales; swizzled 128x4 too with path="native").
    path: None (gemm_path's) or forced; tile: the GEMM's tile. ValueError: a wrong operand (format,
    role, layout, K, device), bias or out_dtype, or a path route_path refuses."""
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT, path)
    _, path, tile = _plan(M, N, K, device_capability(qweight.device), path=path, tile=tile)
    return _launch_gemm(path, tile, xq, qweight, bias, out_dtype)


def gemm_w4a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None, *, tile: Optional[TileConfig] = None) -> torch.Tensor:
    """W4A16: y [M, N] of out_dtype (default x2d's) = x2d . dequant(qweight)^T (+ bias), the portable
    kernel on every device (gemm_path(fmt, cap, a16=True) says why): fp32 sums of exact products,
    times 1/g_w once. x2d: bf16/fp16 [M, K] (any strides); qweight: NVFP4 [N, K], linear scales.
    ValueError: x2d not 2-D bf16/fp16, a wrong K, device, weight, bias or out_dtype."""
    check_linear(x2d, qweight, bias, FMT, VEC_SIZE)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    out_dtype = out_dtype or x2d.dtype
    check_out_dtype(out_dtype)
    _, path, tile = _plan(x2d.shape[0], *qweight.shape, device_capability(qweight.device), a16=True, tile=tile)
    return _launch_gemm(path, tile, x2d, qweight, bias, out_dtype)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, global_scale: Union[None, float, torch.Tensor] = None, path: Optional[str] = None,
           tile: Optional[TileConfig] = None, quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """y [..., N] of x's dtype = x . W^T (+ bias [N]): W4A4 (x quantized, quantize_activation's
    global_scale), or W4A16 with a16=True (x as it is); exactly the kernels of ``route``. x:
    bf16/fp16 [..., K], any strides; qweight: NVFP4 [N, K] on x's device. path, tile, quant_tile:
    as gemm and quantize_activation. ValueError naming the argument: x (dtype, K, device), the
    weight (format, layout), bias, global_scale, or a path route_path refuses."""
    check_linear(x, qweight, bias, FMT, VEC_SIZE, path)
    return linear_unchecked(x, qweight, bias, a16=a16, global_scale=global_scale, path=path, tile=tile,
                            quant_tile=quant_tile)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     a16: bool = False, global_scale=None, path: Optional[str] = None,
                     tile: Optional[TileConfig] = None, quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``linear`` without its argument checks, for a caller that made them (dispatch's bound call):
    the same arguments and result; wrong arguments fail inside the kernels or give wrong numbers."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    _, path, tile = _plan(x2.shape[0], N, K, device_capability(qweight.device), a16=a16, path=path, tile=tile,
                          global_scale=global_scale)
    a = x2 if a16 else _quantize(x2, global_scale, quant_tile)
    return _launch_gemm(path, tile, a, qweight, bias, x.dtype).reshape(*x.shape[:-1], N)
