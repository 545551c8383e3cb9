"""Block FP8 (fp8_block: 1x128 activation groups, 128x128 weight blocks) on Hopper (sm_90): the
production kernels and their route.

The lesson (``kernels_triton.fp8_block``) teaches this GEMM; this module runs it on the H200:

    quantize   the lesson's per-group quantizer, launched with programmatic dependent launch (_pdl)
    M <= 16    _fp8_decode's swapped-operand wgmma kernel with 128-wide scale blocks (split-K by
               the SM count), then split-K's ordered reduction when it splits
    M <= 256   the lesson's fp8 tl.dot GEMM with split-K at M <= 64 (hopper._tiles.e4m3_config)
    M > 256    _fp8_prefill's TMA-descriptor kernel when both operands suit TMA; otherwise the
               fp8 tl.dot GEMM on the same tile

``route`` is that table as data; ``linear`` computes it once and launches exactly its kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX, FP8_BLOCK

from .._codecs import abs_or_inf, amax_or_nan, ceil_log2, dequantize_e4m3, encode_e4m3, exp2_int, grouped_tile
from .._common import (check_activation, check_bias, check_gemm_operands, check_weight, flatten_rows, interpreting,
                       kernel_bias, launch)
from ..tuning import quant_config
from ._route import Route, TileConfig, check_device, check_route, e4m3_operand, sm_count
from . import supported  # noqa: F401  (each format module answers supported(capability))
from ._fp8_decode import FP8_BLOCK_SCALE, decode_config, launch_fp8_decode
from ._fp8_prefill import BLOCK_PREFILL_TILE, launch_fp8_prefill, tma_ok
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._tiles import e4m3_config
from ._twopass import NO_ALPHA, epilogue, launch_splitk_reduce, splitk_plan, splitk_workspace, store_splitk_partial

FMT = "fp8_block"
K_MULTIPLE = FP8_BLOCK  # 128
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_GROUP = tl.constexpr(FP8_BLOCK)
DECODE_MAX_M = 16
PREFILL_MIN_M = 257  # above the medium tiles of e4m3_config (M <= 256)


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
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    """q = e4m3(x / s) and s = max(amax, floor) / 448 (optionally 2^ceil(log2 s)) per 1x128 group."""
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = kb * _GROUP + tl.arange(0, _GROUP)
    row_ok = offs_m < M
    pdl_wait(USE_PDL)  # x is the previous kernel's output
    # x tile [BLOCK_M, 128]: exactly one group per row, so the group amax is a row max
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk
    x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(abs_or_inf(x), axis=1)  # [BLOCK_M]; +Inf marks a NaN/Inf in the group
    scale = tl.math.div_rn(amax_or_nan(amax, _AMAX_FLOOR), _E4M3_MAX)  # NaN: all codes become 0x7F
    if UE8M0:
        # power-of-two scale, exponent kept in the float32 normal range as formats.codecs.pow2_ceil
        scale = tl.where(scale != scale, scale, exp2_int(tl.minimum(tl.maximum(ceil_log2(scale), -126), 127)))
    q = encode_e4m3(tl.math.div_rn(x, scale[:, None]))
    pdl_launch_dependents(USE_PDL)
    q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :].to(tl.int64) * stride_qk
    tl.store(q_ptrs, q, mask=row_ok[:, None])
    tl.store(s_ptr + offs_m.to(tl.int64) * stride_sm + kb * stride_sk, scale, mask=row_ok)


@triton.jit
def _gemm_kernel(
    # pointers
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr,
    ws_ptr,  # SPLIT_K > 1: fp32 workspace [SPLIT_K, M, N]; _twopass reduces it and adds the bias
    # dimensions
    M, N, K, K_PER,  # K_PER: K elements per split (a multiple of 128; K when SPLIT_K == 1)
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_sxm, stride_sxk, stride_swn, stride_swk, stride_ym, stride_yn,
    # meta-parameters
    HAS_BIAS: tl.constexpr, DOT_FP8: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    """One [BLOCK_M, BLOCK_N] tile of y (or, split-K, its sum over K blocks [kb_lo, kb_hi)); BLOCK_K
    must be 128 (one scale per K step)."""
    tl.static_assert(BLOCK_K == _GROUP, "block FP8 needs BLOCK_K == 128: one scale per K step")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(1)
    kb_lo = pid_k * (K_PER // BLOCK_K)
    kb_hi = tl.minimum(kb_lo + K_PER // BLOCK_K, K // BLOCK_K)
    offs_k = (kb_lo * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)  # int64: K * stride may pass 2^31
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
    pdl_wait(USE_PDL)  # the quantized activation
    for kb in range(kb_lo, kb_hi):
        a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        if DOT_FP8:
            partial = tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
        else:
            partial = tl.dot(dequantize_e4m3(a), dequantize_e4m3(b))
        sx = tl.load(sx_ptrs + kb * stride_sxk, mask=m_ok, other=0.0)  # [BLOCK_M]
        sw = tl.load(sw_ptrs + kb * stride_swk, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += partial * (sx[:, None] * sw[None, :])  # scales together first: partial * sx can overflow
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    pdl_launch_dependents(USE_PDL)

    if SPLIT_K > 1:  # a partial sum of this K range; the bias comes in the reduction
        store_splitk_partial(ws_ptr, acc, pid_k, offs_m, offs_n, M, N, m_ok[:, None] & n_ok[None, :])
        return

    # ----- epilogue: bias, cast, store -----
    # (ROUND_BF16: the interpreter's fp32 -> bf16 cast truncates, so round to nearest even first)
    # (NO_ALPHA: every scale was applied in the K loop, so the two scale pointers are unused)
    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# The route: which kernels, which tile, why
# ---------------------------------------------------------------------------------------------
def _gemm_plan(M: int, N: int, K: int, n_sms: int, tma_aligned: bool) -> tuple[str, TileConfig, str]:
    """(GEMM kind "decode" | "prefill" | "portable", its tile, why) for M >= 1 rows."""
    if M <= DECODE_MAX_M:
        return "decode", decode_config(M, N, K, FP8_BLOCK_SCALE, n_sms), \
            f"M={M} <= {DECODE_MAX_M}: the swapped wgmma decode kernel, split-K by the SM count ({n_sms})"
    if M >= PREFILL_MIN_M:
        if tma_aligned:
            return "prefill", BLOCK_PREFILL_TILE, f"M={M} > 256: the TMA-descriptor prefill kernel"
        return "portable", BLOCK_PREFILL_TILE, f"M={M} > 256 but an operand is not TMA-aligned: the fp8 tl.dot GEMM"
    return "portable", e4m3_config(M, N, K, block_k=FP8_BLOCK), \
        f"16 < M={M} <= 256: the fp8 tl.dot GEMM (split-K at M <= 64)"


def _gemm_kernels(kind: str, cfg: TileConfig, K: int) -> tuple[tuple[str, ...], int]:
    """(kernel names, split-K launched) of a GEMM plan."""
    if kind == "prefill":
        return ("fp8_prefill_kernel",), 1
    n_split = splitk_plan(K, cfg)[0]
    gemm = "fp8_decode_gemm_kernel" if kind == "decode" else "_gemm_kernel"
    return (gemm,) + (("splitk_reduce_kernel",) if n_split > 1 else ()), n_split


def route(M: int, N: int, K: int, *, capability, sm_count: int, a16: bool = False, ue8m0: bool = False,
          tma_aligned: bool = True) -> Route:
    """The kernels ``linear`` launches for an [M, K] x [N, K]^T fp8_block problem on sm_90.

    Args:
        M, N, K: the problem (K a multiple of 128).
        capability: the device's (major, minor); must be (9, 0) (``supported``).
        sm_count: the device's SM count (the decode kernel's split-K target).
        a16: must be False (fp8_block has no weight-only mode).
        ue8m0: ``linear``'s activation option (power-of-two scales); it does not change the route.
        tma_aligned: whether both e4m3 operands suit TMA (``_fp8_prefill.tma_ok``).
    Returns:
        Route(impl="hopper", kernels, tile, split_k, why).
    Raises:
        ValueError: a capability other than sm_90 (naming it and why), a16=True, or a negative size.
    """
    check_route(FMT, capability, a16, M, N, K)
    if M == 0:
        return Route("hopper", (), "", 1, "M=0: nothing to launch")
    kind, cfg, gwhy = _gemm_plan(M, N, K, sm_count, tma_aligned)
    kernels, n_split = _gemm_kernels(kind, cfg, K)
    return Route("hopper", ("_quantize_kernel",) + kernels, str(cfg), n_split, gwhy,
                 (("gemm", kind), ("config", cfg)))


def tile_config(M: int, N: int, K: int, device=None) -> TileConfig:
    """The GEMM tile ``gemm`` launches for M rows on ``device`` (None: the current GPU), assuming
    TMA-aligned operands (what the bench reports)."""
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return _gemm_plan(max(M, 1), N, K, sm_count(dev), True)[1]


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def quantize_activation(x: torch.Tensor, *, ue8m0: bool = False) -> QuantizedTensor:
    """The lesson's quantize_activation (bit for bit ``formats.quantize(x, "fp8_block",
    role="activation", ue8m0=ue8m0)``) with PDL.

    Args:
        x: bfloat16/float16 [..., K], K a multiple of 128, any strides.
        ue8m0: round every scale up to a power of two (DeepGEMM's UE8M0 scales).
    Returns:
        QuantizedTensor(fmt="fp8_block", role="activation", data float8_e4m3fn [M, K], scale float32 [M, K/128]).
    Raises:
        ValueError: x not bf16/fp16, or K not a positive multiple of 128.
    """
    check_activation(x, None, K_MULTIPLE, FMT)
    x2 = flatten_rows(x)
    M, K = x2.shape
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, K // FP8_BLOCK), dtype=torch.float32, device=x.device)
    if M:
        block_m, _ = quant_config(M, K, interpreting(), group=FP8_BLOCK)
        q = data.view(torch.uint8)
        launch(_quantize_kernel, (triton.cdiv(M, block_m), K // FP8_BLOCK),
               x2, q, scale, M,
               x2.stride(0), x2.stride(1), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
               UE8M0=bool(ue8m0), BLOCK_M=block_m, **pdl_launch(x.device))
    return QuantizedTensor(FMT, "activation", data, scale, None, (1, FP8_BLOCK), (M, K))


def _run_gemm(kind: str, cfg: TileConfig, xq, qweight, bias, y) -> torch.Tensor:
    """Launch one GEMM plan into y [M, N] (bias already kernel_bias's)."""
    if kind == "decode":
        return launch_fp8_decode(xq.data.contiguous(), qweight.data.contiguous(), xq.scale, qweight.scale, bias, y,
                                 scale_k=FP8_BLOCK_SCALE, config=cfg)
    if kind == "prefill":
        return launch_fp8_prefill(xq.data, qweight.data, xq.scale, qweight.scale, bias, y, scale_k=FP8_BLOCK_SCALE,
                                  config=cfg)
    M, N = y.shape
    K = qweight.k
    interp = interpreting()
    dot_fp8 = not interp
    x = e4m3_operand(xq.data, dot_fp8)
    w = e4m3_operand(qweight.data, dot_fp8)
    sx, sw = xq.scale, qweight.scale
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    launch(_gemm_kernel, (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), n_split),
           x, w, sx, sw, bias if bias is not None else y, y, ws,
           M, N, K, k_per,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1),
           sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1), y.stride(0), y.stride(1),
           HAS_BIAS=bias is not None, DOT_FP8=dot_fp8, ROUND_BF16=interp and y.dtype == torch.bfloat16,
           BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
           SPLIT_K=n_split,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(y.device))
    if n_split > 1:
        launch_splitk_reduce(ws, y, bias=bias)
    return y


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = sum over 128-wide K blocks of (qx . qw^T) * sx * sw (+ bias) on sm_90, by the route's
    GEMM (module docstring).

    Args:
        xq: fp8_block activation QuantizedTensor [M, K]; qweight: fp8_block weight [N, K], linear layout.
        bias: optional float32/bf16/fp16 [N], added in fp32 in the epilogue.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
    Returns:
        [M, N] tensor of out_dtype.
    Raises:
        ValueError: wrong formats/roles, K mismatch, different devices, bad bias or out_dtype, or a
            device that is not sm_90.
    """
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    check_device(FMT, qweight.device)
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0:
        return y
    kind, cfg, _ = _gemm_plan(M, N, K, sm_count(qweight.device), tma_ok(xq.data) and tma_ok(qweight.data))
    return _run_gemm(kind, cfg, xq, qweight, kernel_bias(bias), y)


def execute(r: Route, x: torch.Tensor, qweight: QuantizedTensor, bias=None, *, ue8m0: bool = False) -> torch.Tensor:
    """Run the route ``r`` (this module's ``route`` for x's rows) on checked operands: the
    quantizer, then the GEMM plan the route names. ``linear`` is route + execute; tests run a route
    of sm_90 here under the interpreter."""
    N = qweight.shape[0]
    x2 = flatten_rows(x)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if not r.kernels:
        return y.reshape(*x.shape[:-1], N)
    opts = dict(r.options)
    xq = quantize_activation(x2, ue8m0=ue8m0)
    _run_gemm(opts["gemm"], opts["config"], xq, qweight, kernel_bias(bias), y)
    return y.reshape(*x.shape[:-1], N)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           ue8m0: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias) with x quantized to block FP8 (1x128 groups) on the fly, on sm_90:
    route() once, then exactly its kernels.

    Args:
        x: bfloat16/float16 [..., K], K a multiple of 128, any strides.
        qweight: fp8_block weight QuantizedTensor [N, K] (linear layout) on x's device.
        bias: optional float32/bf16/fp16 [N].
        ue8m0: power-of-two activation scales (see quantize_activation).
    Returns:
        [..., N] tensor of x's dtype.
    Raises:
        ValueError: naming the argument: wrong weight format, x dtype, K not a multiple of 128 or
            not the weight's K, devices, bias shape or dtype, or a device that is not sm_90.
    """
    check_weight(qweight, FMT)
    N, K = qweight.shape
    check_activation(x, K, K_MULTIPLE, FMT, device=qweight.device)
    check_bias(bias, N, qweight.device)
    cap = check_device(FMT, qweight.device)
    M = x.numel() // K
    r = route(M, N, K, capability=cap, sm_count=sm_count(qweight.device), ue8m0=ue8m0,
              tma_aligned=tma_ok(qweight.data))
    return execute(r, x, qweight, bias, ue8m0=ue8m0)
