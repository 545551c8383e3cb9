"""Per-tensor FP8 (W8A8) in Triton, the lesson: the activation quantizer, the portable GEMM, the
native SM12x GEMM and the wrappers that route, launch and check them, in that order.

What this file teaches: the simplest scaled GEMM. One float32 scale for the whole activation and
one for the whole weight, so the scales factor out of the K sum entirely:

    y[m, n] = sum_k (qx[m, k] * sx) * (qw[n, k] * sw) + bias[n]
            = (sum_k qx[m, k] * qw[n, k]) * sx * sw + bias[n]

and the K loop is a plain matrix multiply of the e4m3 codes; the scales are applied once, in the
epilogue.

1. The quantizer (spec: formats/fp8_tensor.py, the oracle; the tile math is
   ``fp8_tensor_quantize_tile``):

       sx   = max(amax(|x|), AMAX_FLOOR) / 448        (div_rn; or a static calibrated ``scale``)
       qx   = e4m3(x / sx)                            (div_rn, then RNE with saturation to +-448)

   The amax is a reduction over the whole tensor, so quantization is two launches with no atomics
   and no host synchronization: ``_amax_partials_kernel`` (program (p, q) reduces row tile p over
   the K tiles q, q + Pk, ... into one partial), then ``_quantize_kernel``, whose every program
   reduces the (few) partials itself, computes sx (program (0, 0) stores it) and quantizes its
   [BLOCK_M, BLOCK_K] tile. A static ``scale`` skips the first launch.

2. The portable GEMM (``_portable_gemm_kernel``), one program per [BLOCK_M, BLOCK_N] output tile:

       acc = 0                                        (fp32 [BLOCK_M, BLOCK_N])
       for k0 in range(0, K, BLOCK_K):
           a = qx[offs_m, k0:k0+BLOCK_K]              (e4m3 [BLOCK_M, BLOCK_K])
           b = qw[offs_n, k0:k0+BLOCK_K]^T            (e4m3 [BLOCK_K, BLOCK_N])
           acc = dot(a, b, acc)                       (fp32 accumulation)
       y = acc * sx * sw + bias                       (epilogue, then cast to out_dtype)

   On GPU the e4m3 tiles go straight into tl.dot (fp8 tensor cores). On Hopper, Triton's default
   for fp8 dots is *imprecise* accumulation (max_num_imprecise_acc = 2^30: the wgmma accumulator is
   never promoted to full fp32), which loses about 3 bits at K = 8192; we pass
   max_num_imprecise_acc=128, a promotion into the fp32 accumulator after every 128 products. Under
   the interpreter the codes are dequantized to fp32 first (``fp8_tensor_dequantize_tile``: exact;
   the interpreter's fp8 paths are trusted for loads only).

3. The native SM12x GEMM (``_native_gemm_kernel``): the same codes through tl.dot_scaled with every
   E8M0 scale 127 (2^0), because on SM12x the plain fp8 MMA runs at half the 8-bit rate and the
   block-scaled one at full rate (triton#11320); the two scales stay in the epilogue.

4. ``route`` (which kernels a call launches, with which tile, and why), the launchers, then the
   public functions: ``quantize_activation``, ``gemm``, ``linear`` (its argument checks, then
   ``linear_unchecked``). Tiles: the caller's ``tile=`` / ``quant_tile=`` (kernels_triton.tuning),
   else ``tile_config``.

Constraints: any K >= 1 (no block structure); x bf16/fp16 [..., K]; weight a linear-layout
fp8_tensor QuantizedTensor [N, K]. NaN/Inf in x follow the non-finite rule of docs/formats.md:
the dynamic scale becomes NaN (every row of y is NaN: the scale is per tensor); with a static scale
the element's code is 0x7F (NaN), so only its row is.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX
from formats.validate import static_scale

from ._codecs import abs_or_inf, amax_or_nan, dequantize_e4m3, encode_e4m3, grouped_tile, nan_if_nonfinite
from ._common import (Route, TileConfig, check_activation, check_gemm_operands,
                      check_linear, check_sizes, default_quant_tile, device_capability, epilogue,
                      flatten_rows, interpreter_config, interpreting, kernel_bias, launch, route_path)

FMT = "fp8_tensor"
K_MULTIPLE = 1  # per-tensor scaling puts no constraint on K
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
PARTIALS_BLOCK = 1024  # partial maxima reduced per step in the quantize kernel
# max_num_imprecise_acc of the Hopper fp8 dot: promote the wgmma accumulator to fp32 every 128
# products (never promoting loses about 3 bits at K = 8192, over the 1e-3 relative-error budget)
IMPRECISE_ACC = 128


# == 1. The activation quantizer ==================================================================
@triton.jit
def fp8_tensor_quantize_tile(x, scale):
    """x fp32 (any shape) and the per-tensor scale -> e4m3 codes uint8 e4m3(x / scale); NaN/Inf
    become 0x7F, with a static scale too (the non-finite rule)."""
    return encode_e4m3(tl.math.div_rn(nan_if_nonfinite(x), scale))


@triton.jit
def _amax_partials_kernel(
    # pointers
    x_ptr, partials_ptr,
    # dimensions
    M, K,
    # strides
    stride_xm, stride_xk,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """partials[pid_m * Pk + pid_k] = max |x| over rows [pid_m*BLOCK_M, (pid_m+1)*BLOCK_M) and the
    K tiles pid_k, pid_k + Pk, ... The grid spans K as well as M: a program walking all of K issues
    its loads one after another (at M <= 16, one program would walk all of K = 8192 alone)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pk = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_off = offs_m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, num_pk * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        # x tile [BLOCK_M, BLOCK_K]; masked elements read as 0, which never raises a max of |x|
        x = tl.load(x_ptr + row_off[:, None] + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(abs_or_inf(x.to(tl.float32)), axis=1))  # +Inf marks a NaN/Inf
    tl.store(partials_ptr + pid_m * num_pk + pid_k, tl.max(amax, axis=0))


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr, q_ptr, scale_ptr, partials_ptr,
    # dimensions
    M, K, num_partials,
    # strides
    stride_xm, stride_xk, stride_qm, stride_qk,
    # meta-parameters
    STATIC_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr,
):
    """q[tile] = e4m3(x[tile] / scale); with a dynamic scale, also scale = max(amax, floor) / 448."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if STATIC_SCALE:
        scale = tl.load(scale_ptr)
    else:
        # Every program redoes this small reduction rather than waiting on another program: there
        # is no grid-wide barrier in Triton, and there are only cdiv(M, BLOCK_M) partials.
        amax = tl.zeros([PARTIALS_BLOCK], dtype=tl.float32)
        for p0 in range(0, num_partials, PARTIALS_BLOCK):
            offs_p = p0 + tl.arange(0, PARTIALS_BLOCK)
            amax = tl.maximum(amax, tl.load(partials_ptr + offs_p, mask=offs_p < num_partials, other=0.0))
        # div_rn: IEEE division, as the oracle's torch division (plain / may be approximate on GPU)
        # (NaN if x held a NaN/Inf: then every code is 0x7F, the non-finite rule)
        scale = tl.math.div_rn(amax_or_nan(tl.max(amax, axis=0), _AMAX_FLOOR), _E4M3_MAX)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_ptr, scale)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    # x tile [BLOCK_M, BLOCK_K], read through both strides (x may be non-contiguous)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk
    q = fp8_tensor_quantize_tile(tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32), scale)
    q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :].to(tl.int64) * stride_qk
    tl.store(q_ptrs, q, mask=mask)


# == 2. The portable GEMM: y = (qx . qw^T) * sx * sw + bias =======================================
@triton.jit
def fp8_tensor_dequantize_tile(codes):
    """e4m3 codes (uint8, any shape) -> their fp32 values, exactly; the per-tensor scales are not
    applied here: they factor out of the K sum and meet in the epilogue."""
    return dequantize_e4m3(codes)


@triton.jit
def _portable_gemm_kernel(
    # pointers
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    # meta-parameters
    HAS_BIAS: tl.constexpr, DOT_FP8: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y. x_ptr/w_ptr hold e4m3 codes: float8e4nv when DOT_FP8
    (GPU), uint8 otherwise (interpreter, dequantized to fp32 before the dot)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # x_ptrs is [BLOCK_M, BLOCK_K]; w_ptrs is [BLOCK_K, BLOCK_N], i.e. a tile of W^T read from W [N, K]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    # ----- K loop: a plain matmul of the codes, fp32 accumulator [BLOCK_M, BLOCK_N] -----
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if DOT_FP8:
            # Hopper: promote the fp8 wgmma accumulator into fp32 every IMPRECISE_ACC (128) products;
            # Triton's default (2^30) never does and loses ~3 bits at large K.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(fp8_tensor_dequantize_tile(a), fp8_tensor_dequantize_tile(b), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ----- epilogue: the two per-tensor scales, then the bias -----
    y = epilogue(acc, offs_n, offs_n < N, sx_ptr, sw_ptr, bias_ptr, TENSOR_SCALES=True, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# == 3. The native SM12x GEMM: the codes through the block-scaled MMA with unit scales ============
# [native-kernel]
@triton.jit
def _native_gemm_kernel(
    # pointers
    x_ptr, w_ptr,  # e4m3 codes as uint8: x [M, K], w [N, K] (K contiguous)
    sx_ptr, sw_ptr,  # the per-tensor scales, float32 [1] each
    bias_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y = (qx . qw^T) * sx * sw + bias with every 32 codes scaled by 2^0 inside the MMA. Why:
    on SM120 a plain fp8 tl.dot lowers to mma.sync m16n8k32.f32.e4m3.e4m3.f32, which runs at half
    the 8-bit rate; tl.dot_scaled with E8M0 byte 127 (= 1.0) lowers to the full-rate
    kind::mxf8f6f4.block_scale instruction (triton#11320) and computes the same sums."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the MMA's 32-element scale block")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # unit scales, [BLOCK_M, BLOCK_K / 32] and [BLOCK_N, BLOCK_K / 32]: E8M0 byte 127 is 2^0
    unit_a = tl.full((BLOCK_M, BLOCK_K // 32), 127, tl.uint8)
    unit_b = tl.full((BLOCK_N, BLOCK_K // 32), 127, tl.uint8)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K  # any K: the tail reads code 0
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc = tl.dot_scaled(a, unit_a, "e4m3", b.T, unit_b, "e4m3", acc)

    # ----- epilogue: the two per-tensor scales, then the bias -----
    y = epilogue(acc, offs_n, n_ok, sx_ptr, sw_ptr, bias_ptr, TENSOR_SCALES=True, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
# [/native-kernel]


# == 4. The route: which kernels, which tile, why =================================================
def tile_config(M: int, N: int, K: int, path=None, capability=None) -> TileConfig:
    """The GEMM's tile without ``tile=`` on a device of ``capability`` (None: the interpreter): as
    large as the problem there, 64 x 64 x 128 on a GPU (either path)."""
    route_path(path, FMT, capability)  # a forced path is checked even where the tile does not depend on it
    return interpreter_config(M, N, K) if capability is None else TileConfig(64, 64, 128)


def _plan(M: int, N: int, K: int, capability, *, a16: bool = False, path: Optional[str] = None,
          tile: Optional[TileConfig] = None, scale=None) -> tuple[Route, str, TileConfig]:
    """(the route, its GEMM path, its tile): the one place a call's kernels are decided."""
    check_sizes(M, N, K)
    path, why = route_path(path, FMT, capability, a16=a16)
    tile = tile or tile_config(M, N, K, path, capability)
    quant = () if M == 0 else ("_amax_partials_kernel",) * (scale is None) + ("_quantize_kernel",)
    if M == 0 or N == 0:
        return Route("triton", quant, why=f"{FMT}: an empty output, no GEMM to launch"), path, tile
    return Route("triton", quant + (f"_{path}_gemm_kernel",), str(tile), 1, why), path, tile


