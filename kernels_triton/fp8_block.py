"""Block FP8 (DeepSeek-V3 / DeepGEMM style) in Triton, the lesson: 1x128 activation groups, 128x128
weight blocks; the activation quantizer, the portable GEMM, the native SM12x GEMM and the wrappers
that route, launch and check them, in that order.

What this file teaches: scales that change along K cannot be pulled out of the K sum, but scales
that are *constant over one K step* can be pulled out of that step. With BLOCK_K = 128 every K step
sees exactly one activation scale per row and one weight scale per column, so

    y[m, n] = sum over 128-wide K blocks kb of
                  (sum_{k in kb} qx[m, k] * qw[n, k]) * sx[m, kb] * sw[n // 128, kb]   + bias[n]

The inner sum is one tl.dot of e4m3 codes (a "partial"); the two scales multiply the partial before
it joins the fp32 accumulator. Scales (spec: formats/fp8_block.py, the oracle):

    sx [M, K/128]            activation: one per row and 128-wide group
    sw [ceil(N/128), K/128]  weight: one per 128x128 block; row n uses sw[n // 128]
    scale = max(amax_block, AMAX_FLOOR) / 448    (div_rn)
            and with ue8m0=True rounded up to a power of two: 2^ceil(log2(scale))
    code  = e4m3(x / scale)                      (div_rn, RNE, saturating)

1. The quantizer (``_quantize_kernel``; the tile math is ``fp8_block_quantize_tile``): one program
   per [BLOCK_M rows] x [one 128-wide group], so the group amax is a row max.

2. The portable GEMM (``_portable_gemm_kernel``), one program per [BLOCK_M, BLOCK_N] output tile:

       acc = 0                                             (fp32 [BLOCK_M, BLOCK_N])
       for kb in range(K // 128):
           partial = dot(qx[offs_m, kb], qw[offs_n, kb]^T) (fp32 [BLOCK_M, BLOCK_N], fresh each step)
           acc += partial * sx[offs_m, kb][:, None] * sw[offs_n // 128, kb][None, :]
       y = acc + bias                                      (epilogue, then cast to out_dtype)

   sw is loaded per column as a vector, sw[offs_n // 128, kb], so BLOCK_N need not line up with the
   128-row weight blocks (a tile may straddle two). On GPU the e4m3 tiles go straight into tl.dot;
   each partial is a fresh 128-deep dot added to the fp32 accumulator in registers, so the sum is
   promoted to fp32 every K step whatever Triton's Hopper default is. Under the interpreter the
   codes are dequantized to fp32 first (``fp8_block_dequantize_tile``).

3. The native SM12x GEMM (``_native_gemm_kernel``): each 128-deep partial is a tl.dot_scaled with
   unit E8M0 scales (the full-rate block-scaled MMA) promoted as above; with ``ue8m0=True``
   (power-of-two scales, DeepGEMM's UE8M0) each scale 2^e is handed to the MMA as its E8M0 byte
   e + 127, repeated over its four 32-blocks, and no promotion step is needed (a scale that is not
   a power of two makes its rows/columns of y NaN).

4. ``route``, the launchers, then the public functions: ``quantize_activation``, ``gemm``, ``linear``
   (its argument checks, then ``linear_unchecked``). Tiles: the caller's ``tile=`` / ``quant_tile=``
   (kernels_triton.tuning), else ``tile_config``.

Constraints: K a multiple of 128 and BLOCK_K == 128; x bf16/fp16 [..., K]; weight a linear-layout
fp8_block QuantizedTensor [N, K]. NaN/Inf in x follow the non-finite rule of docs/formats.md: the
group's scale becomes NaN and its codes 0x7F, so that row of y is NaN and no other row is.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX, FP8_BLOCK

from ._codecs import abs_or_inf, amax_or_nan, ceil_log2, dequantize_e4m3, encode_e4m3, exp2_int, grouped_tile
from ._common import (Route, TileConfig, check_activation, check_gemm_operands,
                      check_linear, check_sizes, default_quant_tile, device_capability, epilogue,
                      flatten_rows, interpreter_config, interpreting, kernel_bias, launch, route_path)

FMT = "fp8_block"
K_MULTIPLE = FP8_BLOCK  # 128
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_GROUP = tl.constexpr(FP8_BLOCK)


# == 1. The activation quantizer ==================================================================
@triton.jit
def fp8_block_quantize_tile(x, UE8M0: tl.constexpr):
    """x fp32 [BLOCK_M, 128], one group per row -> (e4m3 codes uint8 [BLOCK_M, 128], scales fp32
    [BLOCK_M]): scale = max(amax, floor) / 448 (UE8M0: rounded up to a power of two), code =
    e4m3(x / scale); a group with NaN/Inf gets a NaN scale and codes 0x7F."""
    amax = tl.max(abs_or_inf(x), axis=1)  # [BLOCK_M]; +Inf marks a NaN/Inf in the group
    scale = tl.math.div_rn(amax_or_nan(amax, _AMAX_FLOOR), _E4M3_MAX)  # NaN: all codes become 0x7F
    if UE8M0:
        # power-of-two scale, exponent kept in the float32 normal range as formats.codecs.pow2_ceil
        scale = tl.where(scale != scale, scale, exp2_int(tl.minimum(tl.maximum(ceil_log2(scale), -126), 127)))
    return encode_e4m3(tl.math.div_rn(x, scale[:, None])), scale


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr, q_ptr, s_ptr,
    # dimensions
    M,
    # strides
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
    # meta-parameters
    UE8M0: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """q = e4m3(x / s) and s = max(amax, floor) / 448 (optionally 2^ceil(log2 s)) per 1x128 group."""
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = kb * _GROUP + tl.arange(0, _GROUP)
    row_ok = offs_m < M
    # x tile [BLOCK_M, 128]: exactly one group per row, so the group amax is a row max
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk
    q, scale = fp8_block_quantize_tile(tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32), UE8M0)
    q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :].to(tl.int64) * stride_qk
    tl.store(q_ptrs, q, mask=row_ok[:, None])
    tl.store(s_ptr + offs_m.to(tl.int64) * stride_sm + kb * stride_sk, scale, mask=row_ok)


# == 2. The portable GEMM: y = sum_kb dot(qx_kb, qw_kb^T) * sx[:, kb] * sw[n // 128, kb] + bias ====
@triton.jit
def fp8_block_dequantize_tile(codes):
    """e4m3 codes (uint8, any shape) -> their fp32 values, exactly; the block scales are not applied
    here: they are constant over a 128-deep K step and multiply its partial sum."""
    return dequantize_e4m3(codes)


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
    HAS_BIAS: tl.constexpr, DOT_FP8: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y; BLOCK_K must be 128 (one scale per K step)."""
    tl.static_assert(BLOCK_K == _GROUP, "block FP8 needs BLOCK_K == 128: one scale per K step")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # int64: K * stride may pass 2^31
    m_ok = offs_m < M
    n_ok = offs_n < N
    # x_ptrs [BLOCK_M, BLOCK_K]; w_ptrs [BLOCK_K, BLOCK_N] (a tile of W^T read from W [N, K])
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    # scale pointers for K block 0: sx_ptrs [BLOCK_M] (one per row), sw_ptrs [BLOCK_N] (row n // 128)
    sx_ptrs = sx_ptr + offs_m.to(tl.int64) * stride_sxm
    sw_ptrs = sw_ptr + (offs_n // _GROUP).to(tl.int64) * stride_swn

    # ----- K loop: one 128-deep partial per step, scaled before it joins the accumulator -----
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        if DOT_FP8:
            partial = tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
        else:
            partial = tl.dot(fp8_block_dequantize_tile(a), fp8_block_dequantize_tile(b))
        sx = tl.load(sx_ptrs + kb * stride_sxk, mask=m_ok, other=0.0)  # [BLOCK_M]
        sw = tl.load(sw_ptrs + kb * stride_swk, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += partial * (sx[:, None] * sw[None, :])  # scales together first: partial * sx can overflow
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ----- epilogue: bias, cast, store (every scale was applied in the K loop) -----
    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# == 3. The native SM12x GEMM: the block-scaled MMA, with unit scales + fp32 promotion, or UE8M0 ====
# [native-kernel]
@triton.jit
def _native_gemm_kernel(
    # pointers
    x_ptr, w_ptr,  # e4m3 codes as uint8: x [M, K], w [N, K] (K contiguous)
    sx_ptr, sw_ptr,  # float32 scales: sx [M, K/128], sw [ceil(N/128), K/128]
    bias_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_wn, stride_sxm, stride_sxk, stride_swn, stride_swk, stride_ym,
    # meta-parameters
    UE8M0: tl.constexpr,  # every scale is a power of two: hand its exponent to the MMA as E8M0
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """fp32 scales (UE8M0=False): one 128-deep dot_scaled with unit E8M0 scales per K step (the
    full-rate MMA, see fp8_tensor), promoted into the fp32 accumulator times sx * sw, as the
    portable kernel does. UE8M0 scales: 2^e is E8M0 byte e + 127, which is bits 30..23 of the fp32
    scale, so each 128-wide scale goes to the MMA as that byte repeated over its four 32-blocks; the
    instruction applies it and no promotion step is needed. A scale that is not a power of two
    (mantissa bits set: not a UE8M0 checkpoint) makes its rows / columns of y NaN instead of a
    silently wrong number."""
    tl.static_assert(BLOCK_K % 128 == 0, "BLOCK_K must be a multiple of the 128-wide scale group")
    tl.static_assert(UE8M0 or BLOCK_K == 128, "fp32 scales need BLOCK_K == 128: one scale per K step")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_sx = offs_m.to(tl.int64) * stride_sxm  # [BLOCK_M]
    rows_sw = (offs_n // _GROUP).to(tl.int64) * stride_swn  # [BLOCK_N]: weight block row n // 128
    unit_a = tl.full((BLOCK_M, BLOCK_K // 32), 127, tl.uint8)
    unit_b = tl.full((BLOCK_N, BLOCK_K // 32), 127, tl.uint8)
    bad_m = tl.zeros([BLOCK_M], dtype=tl.int32)
    bad_n = tl.zeros([BLOCK_N], dtype=tl.int32)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0)
        b = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None], other=0)
        if UE8M0:
            # scale group of each 32-block: [BLOCK_K / 32] -> fp32 scales [rows, BLOCK_K / 32]
            kb = (k0 + 32 * tl.arange(0, BLOCK_K // 32)) // _GROUP
            sx = tl.load(sx_ptr + rows_sx[:, None] + kb[None, :] * stride_sxk, mask=m_ok[:, None], other=1.0)
            sw = tl.load(sw_ptr + rows_sw[:, None] + kb[None, :] * stride_swk, mask=n_ok[:, None], other=1.0)
            bx = sx.to(tl.int32, bitcast=True)
            bw = sw.to(tl.int32, bitcast=True)
            # a positive power of two has no mantissa bits and bx > 0 (sign clear, not zero)
            bad_m |= tl.max((((bx & 0x7FFFFF) != 0) | (bx <= 0)).to(tl.int32), axis=1)
            bad_n |= tl.max((((bw & 0x7FFFFF) != 0) | (bw <= 0)).to(tl.int32), axis=1)
            acc = tl.dot_scaled(a, ((bx >> 23) & 0xFF).to(tl.uint8), "e4m3",
                                b.T, ((bw >> 23) & 0xFF).to(tl.uint8), "e4m3", acc)
        else:
            kb = k0 // _GROUP
            sx = tl.load(sx_ptr + rows_sx + kb * stride_sxk, mask=m_ok, other=0.0)  # [BLOCK_M]
            sw = tl.load(sw_ptr + rows_sw + kb * stride_swk, mask=n_ok, other=0.0)  # [BLOCK_N]
            partial = tl.dot_scaled(a, unit_a, "e4m3", b.T, unit_b, "e4m3")  # a fresh 128-deep sum
            acc += partial * (sx[:, None] * sw[None, :])  # scales first, as the portable kernel
    if UE8M0:
        acc = tl.where((bad_m[:, None] | bad_n[None, :]) != 0, float("nan"), acc)

    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
# [/native-kernel]


# == 4. The route: which kernels, which tile, why =================================================
def tile_config(M: int, N: int, K: int, path=None, capability=None) -> TileConfig:
    """The GEMM's tile without ``tile=`` on a device of ``capability`` (None: the interpreter): as
    large as the problem there, 64 x 64 on a GPU; BLOCK_K is 128 (one scale per K step)."""
    route_path(path, FMT, capability)  # a forced path is checked even where the tile does not depend on it
    return interpreter_config(M, N, K, block_k=FP8_BLOCK) if capability is None else TileConfig(64, 64, FP8_BLOCK)


def _plan(M: int, N: int, K: int, capability, *, a16: bool = False, path: Optional[str] = None,
          tile: Optional[TileConfig] = None) -> tuple[Route, str, TileConfig]:
    """(the route, its GEMM path, its tile): the one place a call's kernels are decided."""
    check_sizes(M, N, K)
    path, why = route_path(path, FMT, capability, a16=a16)
    tile = tile or tile_config(M, N, K, path, capability)
    quant = () if M == 0 else ("_quantize_kernel",)
    if M == 0 or N == 0:
        return Route("triton", quant, why=f"{FMT}: an empty output, no GEMM to launch"), path, tile
    return Route("triton", quant + (f"_{path}_gemm_kernel",), str(tile), 1, why), path, tile


def route(M: int, N: int, K: int, *, capability=None, sm_count: int = 1, a16: bool = False,
          path: Optional[str] = None, tile: Optional[TileConfig] = None, ue8m0: bool = False) -> Route:
    """The Route ``linear`` launches for x [M, K] (M = prod(x.shape[:-1]); K a multiple of 128) and a
    weight [N, K] on a device of ``capability`` ((major, minor); None: the interpreter), with
    ``linear``'s options (ue8m0 and sm_count do not change it). Pure: no GPU needed. ValueError:
    a16=True (no weight-only mode), a negative size, or a path route_path refuses."""
    return _plan(M, N, K, capability, a16=a16, path=path, tile=tile)[0]


# == 5. The launchers (operands checked by the caller) ============================================
def _quantize(x2: torch.Tensor, ue8m0: bool, quant_tile) -> QuantizedTensor:
    """quantize_activation on x2 [M, K]: one quantize kernel (BLOCK_K is the 128-wide group)."""
    M, K = x2.shape
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty((M, K // FP8_BLOCK), dtype=torch.float32, device=x2.device)
    if M:
        block_m, _ = quant_tile or default_quant_tile(M, K, FP8_BLOCK)
        q = data.view(torch.uint8)
        launch(_quantize_kernel, (triton.cdiv(M, block_m), K // FP8_BLOCK),
               x2, q, scale,
               M,
               x2.stride(0), x2.stride(1), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
               UE8M0=bool(ue8m0), BLOCK_M=block_m)
    return QuantizedTensor(FMT, "activation", data, scale, None, (1, FP8_BLOCK), (M, K))


def _launch_gemm(path: str, tile: TileConfig, xq, qweight, bias, out_dtype, ue8m0: bool) -> torch.Tensor:
    """y [M, N] = the GEMM of ``path`` with ``tile`` on the quantized activation xq."""
    M, (N, K) = xq.rows, qweight.shape
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    bias = kernel_bias(bias)
    interp = interpreting()
    sx, sw = xq.scale, qweight.scale
    grid = (triton.cdiv(M, tile.BLOCK_M) * triton.cdiv(N, tile.BLOCK_N),)
    common = dict(HAS_BIAS=bias is not None, ROUND_BF16=interp and y.dtype == torch.bfloat16,
                  BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    if path == "native":
        x, w = xq.data.contiguous().view(torch.uint8), qweight.data.contiguous().view(torch.uint8)
        launch(_native_gemm_kernel, grid,
               x, w, sx, sw, bias if bias is not None else y, y,
               M, N, K,
               x.stride(0), w.stride(0), sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1), y.stride(0),
               UE8M0=bool(ue8m0), **common)
        return y
    dot_fp8 = not interp  # the GPU dots the e4m3 codes; the interpreter dequantizes uint8 codes first
    x, w = (xq.data, qweight.data) if dot_fp8 else (xq.data.view(torch.uint8), qweight.data.view(torch.uint8))
    launch(_portable_gemm_kernel, grid,
           x, w, sx, sw, bias if bias is not None else y, y,
           M, N, K,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1),
           sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1), y.stride(0), y.stride(1),
           DOT_FP8=dot_fp8, **common)
    return y


# == 6. The public functions: check, then launch ==================================================
def quantize_activation(x: torch.Tensor, *, ue8m0: bool = False,
                        quant_tile: Optional[tuple[int, int]] = None) -> QuantizedTensor:
    """x bf16/fp16 [..., K] (K a multiple of 128, any strides; NaN/Inf: docs/formats.md's non-finite
    rule) -> QuantizedTensor(fp8_block activation, data float8_e4m3fn [M, K], scale float32
    [M, K/128]), bit for bit ``formats.quantize(x, "fp8_block", role="activation", ue8m0=ue8m0)``.
    ue8m0: round each scale up to a power of two (DeepGEMM's UE8M0). quant_tile: (BLOCK_M, _) of a
    program (one 128-wide group each). ValueError: x not bf16/fp16, K not a positive multiple of 128."""
    check_activation(x, None, K_MULTIPLE, FMT)
    return _quantize(flatten_rows(x), ue8m0, quant_tile)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, ue8m0: bool = False, path: Optional[str] = None,
         tile: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] of out_dtype (bf16, fp16, fp32) = sum over 128-wide K blocks of (qx . qw^T) * sx * sw
    (+ bias [N], fp32/bf16/fp16, added in fp32). xq: fp8_block activation [M, K] (scale [M, K/128]);
    qweight: fp8_block weight [N, K] (scale [ceil(N/128), K/128]). ue8m0: both operands' scales are
    powers of two (native path: E8M0 scales in the MMA; one that is not makes its rows / columns of
    y NaN; the portable kernel is the same either way). path: None (gemm_path's) or forced; tile:
    the GEMM's tile. ValueError: a wrong operand (format, role, K, device), bias or out_dtype, or a
    path route_path refuses."""
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    _, path, tile = _plan(M, N, K, device_capability(qweight.device), path=path, tile=tile)
    return _launch_gemm(path, tile, xq, qweight, bias, out_dtype, ue8m0)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           ue8m0: bool = False, path: Optional[str] = None, tile: Optional[TileConfig] = None,
           quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """y [..., N] of x's dtype = x . W^T (+ bias [N]) with x quantized on the fly in 1x128 groups;
    exactly the kernels of ``route``. ue8m0: power-of-two activation scales, and a statement that
    the weight's are too (a UE8M0 checkpoint: the native path then runs the E8M0 MMA). x: bf16/fp16
    [..., K], K a multiple of 128, any strides; qweight: fp8_block [N, K] on x's device. path, tile,
    quant_tile: as gemm and quantize_activation. ValueError naming the argument: x (dtype, K,
    device), the weight, bias, or a bad path."""
    check_linear(x, qweight, bias, FMT, K_MULTIPLE)
    return linear_unchecked(x, qweight, bias, ue8m0=ue8m0, path=path, tile=tile, quant_tile=quant_tile)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     ue8m0: bool = False, path: Optional[str] = None, tile: Optional[TileConfig] = None,
                     quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``linear`` without its argument checks, for a caller that made them (dispatch's bound call):
    the same arguments and result; wrong arguments fail inside the kernels or give wrong numbers."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    _, path, tile = _plan(x2.shape[0], N, K, device_capability(qweight.device), path=path, tile=tile)
    xq = _quantize(x2, ue8m0, quant_tile)
    return _launch_gemm(path, tile, xq, qweight, bias, x.dtype, ue8m0).reshape(*x.shape[:-1], N)
