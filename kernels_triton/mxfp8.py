"""MXFP8 (OCP MX, E4M3 elements, one E8M0 scale per 32 along K) in Triton, the lesson: the
activation quantizer, the portable GEMM (W8A8, and W8A16: weight-only), the native SM12x GEMM and
the wrappers that route, launch and check them, in that order.

What this file teaches: a block-scaled GEMM whose scale blocks (32) are smaller than a K step, and
how power-of-two scales make the simplest approach exact. Each operand tile is *dequantized in
registers* (code value times its block's scale), then an ordinary tl.dot runs on the values:

    y[m, n] = sum_k (qx[m, k] * 2^ex[m, k // 32]) * (qw[n, k] * 2^ew[n, k // 32]) + bias[n]

1. The quantizer (``_quantize_kernel``; the tile math is ``mxfp8_quantize_tile``; spec:
   formats/mxfp8.py and formats/_mx.py, the oracle), per 1x32 block of a row:

       ceil rule (default):  e = ceil(log2(max(amax, AMAX_FLOOR) / 448))      (div_rn, then exponent bits)
       floor rule (OCP 6.3): e = floor(log2(max(amax, AMAX_FLOOR))) - 8       (8 = e4m3's emax)
       e clamped to [-127, 127]; scale byte = e + 127 (E8M0)
       code = e4m3(x * 2^-e)       (exact power-of-two scaling, then RNE with saturation)

2. The portable GEMM (``_portable_gemm_kernel``; the tile math is ``mxfp8_dequantize_tile``), one
   program per [BLOCK_M, BLOCK_N] output tile:

       acc = 0                                                   (fp32 [BLOCK_M, BLOCK_N])
       for k0 in range(0, K, BLOCK_K):                           (BLOCK_K a multiple of 32)
           a = e4m3(qx[offs_m, k]) * 2^(sx[offs_m, k // 32] - 127)   -> DOT dtype [BLOCK_M, BLOCK_K]
           b = e4m3(qw[offs_n, k]) * 2^(sw[offs_n, k // 32] - 127)   -> DOT dtype [BLOCK_N, BLOCK_K]
           acc = dot(a, b^T, acc)
       y = acc + bias

   Why this is exact: an e4m3 value has 4 significant bits and an E8M0 scale is a power of two, so
   their product has 4 significant bits and an 8-bit exponent: exact in bf16 (8 significant bits,
   fp32's exponent range) for every scale our quantizer produces (e in [-108, 120]). The tensor core
   multiplies two such values exactly and accumulates in fp32, so no scale is rounded anywhere. The
   DOT dtype is bf16 on GPU and fp32 under the interpreter (its bf16 tl.dot is wrong). The scales
   are loaded once per 32-element block and broadcast by a reshape to [BLOCK_R, BLOCK_K / 32, 32].

   W8A16 (``gemm_w8a16``, ``linear(a16=True)``; the "mxfp8_w8a16" variant): the A tile is x's
   bf16/fp16 rows as they are, only the weight is decoded; bf16 x times a 4-significant-bit weight
   is exact in the bf16 dot. fp16 x has 11 significant bits and the weights (up to 448 * 2^127)
   overflow fp16, so on GPU an fp16 tile is split exactly into bf16 hi + lo and dotted twice.

3. The native SM12x GEMM (``_native_gemm_kernel``): no decoding at all. tl.dot_scaled takes the
   e4m3 codes and the E8M0 bytes and lowers to mma.sync m16n8k32 kind::mxf8f6f4.block_scale
   .scale_vec::1X ... ue8m0, which applies one scale per 32 elements of each row inside the
   instruction: the same exact products, fp32 accumulation. W8A16 never takes it: the MMA is
   FP8xFP8 only, and Triton would lower dot_scaled(bf16, e4m3) by upcasting the weight to bf16,
   which is what the portable kernel does.

4. ``route``, the launchers, then the public functions: ``quantize_activation``, ``gemm``,
   ``gemm_w8a16``, ``linear``
   (its argument checks, then ``linear_unchecked``). Tiles: the caller's ``tile=`` / ``quant_tile=``
   (kernels_triton.tuning), else ``tile_config``.

Constraints: K a multiple of 32; x bf16/fp16 [..., K], any strides; weight a linear-layout mxfp8
QuantizedTensor [N, K] (scale uint8 [N, K/32]; swizzled 128x4 too on the native path). E8M0 byte
0xFF and e4m3 codes 0x7F/0xFF dequantize to NaN; scale bytes below 2^-117 (never produced by our
quantizer) could underflow bf16 on GPU. NaN/Inf in x follow the non-finite rule of docs/formats.md
(the block's scale becomes 0xFF and its codes 0x7F, so that row of y is NaN and no other row is;
W8A16: a NaN/Inf of x reaches its row of y through the dot, as in the oracle).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats._mx import SCALE_RULES
from formats.constants import AMAX_FLOOR, E4M3_EMAX, E4M3_MAX, E8M0_BIAS, MX_BLOCK

from ._codecs import (abs_or_inf, ceil_log2, dequantize_e4m3, dequantize_e8m0, encode_e4m3, exp2_int, floor_log2,
                      grouped_tile, scale_offsets)
from ._common import (Route, TileConfig, check_activation, check_gemm_operands,
                      check_linear, check_out_dtype, check_sizes, default_quant_tile, device_capability, epilogue,
                      flatten_rows, interpreter_config, interpreting, kernel_bias, launch, route_path,
                      weight_scale_bytes)

FMT = "mxfp8"
K_MULTIPLE = MX_BLOCK  # 32
VEC_SIZE = tl.constexpr(MX_BLOCK)  # elements per E8M0 scale
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_EMAX = tl.constexpr(E4M3_EMAX)
_E8M0_BIAS = tl.constexpr(E8M0_BIAS)


# == 1. The activation quantizer ==================================================================
@triton.jit
def mxfp8_quantize_tile(x, FLOOR_RULE: tl.constexpr):
    """x fp32 [R, G, 32], one 1x32 block per last axis -> (codes uint8 [R, G, 32], E8M0 bytes uint8
    [R, G]): e from the block amax (ceil or floor rule), code = e4m3(x * 2^-e), byte = e + 127; a
    block holding a NaN/Inf gets codes 0x7F and the NaN byte 0xFF (the non-finite rule)."""
    amax = tl.max(abs_or_inf(x), axis=2)  # [R, G]; +Inf marks a NaN/Inf in the block
    bad = amax > 3.4028234663852886e38
    amax = tl.maximum(amax, _AMAX_FLOOR)
    if FLOOR_RULE:
        e = floor_log2(amax) - _E4M3_EMAX
    else:
        e = ceil_log2(tl.math.div_rn(amax, _E4M3_MAX))
    e = tl.minimum(tl.maximum(e, -127), 127)
    # x * 2^-e is exact (a power of two), like the oracle's ldexp; a bad block's codes are all 0x7F
    # (times NaN)
    q = encode_e4m3(x * tl.where(bad, float("nan"), exp2_int(-e))[:, :, None])
    return q, tl.where(bad, 0xFF, e + _E8M0_BIAS).to(tl.uint8)


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
):
    """Per 1x32 block: e from the block amax (ceil or floor rule), q = e4m3(x * 2^-e), s = e + 127."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)           # [BLOCK_M]
    offs_g = pid_k * GROUPS + tl.arange(0, GROUPS)              # [GROUPS] block index along K
    offs_k = offs_g[:, None] * VEC_SIZE + tl.arange(0, VEC_SIZE)[None, :]  # [GROUPS, 32]
    mask = (offs_m < M)[:, None, None] & (offs_g < num_groups)[None, :, None]
    # x tile [BLOCK_M, GROUPS, 32]: the last axis is one scale block, so its amax is one reduction
    x_off = offs_m[:, None, None].to(tl.int64) * stride_xm + offs_k[None, :, :].to(tl.int64) * stride_xk
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    q, s = mxfp8_quantize_tile(x, FLOOR_RULE)  # codes [BLOCK_M, GROUPS, 32], E8M0 bytes [BLOCK_M, GROUPS]
    q_off = offs_m[:, None, None].to(tl.int64) * stride_qm + offs_k[None, :, :].to(tl.int64) * stride_qk
    tl.store(q_ptr + q_off, q, mask=mask)
    s_off = offs_m[:, None].to(tl.int64) * stride_sm + offs_g[None, :] * stride_sk
    tl.store(s_ptr + s_off, s, mask=(offs_m < M)[:, None] & (offs_g < num_groups)[None, :])


