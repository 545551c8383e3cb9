"""Per-channel FP8 (W8A8) in Triton: per-token activation quantization and the e4m3 GEMM with a
per-row and per-column scale epilogue.

What this file teaches: scales that belong to a whole row of an operand. The weight has one fp32
scale per output channel (row n of W), the activation one per token (row m of x), so each scale
is constant along K and still factors out of the K sum, just not as one number:

    y[m, n] = sum_k (qx[m, k] * sx[m]) * (qw[n, k] * sw[n]) + bias[n]
            = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n] + bias[n]

The K loop is the same plain matrix multiply of e4m3 codes as in fp8_tensor; the epilogue
multiplies the accumulator tile by the outer product of two scale vectors, sx[offs_m] down the
rows and sw[offs_n] across the columns. (The compressed-tensors FP8_DYNAMIC checkpoints, the most
common FP8 recipe, are this format: weights per channel, activations per token, dynamically.)

Activation quantization (spec: formats/fp8_channel.py, the oracle), one row at a time:

    sx[m]    = max(amax(|x[m, :]|), AMAX_FLOOR) / 448     (div_rn; or one static ``scale`` for all rows)
    qx[m, k] = e4m3(x[m, k] / sx[m])                     (div_rn, then RNE with saturation to +-448)

The amax is a reduction along a row only, so, unlike fp8_tensor's per-tensor amax, it needs no
second launch: _quantize_kernel gives each program whole rows (one row on a GPU: one program per
token) and walks K twice, once for the amax and once for the codes:

    for each row m of this program:                       (BLOCK_M rows)
        amax = 0
        for k0 in range(0, K, BLOCK_K):   amax = max(amax, max |x[m, k0:k0+BLOCK_K]|)
        sx[m] = max(amax, AMAX_FLOOR) / 448               (a static scale skips this loop)
        for k0 in range(0, K, BLOCK_K):   qx[m, k0:k0+BLOCK_K] = e4m3(x[m, k0:k0+BLOCK_K] / sx[m])

GEMM K loop (_gemm_kernel), one program per [BLOCK_M, BLOCK_N] output tile:

    acc = 0                                           (fp32 [BLOCK_M, BLOCK_N])
    for k0 in range(0, K, BLOCK_K):
        a = qx[offs_m, k0:k0+BLOCK_K]                 (e4m3 [BLOCK_M, BLOCK_K])
        b = qw[offs_n, k0:k0+BLOCK_K]^T               (e4m3 [BLOCK_K, BLOCK_N])
        acc = dot(a, b, acc)                          (fp32 accumulation)
    y = acc * (sx[offs_m][:, None] * sw[offs_n][None, :]) + bias[offs_n]

On a GPU the e4m3 tiles go straight into tl.dot (fp8 tensor cores; on Hopper with
max_num_imprecise_acc = 128, which promotes the wgmma accumulator into fp32 after every K step);
under the interpreter the codes are dequantized to fp32 with _codecs.dequantize_e4m3 first
(exact; the interpreter's fp8 paths are not trusted for anything but loads).

Two paths (``gemm_path`` picks by device; ``path=`` forces one): the portable kernel above, and on
SM12x ``_native_gemm_kernel``: the same codes through tl.dot_scaled with every E8M0 scale 127
(2^0), because there the plain fp8 MMA runs at half the 8-bit rate and the block-scaled one at
full rate (triton#11320); the per-row and per-column scales stay in the epilogue either way (the
MMA's own scales are per 32 elements of K, powers of two: they cannot hold sx[m] or sw[n]). One
program per output tile; ``route`` names the kernels a call launches.

Constraints: any K >= 1 (no block structure); x bf16/fp16 [..., K]; weight a linear-layout
fp8_channel QuantizedTensor [N, K] (scale float32 [N]). NaN/Inf in x follow the non-finite rule
of docs/formats.md: with the dynamic scales the row's scale becomes NaN and every code of the row
0x7F (only that row of y is NaN); with a static scale the element's code is 0x7F, and again only
its row is NaN. An all-zero row has the finite scale AMAX_FLOOR / 448 and zero codes, so its
output row is the bias.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX
from formats.validate import check_quantized_activation, static_scale

from ._codecs import (abs_or_inf, amax_or_nan, dequantize_e4m3, encode_e4m3, grouped_tile, nan_if_nonfinite,
                      round_to_bf16_rne)
from ._common import (QUANT_DECODE_ROW_BLOCK, Route, THIS_DEVICE, check_activation, check_bias, check_gemm_operands,
                      check_weight, default_device, device_capability, e4m3_operand, e4m3_portable_config,
                      flatten_rows, interpreting, kernel_bias, launch, native_config, quant_config, route_path)

__all__ = ["gemm", "linear", "linear_unchecked", "quantize_activation", "route", "tile_config"]

FMT = "fp8_channel"
K_MULTIPLE = 1  # per-row scaling puts no constraint on K
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# max_num_imprecise_acc of the Hopper fp8 dot: promote the wgmma accumulator to fp32 every 128
# products (never promoting loses about 3 bits at K = 8192), as in fp8_tensor
IMPRECISE_ACC = 128


# ---------------------------------------------------------------------------------------------
# Activation quantization: one row's scale, then its codes, in one program
# ---------------------------------------------------------------------------------------------
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
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1] row starts (x may be strided)
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm

    # ----- pass 1: each row's scale [BLOCK_M] -----
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

    # ----- pass 2: the codes, a [BLOCK_M, BLOCK_K] tile at a time, each row by its own scale -----
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = m_ok[:, None] & (offs_k[None, :] < K)
        x = tl.load(x_rows + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        q = encode_e4m3(tl.math.div_rn(nan_if_nonfinite(x), scale[:, None]))  # NaN/Inf -> 0x7F, static scale too
        tl.store(q_rows + offs_k[None, :].to(tl.int64) * stride_qk, q, mask=mask)


# ---------------------------------------------------------------------------------------------
# The epilogue: one scale per output row (token), one per output column (channel), then the bias
# ---------------------------------------------------------------------------------------------
@triton.jit
def _scale_rows_and_columns(acc, offs_m, offs_n, m_ok, n_ok, sx_ptr, sw_ptr, bias_ptr,
                            HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 * (sx[offs_m] x sw[offs_n]) + bias[offs_n], rounded to bf16
    values (RNE) when ROUND_BF16 (the interpreter's fp32 -> bf16 cast truncates)."""
    sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)  # [BLOCK_M]: the tokens' scales
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)  # [BLOCK_N]: the channels' scales
    # the two scales meet first (their outer product): acc * sx alone can overflow where y does not
    y = acc * (sx[:, None] * sw[None, :])
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        y = round_to_bf16_rne(y)
    return y


