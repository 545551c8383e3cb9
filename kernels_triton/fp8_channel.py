"""Per-channel FP8 (W8A8) in Triton, the lesson: the per-token activation quantizer, the portable
GEMM, the native SM12x GEMM and the wrappers that route, launch and check them, in that order.

What this file teaches: scales that belong to a whole row of an operand. The weight has one fp32
scale per output channel (row n of W), the activation one per token (row m of x); each is constant
along K, so it still leaves the K sum, just not as one number:

    y[m, n] = sum_k (qx[m, k] * sx[m]) * (qw[n, k] * sw[n]) + bias[n]
            = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n] + bias[n]

The K loop is fp8_tensor's plain matmul of e4m3 codes; the epilogue multiplies the accumulator
tile by the outer product of two scale vectors, sx[offs_m] down the rows and sw[offs_n] across the
columns. (compressed-tensors' FP8_DYNAMIC checkpoints, the most common FP8 recipe, are this format.)

1. The quantizer (spec: formats/fp8_channel.py, the oracle; the tile math is
   ``fp8_channel_quantize_tile``), one row at a time:

       sx[m]    = max(amax(|x[m, :]|), AMAX_FLOOR) / 448   (div_rn; or one static ``scale`` for all rows)
       qx[m, k] = e4m3(x[m, k] / sx[m])                   (div_rn, then RNE with saturation to +-448)

   The amax is a reduction along a row only, so, unlike fp8_tensor's, it needs no second launch:
   ``_quantize_kernel`` gives each program whole rows and walks K twice, once for the amax and once
   for the codes (a static ``scale`` skips the first walk).

2. The portable GEMM (``_portable_gemm_kernel``), one program per [BLOCK_M, BLOCK_N] output tile:

       acc = 0                                        (fp32 [BLOCK_M, BLOCK_N])
       for k0 in range(0, K, BLOCK_K):
           a = qx[offs_m, k0:k0+BLOCK_K]              (e4m3 [BLOCK_M, BLOCK_K])
           b = qw[offs_n, k0:k0+BLOCK_K]^T            (e4m3 [BLOCK_K, BLOCK_N])
           acc = dot(a, b, acc)                       (fp32 accumulation)
       y = acc * (sx[offs_m][:, None] * sw[offs_n][None, :]) + bias   (``_epilogue``)

   On GPU the e4m3 tiles go straight into tl.dot (on Hopper with max_num_imprecise_acc = 128, as
   in fp8_tensor); under the interpreter the codes are dequantized to fp32 first
   (``fp8_channel_dequantize_tile``: exact).

3. The native SM12x GEMM (``_native_gemm_kernel``): fp8_tensor's, the codes through tl.dot_scaled
   with every E8M0 scale 127 (2^0) for the full-rate block-scaled MMA (triton#11320). The row and
   column scales stay in the epilogue: the MMA's own scales are powers of two per 32 elements of K,
   which cannot hold sx[m] or sw[n].

4. ``route`` (which kernels a call launches, with which tile, and why), the launchers, then the
   public functions: ``quantize_activation``, ``gemm``, ``linear`` (its argument checks, then
   ``linear_unchecked``). Tiles: the caller's ``tile=`` / ``quant_tile=`` (kernels_triton.tuning),
   else ``tile_config``.

Constraints: any K >= 1 (no block structure); x bf16/fp16 [..., K]; weight a linear-layout
fp8_channel QuantizedTensor [N, K] (scale float32 [N]). NaN/Inf in x follow the non-finite rule of
docs/formats.md: with the dynamic scales the row's scale becomes NaN and its codes 0x7F; with a
static scale the element's code is 0x7F; either way only that row of y is NaN. An all-zero row has
the finite scale AMAX_FLOOR / 448 and zero codes, so its output row is the bias.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX
from formats.validate import check_quantized_activation, static_scale

from ._codecs import abs_or_inf, amax_or_nan, dequantize_e4m3, encode_e4m3, grouped_tile, nan_if_nonfinite
from ._common import (Route, TileConfig, check_activation, check_gemm_operands,
                      check_linear, check_sizes, default_quant_tile, device_capability, epilogue,
                      flatten_rows, interpreter_config, interpreting, kernel_bias, launch, route_path)

FMT = "fp8_channel"
K_MULTIPLE = 1  # per-row scaling puts no constraint on K
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# max_num_imprecise_acc of the Hopper fp8 dot: promote the wgmma accumulator to fp32 every 128
# products (never promoting loses about 3 bits at K = 8192), as in fp8_tensor
IMPRECISE_ACC = 128


# == 1. The activation quantizer ==================================================================
@triton.jit
def fp8_channel_quantize_tile(x, scale):
    """x fp32 [BLOCK_M, BLOCK_K] and each row's scale fp32 [BLOCK_M] -> e4m3 codes uint8
    e4m3(x / scale[:, None]); NaN/Inf become 0x7F, with a static scale too (the non-finite rule)."""
    return encode_e4m3(tl.math.div_rn(nan_if_nonfinite(x), scale[:, None]))


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr, q_ptr, scale_ptr, static_ptr,
    # dimensions
    M, K,
    # strides
    stride_xm, stride_xk, stride_qm, stride_qk,
    # meta-parameters
    STATIC_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [pid*BLOCK_M, (pid+1)*BLOCK_M): scale[m] = max(amax of row m, floor) / 448 (or the
    static scale at static_ptr), then q[m, :] = e4m3(x[m, :] / scale[m])."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1] row starts (x may be strided)
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm

    # ----- walk 1: each row's scale [BLOCK_M] -----
    if STATIC_SCALE:
        scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(static_ptr)  # one scale for every row
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_ok[:, None] & (offs_k[None, :] < K)
            # x tile [BLOCK_M, BLOCK_K]; masked elements read as 0, which never raises a max of |x|
            x = tl.load(x_rows + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(abs_or_inf(x.to(tl.float32)), axis=1))  # +Inf marks a NaN/Inf
        # div_rn: IEEE division, as the oracle's torch division (plain / may be approximate on GPU);
        # NaN for a row that held a NaN/Inf, so every code of that row becomes 0x7F
        scale = tl.math.div_rn(amax_or_nan(amax, _AMAX_FLOOR), _E4M3_MAX)
    tl.store(scale_ptr + offs_m, scale, mask=m_ok)

    # ----- walk 2: the codes, a [BLOCK_M, BLOCK_K] tile at a time, each row by its own scale -----
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = m_ok[:, None] & (offs_k[None, :] < K)
        x = tl.load(x_rows + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_rows + offs_k[None, :].to(tl.int64) * stride_qk, fp8_channel_quantize_tile(x, scale), mask=mask)


# == 2. The portable GEMM: y = (qx . qw^T) * sx[m] * sw[n] + bias =================================
@triton.jit
def fp8_channel_dequantize_tile(codes):
    """e4m3 codes (uint8, any shape) -> their fp32 values, exactly; the row scales are not applied
    here: they factor out of the K sum and meet in the epilogue."""
    return dequantize_e4m3(codes)


@triton.jit
def _epilogue(acc, offs_m, m_ok, offs_n, n_ok, sx_ptr, sw_ptr, bias_ptr,
              HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 * (sx[offs_m] x sw[offs_n]), then _common.epilogue's bias and
    bf16 rounding. The two scale vectors meet first (their outer product): acc * sx alone can
    overflow where y does not."""
    sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)  # [BLOCK_M]: the tokens' scales
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)  # [BLOCK_N]: the channels' scales
    return epilogue(acc * (sx[:, None] * sw[None, :]), offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr,
                    TENSOR_SCALES=False, GLOBAL_SCALES=False, HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)


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
    (GPU), uint8 otherwise (interpreter, dequantized to fp32 before the dot). sx_ptr: float32 [M],
    sw_ptr: float32 [N]."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # x_ptrs is [BLOCK_M, BLOCK_K]; w_ptrs is [BLOCK_K, BLOCK_N], i.e. a tile of W^T read from W [N, K]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    # ----- K loop: a plain matmul of the codes, fp32 accumulator [BLOCK_M, BLOCK_N] -----
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP8:
            # Hopper: promote the fp8 wgmma accumulator into fp32 every IMPRECISE_ACC products
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(fp8_channel_dequantize_tile(a), fp8_channel_dequantize_tile(b), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ----- epilogue: sx down the rows, sw across the columns, then the bias -----
    y = _epilogue(acc, offs_m, m_ok, offs_n, n_ok, sx_ptr, sw_ptr, bias_ptr, HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# == 3. The native SM12x GEMM: the codes through the block-scaled MMA with unit scales ============
@triton.jit
def _native_gemm_kernel(
    # pointers
    x_ptr, w_ptr,  # e4m3 codes as uint8: x [M, K], w [N, K] (K contiguous)
    sx_ptr, sw_ptr,  # the row scales, float32 [M] and [N]
    bias_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y = (qx . qw^T) * sx[m] * sw[n] + bias with every 32 codes scaled by 2^0 inside the MMA: on
    SM120 tl.dot_scaled with E8M0 byte 127 (= 1.0) lowers to the full-rate kind::mxf8f6f4
    block-scaled instruction, where a plain fp8 tl.dot runs at half rate (triton#11320)."""
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

    # ----- epilogue: sx down the rows, sw across the columns, then the bias -----
    y = _epilogue(acc, offs_m, m_ok, offs_n, n_ok, sx_ptr, sw_ptr, bias_ptr, HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# == 4. The route: which kernels, which tile, why =================================================
def tile_config(M: int, N: int, K: int, path=None, capability=None) -> TileConfig:
    """The GEMM's tile without ``tile=`` on a device of ``capability`` (None: the interpreter): as
    large as the problem there, 64 x 64 x 128 on a GPU (either path)."""
    route_path(path, FMT, capability)  # a forced path is checked even where the tile does not depend on it
    return interpreter_config(M, N, K) if capability is None else TileConfig(64, 64, 128)


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
          path: Optional[str] = None, tile: Optional[TileConfig] = None, scale=None) -> Route:
    """The Route ``linear`` launches for x [M, K] (M = prod(x.shape[:-1])) and a weight [N, K] on a
    device of ``capability`` ((major, minor); None: the interpreter), with ``linear``'s options (a
    static ``scale`` skips a walk inside the same quantizer; neither it nor sm_count changes the
    route). Pure: no GPU needed. ValueError: a16=True (no weight-only mode), a negative size, or a
    path route_path refuses."""
    return _plan(M, N, K, capability, a16=a16, path=path, tile=tile)[0]


# == 5. The launchers (operands checked by the caller) ============================================
def _quantize(x2: torch.Tensor, scale, quant_tile) -> QuantizedTensor:
    """quantize_activation on x2 [M, K]: one quantize kernel, whole rows per program (BLOCK_M rows,
    K walked BLOCK_K columns at a time)."""
    M, K = x2.shape
    s = torch.empty((M,), dtype=torch.float32, device=x2.device)
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    static = s if scale is None else static_scale(scale, x2.device)  # s: an unread placeholder pointer
    if M:
        block_m, block_k = quant_tile or default_quant_tile(M, K, 32)
        q = data.view(torch.uint8)
        launch(_quantize_kernel, (triton.cdiv(M, block_m),),
               x2, q, s, static,
               M, K,
               x2.stride(0), x2.stride(1), q.stride(0), q.stride(1),
               STATIC_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_K=block_k)
    return QuantizedTensor(FMT, "activation", data, s, None, (1, K), (M, K))


def _launch_gemm(path: str, tile: TileConfig, xq, qweight, bias, out_dtype) -> torch.Tensor:
    """y [M, N] = the GEMM of ``path`` with ``tile`` on the quantized activation xq."""
    M, (N, K) = xq.rows, qweight.shape
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    bias = kernel_bias(bias)
    interp = interpreting()
    sx, sw = xq.scale.contiguous(), qweight.scale.contiguous()
    grid = (triton.cdiv(M, tile.BLOCK_M) * triton.cdiv(N, tile.BLOCK_N),)
    common = dict(HAS_BIAS=bias is not None, ROUND_BF16=interp and y.dtype == torch.bfloat16,
                  BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    if path == "native":
        x, w = xq.data.contiguous().view(torch.uint8), qweight.data.contiguous().view(torch.uint8)
        launch(_native_gemm_kernel, grid,
               x, w, sx, sw, bias if bias is not None else y, y,
               M, N, K,
               x.stride(0), w.stride(0), y.stride(0), **common)
        return y
    dot_fp8 = not interp  # the GPU dots the e4m3 codes; the interpreter dequantizes uint8 codes first
    x, w = (xq.data, qweight.data) if dot_fp8 else (xq.data.view(torch.uint8), qweight.data.view(torch.uint8))
    launch(_portable_gemm_kernel, grid,
           x, w, sx, sw, bias if bias is not None else y, y,
           M, N, K,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
           DOT_FP8=dot_fp8, IMPRECISE_ACC=min(IMPRECISE_ACC, tile.BLOCK_K),  # Triton needs it <= BLOCK_K
           **common)
    return y


# == 6. The public functions: check, then launch ==================================================
def quantize_activation(x: torch.Tensor, *, scale=None, quant_tile: Optional[tuple[int, int]] = None) -> QuantizedTensor:
    """x bf16/fp16 [..., K] (any K >= 1, any strides; NaN/Inf: docs/formats.md's non-finite rule,
    its row's scale is NaN) -> QuantizedTensor(fp8_channel activation, data float8_e4m3fn [M, K],
    scale float32 [M], block_shape (1, K)), bit for bit ``formats.quantize(x, "fp8_channel",
    role="activation", scale=scale)``. scale: one static positive scale for every row (number or
    0-d tensor, e.g. a calibrated per-tensor input_scale); None: each row's max(amax, AMAX_FLOOR) /
    448. quant_tile: (BLOCK_M, BLOCK_K) of a program (BLOCK_M rows, K walked BLOCK_K at a time).
    ValueError: x not bf16/fp16 with K >= 1, a non-positive or non-finite scale."""
    check_activation(x, None, K_MULTIPLE, FMT)
    return _quantize(flatten_rows(x), scale, quant_tile)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None,
         tile: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] of out_dtype (bf16, fp16, fp32) = (qx . qw^T) * sx[m] * sw[n] (+ bias [N],
    fp32/bf16/fp16, added in fp32): natively the block-scaled MMA with unit scales, portably a plain
    fp8 tl.dot. xq: fp8_channel activation [M, K] (scale float32 [M]); qweight: fp8_channel weight
    [N, K] (scale float32 [N]). path: None (gemm_path's) or forced; tile: the GEMM's tile.
    ValueError: a wrong operand (format, role, K, device, a scale of the wrong length), bias or
    out_dtype, or a path route_path refuses."""
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    check_quantized_activation(xq, FMT, K)  # its scale vector too: the epilogue reads sx[0:M]
    _, path, tile = _plan(M, N, K, device_capability(qweight.device), path=path, tile=tile)
    return _launch_gemm(path, tile, xq, qweight, bias, out_dtype)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           scale=None, path: Optional[str] = None, tile: Optional[TileConfig] = None,
           quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """y [..., N] of x's dtype = x . W^T (+ bias [N]) with x quantized per token on the fly
    (quantize_activation's ``scale``); exactly the kernels of ``route``. x: bf16/fp16 [..., K], any
    strides; qweight: fp8_channel [N, K] on x's device. path, tile, quant_tile: as gemm and
    quantize_activation. ValueError naming the argument: x (dtype, K, device), the weight (its
    scale length too), bias, a bad static scale, or a bad path."""
    check_linear(x, qweight, bias, FMT, K_MULTIPLE)
    return linear_unchecked(x, qweight, bias, scale=scale, path=path, tile=tile, quant_tile=quant_tile)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     scale=None, path: Optional[str] = None, tile: Optional[TileConfig] = None,
                     quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``linear`` without its argument checks, for a caller that made them (dispatch's bound call):
    the same arguments and result; wrong arguments fail inside the kernels or give wrong numbers (a
    static ``scale`` number is still read by static_scale: ValueError for a bad one)."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    _, path, tile = _plan(x2.shape[0], N, K, device_capability(qweight.device), path=path, tile=tile)
    xq = _quantize(x2, scale, quant_tile)
    return _launch_gemm(path, tile, xq, qweight, bias, x.dtype).reshape(*x.shape[:-1], N)