# == 2. The portable GEMM: dequantize both tiles in registers (exact in bf16), then dot ===========
@triton.jit
def mxfp8_dequantize_tile(q_ptr, s_ptr, rows, r_ok, k0, K, stride_qr, stride_qk, stride_sr, stride_sk,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rows`` x K columns [k0, k0 + BLOCK_K) of an MXFP8 matrix, dequantized: fp32 [BLOCK_R, BLOCK_K].
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
def _portable_gemm_kernel(
    # pointers
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_sxm, stride_sxk, stride_swn, stride_swk, stride_ym, stride_yn,
    # meta-parameters
    A16: tl.constexpr,  # x is the unquantized bf16/fp16 activation (W8A16); sx unused
    SPLIT_A16: tl.constexpr,  # A16 with fp16 x on GPU: dot the exact bf16 hi and lo halves
    HAS_BIAS: tl.constexpr, DOT_BF16: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y. x/w codes and sx/sw E8M0 bytes are all uint8 (A16: x is
    bf16/fp16)."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the 32-element scale block")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # [portable-loop]
    for k0 in range(0, K, BLOCK_K):
        # the A tile: code * 2^e, or (A16) x itself, widened to fp32 (exact)
        # (K is a multiple of 32; BLOCK_K need not divide it: masked)
        if A16:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                        mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        else:
            a = mxfp8_dequantize_tile(x_ptr, sx_ptr, offs_m, m_ok, k0, K, stride_xm, stride_xk, stride_sxm,
                                      stride_sxk, BLOCK_M, BLOCK_K)
        b = mxfp8_dequantize_tile(w_ptr, sw_ptr, offs_n, n_ok, k0, K, stride_wn, stride_wk, stride_swn, stride_swk,
                                  BLOCK_N, BLOCK_K)
        if DOT_BF16:
            # exact: code * 2^e has 4 significant bits (see the module docstring); bf16 x is bf16
            b_t = tl.trans(b.to(tl.bfloat16))
            a_hi = a.to(tl.bfloat16)
            acc = tl.dot(a_hi, b_t, acc)
            if SPLIT_A16:  # fp16 x = hi + lo, the remainder exact in bf16 (<= 3 significant bits)
                acc = tl.dot((a - a_hi.to(tl.float32)).to(tl.bfloat16), b_t, acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    # [/portable-loop]

    # ----- epilogue: bias, cast, store (every scale was applied in the K loop) -----
    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# == 3. The native SM12x GEMM: the scales go into the block-scaled MMA, nothing is dequantized ====
# [native-kernel]
@triton.jit
def _native_gemm_kernel(
    # pointers
    x_ptr, w_ptr,  # e4m3 codes as uint8: x [M, K], w [N, K] (K contiguous)
    sx_ptr, sw_ptr,  # E8M0 scale bytes: sx [M, K/32] linear, sw [N, K/32] linear or swizzled 128x4
    bias_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_wn, stride_sxm, stride_swn, stride_ym,
    # meta-parameters
    W_SWIZZLED: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y = sum_k (qx * 2^ex) (qw * 2^ew): on SM12x each
    tl.dot_scaled is mma.sync m16n8k32 kind::mxf8f6f4.block_scale.scale_vec::1X ... ue8m0, one
    E8M0 scale per 32 elements of a row of x and of a row of w, applied inside the instruction."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n_scales = K // VEC_SIZE

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # codes [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]; the K tail reads code 0
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)
        # E8M0 bytes, one per 32 codes: [BLOCK_M, BLOCK_K / 32] and [BLOCK_N, BLOCK_K / 32]
        offs_g = k0 // VEC_SIZE + tl.arange(0, BLOCK_K // VEC_SIZE)
        g_ok = offs_g < n_scales
        sa = tl.load(sx_ptr + scale_offsets(offs_m, offs_g, n_scales, stride_sxm, False),
                     mask=m_ok[:, None] & g_ok[None, :], other=127)
        sb = tl.load(sw_ptr + scale_offsets(offs_n, offs_g, n_scales, stride_swn, W_SWIZZLED),
                     mask=n_ok[:, None] & g_ok[None, :], other=127)
        acc = tl.dot_scaled(a, sa, "e4m3", b.T, sb, "e4m3", acc)

    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
# [/native-kernel]


# == 4. The route: which kernels, which tile, why =================================================
def tile_config(M: int, N: int, K: int, path=None, capability=None, *, a16: bool = False) -> TileConfig:
    """The GEMM's tile without ``tile=``, for ``path`` on a device of ``capability`` (None: the
    interpreter; ``a16``: W8A16, always portable): as large as the problem there; on a GPU 64 x 64,
    BLOCK_K 128 natively and 64 portably (the dequantized tiles live in registers before the dot)."""
    path = route_path(path, FMT, capability, a16=a16)[0]
    return interpreter_config(M, N, K) if capability is None else TileConfig(64, 64, 128 if path == "native" else 64)


def _plan(M: int, N: int, K: int, capability, *, a16: bool = False, path: Optional[str] = None,
          tile: Optional[TileConfig] = None) -> tuple[Route, str, TileConfig]:
    """(the route, its GEMM path, its tile): the one place a call's kernels are decided."""
    check_sizes(M, N, K)
    path, why = route_path(path, FMT, capability, a16=a16)
    tile = tile or tile_config(M, N, K, path, capability, a16=a16)
    quant = () if a16 or M == 0 else ("_quantize_kernel",)
    if M == 0 or N == 0:
        return Route("triton", quant, why=f"{FMT}: an empty output, no GEMM to launch"), path, tile
    return Route("triton", quant + (f"_{path}_gemm_kernel",), str(tile), 1, why), path, tile


def route(M: int, N: int, K: int, *, capability=None, sm_count: int = 1, a16: bool = False,
          path: Optional[str] = None, tile: Optional[TileConfig] = None, scale_rule: str = "ceil") -> Route:
    """The Route ``linear`` launches for x [M, K] (M = prod(x.shape[:-1]); K a multiple of 32) and a
    weight [N, K] on a device of ``capability`` ((major, minor); None: the interpreter), with
    ``linear``'s options (a16: W8A16, no quantizer, the portable GEMM; scale_rule and sm_count do
    not change it). Pure: no GPU needed. ValueError: a negative size, or a path route_path refuses
    (native with a16)."""
    return _plan(M, N, K, capability, a16=a16, path=path, tile=tile)[0]


# == 5. The launchers (operands checked by the caller) ============================================
def _quantize(x2: torch.Tensor, scale_rule: str, quant_tile) -> QuantizedTensor:
    """quantize_activation on x2 [M, K]: one quantize kernel, BLOCK_K / 32 scale blocks per program."""
    M, K = x2.shape
    num_groups = K // MX_BLOCK
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty((M, num_groups), dtype=torch.uint8, device=x2.device)
    if M:
        block_m, block_k = quant_tile or default_quant_tile(M, K, MX_BLOCK)
        groups = block_k // MX_BLOCK
        q = data.view(torch.uint8)
        launch(_quantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(num_groups, groups)),
               x2, q, scale,
               M, num_groups,
               x2.stride(0), x2.stride(1), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
               FLOOR_RULE=scale_rule == "floor", BLOCK_M=block_m, GROUPS=groups)
    return QuantizedTensor(FMT, "activation", data, scale, None, (1, MX_BLOCK), (M, K))


def _launch_gemm(path: str, tile: TileConfig, xq, qweight, bias, out_dtype) -> torch.Tensor:
    """y [M, N] = the GEMM of ``path`` with ``tile`` on xq: the quantized activation (W8A8) or the
    bf16/fp16 x [M, K] itself (W8A16: the portable kernel)."""
    a16 = not isinstance(xq, QuantizedTensor)
    M, (N, K) = xq.shape[0], qweight.shape
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    bias = kernel_bias(bias)
    interp = interpreting()
    grid = (triton.cdiv(M, tile.BLOCK_M) * triton.cdiv(N, tile.BLOCK_N),)
    common = dict(HAS_BIAS=bias is not None, ROUND_BF16=interp and y.dtype == torch.bfloat16,
                  BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    if path == "native":
        x, w = xq.data.contiguous().view(torch.uint8), qweight.data.contiguous().view(torch.uint8)
        sx = xq.scale.contiguous()
        sw, swizzled = weight_scale_bytes(qweight, FMT, MX_BLOCK)
        launch(_native_gemm_kernel, grid,
               x, w, sx, sw, bias if bias is not None else y, y,
               M, N, K,
               x.stride(0), w.stride(0), sx.stride(0), 0 if swizzled else sw.stride(0), y.stride(0),
               W_SWIZZLED=swizzled, **common)
        return y
    w, sw = qweight.data.view(torch.uint8), qweight.scale
    x, sx = (xq, sw) if a16 else (xq.data.view(torch.uint8), xq.scale)  # A16: sx is an unused pointer
    launch(_portable_gemm_kernel, grid,
           x, w, sx, sw, bias if bias is not None else y, y,
           M, N, K,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1),
           sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1), y.stride(0), y.stride(1),
           A16=a16, SPLIT_A16=a16 and x.dtype == torch.float16 and not interp, DOT_BF16=not interp, **common)
    return y