def route(M: int, N: int, K: int, *, capability=None, sm_count: int = 1, a16: bool = False,
          path: Optional[str] = None, tile: Optional[TileConfig] = None, scale=None) -> Route:
    """The Route ``linear`` launches for x [M, K] (M = prod(x.shape[:-1])) and a weight [N, K] on a
    device of ``capability`` ((major, minor); None: the interpreter), with ``linear``'s options (a
    static ``scale`` drops the amax kernel; sm_count does not change it). Pure: no GPU needed.
    ValueError: a16=True (no weight-only mode), a negative size, or a path route_path refuses."""
    return _plan(M, N, K, capability, a16=a16, path=path, tile=tile, scale=scale)[0]


# == 5. The launchers (operands checked by the caller) ============================================
def amax_grid(M: int, K: int, block_m: int, block_k: int, interpreted: Optional[bool] = None) -> tuple[int, int]:
    """The amax kernel's grid (row tiles, K tiles) for x [M, K]: K is split only on a GPU, and only
    as far as the quantize kernel reduces the partials in one PARTIALS_BLOCK step (``interpreted``:
    whether the kernels run in Triton's interpreter; None: as in this process)."""
    interpreted = interpreting() if interpreted is None else interpreted
    pm = triton.cdiv(M, block_m)
    return pm, 1 if interpreted else max(1, min(triton.cdiv(K, block_k), PARTIALS_BLOCK // pm))


def _quantize(x2: torch.Tensor, scale, quant_tile) -> QuantizedTensor:
    """quantize_activation on x2 [M, K]: the amax kernel (dynamic scale), then the quantize kernel."""
    M, K = x2.shape
    s = torch.empty((), dtype=torch.float32, device=x2.device) if scale is None else static_scale(scale, x2.device)
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    if M == 0:
        if scale is None:  # the oracle's scale of an empty tensor: the amax floor over 448
            s = torch.full((), AMAX_FLOOR, dtype=torch.float32, device=x2.device) / E4M3_MAX
        return QuantizedTensor(FMT, "activation", data, s, None, None, (M, K))
    block_m, block_k = quant_tile or default_quant_tile(M, K, 32)
    partials = s  # unused placeholder pointer when the scale is static
    num_partials = 0
    if scale is None:
        pm, pk = amax_grid(M, K, block_m, block_k)
        num_partials = pm * pk
        partials = torch.empty(num_partials, dtype=torch.float32, device=x2.device)
        launch(_amax_partials_kernel, (pm, pk),
               x2, partials, M, K, x2.stride(0), x2.stride(1), BLOCK_M=block_m, BLOCK_K=block_k)
    q = data.view(torch.uint8)
    launch(_quantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(K, block_k)),
           x2, q, s, partials,
           M, K, num_partials,
           x2.stride(0), x2.stride(1), q.stride(0), q.stride(1),
           STATIC_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_K=block_k, PARTIALS_BLOCK=PARTIALS_BLOCK)
    return QuantizedTensor(FMT, "activation", data, s, None, None, (M, K))


def _launch_gemm(path: str, tile: TileConfig, xq, qweight, bias, out_dtype) -> torch.Tensor:
    """y [M, N] = the GEMM of ``path`` with ``tile`` on the quantized activation xq."""
    M, (N, K) = xq.rows, qweight.shape
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
        launch(_native_gemm_kernel, grid,
               x, w, xq.scale.reshape(1), qweight.scale.reshape(1), bias if bias is not None else y, y,
               M, N, K,
               x.stride(0), w.stride(0), y.stride(0), **common)
        return y
    dot_fp8 = not interp  # the GPU dots the e4m3 codes; the interpreter dequantizes uint8 codes first
    x, w = (xq.data, qweight.data) if dot_fp8 else (xq.data.view(torch.uint8), qweight.data.view(torch.uint8))
    launch(_portable_gemm_kernel, grid,
           x, w, xq.scale, qweight.scale, bias if bias is not None else y, y,
           M, N, K,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
           DOT_FP8=dot_fp8, IMPRECISE_ACC=min(IMPRECISE_ACC, tile.BLOCK_K),  # Triton needs it <= BLOCK_K
           **common)
    return y


# == 6. The public functions: check, then launch ==================================================
def quantize_activation(x: torch.Tensor, *, scale=None, quant_tile: Optional[tuple[int, int]] = None) -> QuantizedTensor:
    """x bf16/fp16 [..., K] (any K >= 1, any strides; NaN/Inf: docs/formats.md's non-finite rule)
    -> QuantizedTensor(fp8_tensor activation, data float8_e4m3fn [M, K], scale float32 0-d), bit for
    bit ``formats.quantize(x, "fp8_tensor", role="activation", scale=scale)``. scale: a static
    positive scale (number or 0-d tensor, e.g. a calibrated input_scale); None: max(amax,
    AMAX_FLOOR) / 448. quant_tile: (BLOCK_M, BLOCK_K) of a program. ValueError: x not bf16/fp16
    with K >= 1, a non-positive or non-finite scale."""
    check_activation(x, None, K_MULTIPLE, FMT)
    return _quantize(flatten_rows(x), scale, quant_tile)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None,
         tile: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] of out_dtype (bf16, fp16, fp32) = (qx . qw^T) * sx * sw (+ bias [N], fp32/bf16/fp16,
    added in fp32): natively the block-scaled MMA with unit scales, portably a plain fp8 tl.dot.
    xq: fp8_tensor activation [M, K]; qweight: fp8_tensor weight [N, K]. path: None (gemm_path's)
    or forced; tile: the GEMM's tile. ValueError: a wrong operand (format, role, K, device), bias or
    out_dtype, or a path route_path refuses."""
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    _, path, tile = _plan(M, N, K, device_capability(qweight.device), path=path, tile=tile)
    return _launch_gemm(path, tile, xq, qweight, bias, out_dtype)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           scale=None, path: Optional[str] = None, tile: Optional[TileConfig] = None,
           quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """y [..., N] of x's dtype = x . W^T (+ bias [N]) with x quantized on the fly (quantize_activation's
    ``scale``); exactly the kernels of ``route``. x: bf16/fp16 [..., K], any strides; qweight:
    fp8_tensor [N, K] on x's device. path, tile, quant_tile: as gemm and quantize_activation.
    ValueError naming the argument: x (dtype, K, device), the weight, bias, or a bad path."""
    check_linear(x, qweight, bias, FMT, K_MULTIPLE)
    return linear_unchecked(x, qweight, bias, scale=scale, path=path, tile=tile, quant_tile=quant_tile)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     scale=None, path: Optional[str] = None, tile: Optional[TileConfig] = None,
                     quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``linear`` without its argument checks, for a caller that made them (dispatch's bound call):
    the same arguments and result; wrong arguments fail inside the kernels or give wrong numbers."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    _, path, tile = _plan(x2.shape[0], N, K, device_capability(qweight.device), path=path, tile=tile, scale=scale)
    xq = _quantize(x2, scale, quant_tile)
    return _launch_gemm(path, tile, xq, qweight, bias, x.dtype).reshape(*x.shape[:-1], N)