# ---------------------------------------------------------------------------------------------
# GEMM, portable path: y = (qx . qw^T) * sx[m] * sw[n] + bias
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gemm_kernel(
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
            acc = tl.dot(dequantize_e4m3(a), dequantize_e4m3(b), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ----- epilogue: sx down the rows, sw across the columns, then the bias -----
    y = _scale_rows_and_columns(acc, offs_m, offs_n, m_ok, n_ok, sx_ptr, sw_ptr, bias_ptr, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# GEMM, native path (SM12x): the codes through the block-scaled MMA with unit scales
# ---------------------------------------------------------------------------------------------
@triton.jit
def _native_gemm_kernel(
    # pointers
    x_ptr, w_ptr,  # e4m3 codes as uint8: x [M, K], w [N, K] (K contiguous)
    sx_ptr, sw_ptr,  # the per-row scales, float32 [M] and [N]
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
    y = _scale_rows_and_columns(acc, offs_m, offs_n, m_ok, n_ok, sx_ptr, sw_ptr, bias_ptr, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# The route: which kernels a call launches, with which tile, and why
# ---------------------------------------------------------------------------------------------
def route(M: int, N: int, K: int, *, capability=None, sm_count: int = 1, a16: bool = False, path=None,
          scale=None) -> Route:
    """The kernels ``linear`` launches for an [M, K] x [N, K]^T fp8_channel problem.

    Args:
        M, N, K: activation rows, output features, reduction length (>= 0).
        capability: the device's (major, minor); None: no CUDA device (the interpreter).
        sm_count: the device's SM count (one program per output tile: it does not change the route).
        a16: must be False (fp8_channel has no weight-only mode).
        path: None (gemm_path's choice), "native" or "portable".
        scale: ``linear``'s activation option; a static scale changes no launch (the quantizer
            skips its amax loop inside the same kernel).
    Returns:
        Route(impl="triton", kernels=("_quantize_kernel", the GEMM), tile, split_k=1, why).
    Raises:
        ValueError: a16=True, a negative size, or a bad path (route_path).
    """
    if a16:
        raise ValueError(f"a16=True (weight-only) is not a mode of {FMT!r}: its activations are quantized")
    if min(M, N, K) < 0:
        raise ValueError(f"M, N, K must be >= 0, got {(M, N, K)}")
    gemm_path_, why = route_path(path, FMT, capability)
    if M == 0:
        return Route("triton", (), "", 1, "M=0: nothing to launch")
    gemm = "_native_gemm_kernel" if gemm_path_ == "native" else "_gemm_kernel"
    cfg = tile_config(M, N, K, gemm_path_, capability)
    return Route("triton", ("_quantize_kernel", gemm), str(cfg), 1, why, (("path", gemm_path_), ("config", cfg)))


def tile_config(M: int, N: int, K: int, path=None, capability=THIS_DEVICE):
    """The GEMM's tile for an [M, K] x [N, K]^T problem and ``path`` (None: gemm_path's choice) on a
    device of ``capability`` ((major, minor); None: the interpreter; THIS_DEVICE, the default: this
    process's device), as ``route`` reports it and gemm launches it: fp8_tensor's tiles (the K loop
    is the same; only the epilogue differs)."""
    if capability is THIS_DEVICE:
        capability = device_capability(default_device())
    if route_path(path, FMT, capability)[0] == "native":
        return native_config(M, N, K, capability)
    return e4m3_portable_config(M, N, K, capability)


def quant_tile(M: int, K: int, interp: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the quantizer: on a GPU one program per row (BLOCK_M = 1) walking K
    QUANT_DECODE_ROW_BLOCK columns at a time; under the interpreter, where every program costs
    milliseconds of Python, up to 256 rows and 1024 columns per program (quant_config)."""
    if interp:
        return quant_config(M, K, True, group=16)
    return 1, QUANT_DECODE_ROW_BLOCK


def quantize_activation(x: torch.Tensor, *, scale=None) -> QuantizedTensor:
    """Quantize activations to per-token FP8 with the Triton kernel, bit for bit as
    ``formats.quantize(x, "fp8_channel", role="activation", scale=scale)``.

    Args:
        x: bfloat16/float16 [..., K] (any leading dims, any strides); a NaN/Inf follows the
            non-finite rule (docs/formats.md: its row's scale is NaN).
        scale: one static scale for every row (a positive number or 0-d tensor, e.g. a calibrated
            per-tensor input_scale); None for the dynamic per-row max(amax, AMAX_FLOOR) / 448.
    Returns:
        QuantizedTensor(fmt="fp8_channel", role="activation", data float8_e4m3fn [M, K],
        scale float32 [M] on x's device, block_shape (1, K)), M = prod(leading dims).
    Raises:
        ValueError: x not a bf16/fp16 tensor with K >= 1, or a non-positive/non-finite ``scale``.
    """
    check_activation(x, None, K_MULTIPLE, FMT)
    return _quantize(flatten_rows(x), scale)


def _quantize(x2: torch.Tensor, scale) -> QuantizedTensor:
    """quantize_activation on x2 [M, K], without the argument checks: allocate, launch."""
    M, K = x2.shape
    s = torch.empty((M,), dtype=torch.float32, device=x2.device)
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    if M > 0:
        static = s if scale is None else static_scale(scale, x2.device)  # s: an unread placeholder pointer
        block_m, block_k = quant_tile(M, K, interpreting())
        q = data.view(torch.uint8)
        launch(_quantize_kernel, (triton.cdiv(M, block_m),),
               x2, q, s, static,
               M, K,
               x2.stride(0), x2.stride(1), q.stride(0), q.stride(1),
               STATIC_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_K=block_k)
    return QuantizedTensor(FMT, "activation", data, s, None, (1, K), (M, K))


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None) -> torch.Tensor:
    """y = (qx . qw^T) * sx[m] * sw[n] (+ bias) on quantized operands (native: the block-scaled MMA
    with unit scales; portable: a plain fp8 tl.dot; gemm_path picks by device).

    Args:
        xq: fp8_channel activation QuantizedTensor [M, K] (data float8_e4m3fn, scale float32 [M]).
        qweight: fp8_channel weight QuantizedTensor [N, K] (scale float32 [N]), linear layout.
        bias: optional float32/bf16/fp16 [N], added in fp32 in the epilogue.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        path: None (gemm_path's choice for the weight's device), "native" or "portable".
    Returns:
        [M, N] tensor of out_dtype (empty when M == 0).
    Raises:
        ValueError: wrong formats/roles, a scale of the wrong length, K mismatch, different devices,
            bad bias or out_dtype, unknown path.
    """
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    check_quantized_activation(xq, FMT, K)  # its scale vector too: the epilogue reads sx[0:M]
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0:
        return y
    cap = device_capability(qweight.device)
    gemm_path_ = route_path(path, FMT, cap)[0]
    return _run_gemm(gemm_path_, tile_config(M, N, K, gemm_path_, cap), xq, qweight, kernel_bias(bias), y)


def _run_gemm(gemm_path_: str, cfg, xq, qweight, bias, y) -> torch.Tensor:
    """Launch the GEMM kernel of ``gemm_path_`` with tile ``cfg`` into y [M, N] (bias: kernel_bias's)."""
    M, N = y.shape
    K = qweight.k
    interp = interpreting()
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),)
    sx, sw = xq.scale.contiguous(), qweight.scale.contiguous()
    if gemm_path_ == "native":
        x, w = xq.data.contiguous().view(torch.uint8), qweight.data.contiguous().view(torch.uint8)
        launch(_native_gemm_kernel, grid,
               x, w, sx, sw, bias if bias is not None else y, y,
               M, N, K,
               x.stride(0), w.stride(0), y.stride(0),
               HAS_BIAS=bias is not None, ROUND_BF16=interp and y.dtype == torch.bfloat16,
               BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y
    dot_fp8 = not interp
    x = e4m3_operand(xq.data, dot_fp8)
    w = e4m3_operand(qweight.data, dot_fp8)
    launch(_gemm_kernel, grid,
           x, w, sx, sw, bias if bias is not None else y, y,
           M, N, K,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
           HAS_BIAS=bias is not None, DOT_FP8=dot_fp8, ROUND_BF16=interp and y.dtype == torch.bfloat16,
           BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
           IMPRECISE_ACC=min(IMPRECISE_ACC, cfg.BLOCK_K),  # Triton needs it <= BLOCK_K
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           scale=None, path: Optional[str] = None) -> torch.Tensor:
    """y = x . W^T (+ bias) with x quantized to per-token FP8 on the fly: ``route`` once, then
    exactly its kernels (the quantizer, then the GEMM of its path and tile).

    Args:
        x: bfloat16/float16 [..., K], any strides.
        qweight: fp8_channel weight QuantizedTensor [N, K] (linear layout) on x's device.
        bias: optional float32/bf16/fp16 [N].
        scale: one static activation scale for every token (see quantize_activation); None for
            the dynamic per-token scales.
        path: None (auto for x's device), "native" or "portable" (see gemm).
    Returns:
        [..., N] tensor of x's dtype (empty [..., N] when x has no rows).
    Raises:
        ValueError: naming the argument: wrong weight format or scale length, x dtype, K mismatch,
            devices, bias shape, a bad static scale.
    """
    check_weight(qweight, FMT)
    N, K = qweight.shape
    check_activation(x, K, K_MULTIPLE, FMT, device=qweight.device)
    check_bias(bias, N, qweight.device)
    return linear_unchecked(x, qweight, bias, scale=scale, path=path)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     scale=None, path: Optional[str] = None) -> torch.Tensor:
    """``linear`` without its argument checks (weight, x, bias), for a caller that checked them
    once (a prepared layer): the same route, the same launches, the same result. Arguments and
    return value as ``linear``; a malformed argument is not named here (a static ``scale`` is
    still read by static_scale: ValueError for a bad number)."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    M = x2.shape[0]
    r = route(M, N, K, capability=device_capability(qweight.device), path=path, scale=scale)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if r.kernels:
        xq = _quantize(x2, scale)
        opts = dict(r.options)
        _run_gemm(opts["path"], opts["config"], xq, qweight, kernel_bias(bias), y)
    return y.reshape(*x.shape[:-1], N)