# == 6. The public functions: check, then launch ==================================================
def _check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil",
                        quant_tile: Optional[tuple[int, int]] = None) -> QuantizedTensor:
    """x bf16/fp16 [..., K] (K a multiple of 32, any strides; NaN/Inf: docs/formats.md's non-finite
    rule) -> QuantizedTensor(mxfp8 activation, data float8_e4m3fn [M, K], scale uint8 E8M0
    [M, K/32]), bit for bit ``formats.quantize(x, "mxfp8", role="activation", scale_rule=...)``.
    scale_rule: "ceil" (2^ceil(log2(amax/448))) or "floor" (OCP MX 6.3); quant_tile: (BLOCK_M,
    BLOCK_K) of a program. ValueError: x not bf16/fp16, K not a positive multiple of 32, an unknown
    scale_rule."""
    _check_scale_rule(scale_rule)
    check_activation(x, None, K_MULTIPLE, FMT)
    return _quantize(flatten_rows(x), scale_rule, quant_tile)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None,
         tile: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] of out_dtype (bf16, fp16, fp32) = dequant(xq) . dequant(qweight)^T (+ bias [N],
    fp32/bf16/fp16, added in fp32): natively tl.dot_scaled, portably dequantizing in registers.
    xq: mxfp8 activation [M, K]; qweight: mxfp8 weight [N, K] (linear scales; swizzled 128x4 too
    with path="native"). path: None (gemm_path's) or forced; tile: the GEMM's tile. ValueError: a
    wrong operand (format, role, layout, K, device), bias or out_dtype, or a bad path."""
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT, path)
    _, path, tile = _plan(M, N, K, device_capability(qweight.device), path=path, tile=tile)
    return _launch_gemm(path, tile, xq, qweight, bias, out_dtype)


def gemm_w8a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None, *, tile: Optional[TileConfig] = None) -> torch.Tensor:
    """W8A16: y [M, N] of out_dtype (bf16, fp16, fp32; default x2d's) = x2d . dequant(qweight)^T
    (+ bias [N], added in fp32), the portable kernel on every device (gemm_path(fmt, cap, a16=True)
    says why): exact products, fp32 sums. x2d: bf16/fp16 [M, K] (any strides); qweight: mxfp8
    [N, K], linear scales. ValueError: x2d not 2-D bf16/fp16, a wrong K, device, weight, bias or
    out_dtype. Source: formats.reference_linear(..., a16=True)."""
    check_linear(x2d, qweight, bias, FMT, K_MULTIPLE)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    out_dtype = out_dtype or x2d.dtype
    check_out_dtype(out_dtype)
    _, path, tile = _plan(x2d.shape[0], *qweight.shape, device_capability(qweight.device), a16=True, tile=tile)
    return _launch_gemm(path, tile, x2d, qweight, bias, out_dtype)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, scale_rule: str = "ceil", path: Optional[str] = None,
           tile: Optional[TileConfig] = None, quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """y [..., N] of x's dtype = x . W^T (+ bias [N]): W8A8 (x quantized on the fly with
    ``scale_rule``), or W8A16 with a16=True (x as it is); exactly the kernels of ``route``. x:
    bf16/fp16 [..., K], K a multiple of 32, any strides; qweight: mxfp8 [N, K] on x's device
    (swizzled 128x4 scales too with path="native"). path, tile, quant_tile: as gemm and
    quantize_activation. ValueError naming the argument: x (dtype, K, device), the weight, bias,
    scale_rule, or a bad path (native with a16)."""
    check_linear(x, qweight, bias, FMT, K_MULTIPLE, path)
    if not a16:
        _check_scale_rule(scale_rule)
    return linear_unchecked(x, qweight, bias, a16=a16, scale_rule=scale_rule, path=path, tile=tile,
                            quant_tile=quant_tile)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     a16: bool = False, scale_rule: str = "ceil", path: Optional[str] = None,
                     tile: Optional[TileConfig] = None, quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``linear`` without its argument checks, for a caller that made them (dispatch's bound call):
    the same arguments and result; wrong arguments fail inside the kernels or give wrong numbers."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    _, path, tile = _plan(x2.shape[0], N, K, device_capability(qweight.device), a16=a16, path=path, tile=tile)
    a = x2 if a16 else _quantize(x2, scale_rule, quant_tile)
    return _launch_gemm(path, tile, a, qweight, bias, x.dtype).reshape(*x.shape[:-1], N)
