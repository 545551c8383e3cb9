"""Per-tensor FP8 (fp8_tensor) on Hopper (sm_90): the production kernels and their route.

The lesson (``kernels_triton.fp8_tensor``) teaches this GEMM; this module runs it on the H200.
What differs from the lesson, by M:

    quantize   the lesson's two-stage quantizer (amax partials over M and K, then scale and
               codes), launched with programmatic dependent launch (_pdl)
    M <= 16    _fp8_decode's swapped-operand wgmma kernel (the weight on wgmma's 64-row side;
               TENSOR_DECODE_TILE: deep pipeline, split-K to half the SMs), then split-K's
               ordered reduction when it splits
    M <= 256   the lesson's fp8 tl.dot GEMM with split-K at M <= 64 (hopper._tiles.e4m3_config)
    M > 256    _fp8_prefill's TMA-descriptor kernel when K is a multiple of 16 and both operands
               suit TMA (_fp8_prefill.tma_ok); otherwise the fp8 tl.dot GEMM on the same tile, or
               on 128 x 128 x 128 with 8 warps and 4 stages when K is not a multiple of 16

``route`` is that table as data; ``linear`` computes it once and launches exactly its kernels.
``imprecise_acc`` is Hopper's fp8 wgmma promotion interval (max_num_imprecise_acc): the
accumulator is promoted to fp32 every IMPRECISE_ACC products (never promoting loses about 3 bits
at K = 8192; docs/results.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX
from formats.validate import static_scale

from .._codecs import abs_or_inf, amax_or_nan, dequantize_e4m3, encode_e4m3, grouped_tile, nan_if_nonfinite, round_to_bf16_rne
from .._common import (check_activation, check_bias, check_gemm_operands, check_weight, flatten_rows, interpreting,
                       kernel_bias, launch)
from ..tuning import int_specialization, quant_config
from ._route import Route, TileConfig, check_device, check_route, e4m3_operand, sm_count
from . import supported  # noqa: F401  (each format module answers supported(capability))
from ._fp8_decode import TENSOR_SCALE, decode_config, launch_fp8_decode
from ._fp8_prefill import TENSOR_PREFILL_TILE, launch_fp8_prefill, tma_ok
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._tiles import e4m3_config
from ._twopass import ALPHA_SCALES, launch_splitk_reduce, splitk_plan, splitk_workspace, store_splitk_partial

FMT = "fp8_tensor"
K_MULTIPLE = 1
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
PARTIALS_BLOCK = 1024  # partial maxima reduced per step in stage 2
IMPRECISE_ACC = 128  # default max_num_imprecise_acc: fp32 promotion every 128 products
DECODE_MAX_M = 16
PREFILL_MIN_M = 257  # above the medium tiles of e4m3_config (M <= 256)
LARGE_TILE = TileConfig(128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4)  # M > 256, K % 16 != 0


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
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    """partials[pid_m * Pk + pid_k] = max |x| over rows [pid_m*BLOCK_M, (pid_m+1)*BLOCK_M) and the
    K tiles pid_k, pid_k + Pk, ... The grid spans K as well as M: a program walking all of K issues
    its loads one after another (at decode, one program would walk all of K = 8192 alone)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pk = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_off = offs_m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    pdl_wait(USE_PDL)  # x is the previous kernel's output
    for k0 in range(pid_k * BLOCK_K, K, num_pk * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        # x tile [BLOCK_M, BLOCK_K]; masked elements read as 0, which never raises a max of |x|
        x = tl.load(x_ptr + row_off[:, None] + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(abs_or_inf(x.to(tl.float32)), axis=1))  # +Inf marks a NaN/Inf
    pdl_launch_dependents(USE_PDL)
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
    PARTIALS_BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """q[tile] = e4m3(x[tile] / scale); with a dynamic scale, also scale = max(amax, floor) / 448."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_wait(USE_PDL)  # the partials (and x) come from earlier kernels
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
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    q = encode_e4m3(tl.math.div_rn(nan_if_nonfinite(x), scale))  # NaN/Inf -> 0x7F, static scale too
    pdl_launch_dependents(USE_PDL)
    q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :].to(tl.int64) * stride_qk
    tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _gemm_kernel(
    # pointers
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr,
    ws_ptr,  # SPLIT_K > 1: fp32 workspace [SPLIT_K, M, N]; _twopass reduces it and runs the epilogue
    # dimensions
    M, N, K, K_PER,  # K_PER: K elements per split (a multiple of BLOCK_K; K when SPLIT_K == 1)
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    # meta-parameters
    HAS_BIAS: tl.constexpr, DOT_FP8: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y. x_ptr/w_ptr hold e4m3 codes: float8e4nv when DOT_FP8
    (GPU), uint8 otherwise (interpreter, decoded to fp32 before the dot)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    # x_ptrs is [BLOCK_M, BLOCK_K]; w_ptrs is [BLOCK_K, BLOCK_N], i.e. a tile of W^T read from W [N, K]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    # ----- K loop: a plain matmul of the codes, fp32 accumulator [BLOCK_M, BLOCK_N] -----
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 - k_lo + offs_k) < K
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if DOT_FP8:
            # Hopper: promote the fp8 wgmma accumulator into fp32 every IMPRECISE_ACC (128) products;
            # Triton's default (2^30) never does and loses ~3 bits at large K.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(dequantize_e4m3(a), dequantize_e4m3(b), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if SPLIT_K > 1:  # a partial sum of this K range; the scales and bias come in the reduction
        store_splitk_partial(ws_ptr, acc, pid_k, offs_m, offs_n, M, N, (offs_m[:, None] < M) & (offs_n[None, :] < N))
        return

    # ----- epilogue: the two per-tensor scales, then the bias -----
    y = acc * (tl.load(sx_ptr) * tl.load(sw_ptr))  # scales together first: acc * sx can overflow
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        y = round_to_bf16_rne(y)  # interpreter: its fp32 -> bf16 cast truncates
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ---------------------------------------------------------------------------------------------
# The route: which kernels, which tile, why
# ---------------------------------------------------------------------------------------------
def _gemm_plan(M: int, N: int, K: int, n_sms: int, tma_aligned: bool) -> tuple[str, TileConfig, str]:
    """(GEMM kind "decode" | "prefill" | "portable", its tile, why) for M >= 1 rows."""
    if M <= DECODE_MAX_M:
        return "decode", decode_config(M, N, K, TENSOR_SCALE, n_sms), \
            f"M={M} <= {DECODE_MAX_M}: the swapped wgmma decode kernel, split-K by the SM count ({n_sms})"
    if M >= PREFILL_MIN_M:
        if K % 16:
            return "portable", LARGE_TILE, f"M={M} > 256 but K={K} is not a multiple of 16 (TMA): the fp8 tl.dot GEMM"
        if tma_aligned:
            return "prefill", TENSOR_PREFILL_TILE, f"M={M} > 256, K % 16 == 0: the TMA-descriptor prefill kernel"
        return "portable", TENSOR_PREFILL_TILE, f"M={M} > 256 but an operand is not TMA-aligned: the fp8 tl.dot GEMM"
    return "portable", e4m3_config(M, N, K), f"16 < M={M} <= 256: the fp8 tl.dot GEMM (split-K at M <= 64)"


def _gemm_kernels(kind: str, cfg: TileConfig, K: int) -> tuple[tuple[str, ...], int]:
    """(kernel names, split-K launched) of a GEMM plan."""
    if kind == "prefill":
        return ("fp8_prefill_kernel",), 1
    n_split = splitk_plan(K, cfg)[0]
    gemm = "fp8_decode_gemm_kernel" if kind == "decode" else "_gemm_kernel"
    return (gemm,) + (("splitk_reduce_kernel",) if n_split > 1 else ()), n_split


def amax_partials(M: int, K: int, interp: bool) -> int:
    """How many partial maxima stage 1 writes for x [M, K] (its grid: row tiles times K tiles, the K
    tiles only on a GPU and within PARTIALS_BLOCK); stage 2's ``num_partials``."""
    block_m, block_k = quant_config(M, K, interp, group=32)
    pm = triton.cdiv(M, block_m)
    pk = 1 if interp else max(1, min(triton.cdiv(K, block_k), PARTIALS_BLOCK // pm))
    return pm * pk


def route(M: int, N: int, K: int, *, capability, sm_count: int, a16: bool = False, scale=None,
          tma_aligned: bool = True) -> Route:
    """The kernels ``linear`` launches for an [M, K] x [N, K]^T fp8_tensor problem on sm_90.

    Args:
        M, N, K: the problem (M rows of activation, N output features, K the reduction).
        capability: the device's (major, minor); must be (9, 0) (``supported``).
        sm_count: the device's SM count (the decode kernel's split-K target).
        a16: must be False (fp8_tensor has no weight-only mode).
        scale: the activation option of ``linear``: a static scale skips the amax kernel.
        tma_aligned: whether both e4m3 operands suit TMA (``_fp8_prefill.tma_ok``); the quantized
            activation always does, a weight view may not.
    Returns:
        Route(impl="hopper", kernels, tile, split_k, why).
    Raises:
        ValueError: a capability other than sm_90 (naming it and why), a16=True, or a negative size.
    """
    check_route(FMT, capability, a16, M, N, K)
    if M == 0:
        return Route("hopper", (), "", 1, "M=0: nothing to launch")
    quant = ("_quantize_kernel",) if scale is not None else ("_amax_partials_kernel", "_quantize_kernel")
    kind, cfg, gwhy = _gemm_plan(M, N, K, sm_count, tma_aligned)
    kernels, n_split = _gemm_kernels(kind, cfg, K)
    options = (("gemm", kind), ("config", cfg))
    if scale is None:  # stage 2's M-derived int (one compile per class)
        options += (("num_partials", int_specialization(amax_partials(M, K, False))),)
    return Route("hopper", quant + kernels, str(cfg), n_split, gwhy, options)


def tile_config(M: int, N: int, K: int, device=None) -> TileConfig:
    """The GEMM tile ``gemm`` launches for M rows on ``device`` (None: the current GPU), assuming
    TMA-aligned operands (what the bench reports)."""
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return _gemm_plan(max(M, 1), N, K, sm_count(dev), True)[1]


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def quantize_activation(x: torch.Tensor, *, scale=None) -> QuantizedTensor:
    """The lesson's quantize_activation (bit for bit ``formats.quantize(x, "fp8_tensor",
    role="activation", scale=scale)``) with PDL and the decode-sized quantizer tile (quant_config).

    Args:
        x: bfloat16/float16 [..., K] (any leading dims, any strides); NaN/Inf follow the non-finite
            rule (docs/formats.md).
        scale: static scale (a positive number or 0-d tensor); None for max(amax, AMAX_FLOOR) / 448.
    Returns:
        QuantizedTensor(fmt="fp8_tensor", role="activation", data float8_e4m3fn [M, K], scale float32 0-d).
    Raises:
        ValueError: x not a bf16/fp16 tensor with K >= 1, or a non-positive/non-finite ``scale``.
    """
    check_activation(x, None, K_MULTIPLE, FMT)
    x2 = flatten_rows(x)
    M, K = x2.shape
    s = torch.empty((), dtype=torch.float32, device=x.device) if scale is None else static_scale(scale, x.device)
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if M == 0:
        if scale is None:  # the oracle's scale of an empty tensor: the amax floor over 448
            s = torch.full((), AMAX_FLOOR, dtype=torch.float32, device=x.device) / E4M3_MAX
        return QuantizedTensor(FMT, "activation", data, s, None, None, (M, K))
    interp = interpreting()
    block_m, block_k = quant_config(M, K, interp, group=32)
    partials = s  # unused placeholder pointer when the scale is static
    num_partials = 0
    if scale is None:
        num_partials = amax_partials(M, K, interp)
        pm = triton.cdiv(M, block_m)
        pk = num_partials // pm
        partials = torch.empty(num_partials, dtype=torch.float32, device=x.device)
        launch(_amax_partials_kernel, (pm, pk),
               x2, partials, M, K, x2.stride(0), x2.stride(1), BLOCK_M=block_m, BLOCK_K=block_k,
               **pdl_launch(x.device))
    q = data.view(torch.uint8)
    launch(_quantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(K, block_k)),
           x2, q, s, partials, M, K, num_partials,
           x2.stride(0), x2.stride(1), q.stride(0), q.stride(1),
           STATIC_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_K=block_k, PARTIALS_BLOCK=PARTIALS_BLOCK,
           **pdl_launch(x.device))
    return QuantizedTensor(FMT, "activation", data, s, None, None, (M, K))


def _run_gemm(kind: str, cfg: TileConfig, xq, qweight, bias, y, imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """Launch one GEMM plan into y [M, N] (bias already kernel_bias's)."""
    if kind == "decode":
        return launch_fp8_decode(xq.data.contiguous(), qweight.data.contiguous(), xq.scale, qweight.scale, bias, y,
                                 imprecise_acc=imprecise_acc, config=cfg)
    if kind == "prefill":
        return launch_fp8_prefill(xq.data, qweight.data, xq.scale, qweight.scale, bias, y, config=cfg,
                                  imprecise_acc=imprecise_acc)
    M, N = y.shape
    K = qweight.k
    dot_fp8 = not interpreting()
    x = e4m3_operand(xq.data, dot_fp8)
    w = e4m3_operand(qweight.data, dot_fp8)
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    launch(_gemm_kernel, (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), n_split),
           x, w, xq.scale, qweight.scale, bias if bias is not None else y, y, ws,
           M, N, K, k_per,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
           HAS_BIAS=bias is not None, DOT_FP8=dot_fp8, ROUND_BF16=not dot_fp8 and y.dtype == torch.bfloat16,
           BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
           SPLIT_K=n_split, IMPRECISE_ACC=min(imprecise_acc, cfg.BLOCK_K),  # Triton needs it <= BLOCK_K
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if n_split > 1:
        launch_splitk_reduce(ws, y, bias=bias, alpha_mode=ALPHA_SCALES, s1=xq.scale, s2=qweight.scale)
    return y


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """y = (qx . qw^T) * sx * sw (+ bias) on sm_90, by the route's GEMM (module docstring).

    Args:
        xq: fp8_tensor activation QuantizedTensor [M, K]; qweight: fp8_tensor weight [N, K], linear layout.
        bias: optional float32/bf16/fp16 [N], added in fp32 in the epilogue.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        imprecise_acc: max_num_imprecise_acc of the fp8 wgmma (capped at BLOCK_K).
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
    return _run_gemm(kind, cfg, xq, qweight, kernel_bias(bias), y, imprecise_acc)


def execute(r: Route, x: torch.Tensor, qweight: QuantizedTensor, bias=None, *, scale=None,
            imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """Run the route ``r`` (this module's ``route`` for x's rows) on checked operands: the
    quantizer, then the GEMM plan the route names. ``linear`` is route + execute; tests run a route
    of sm_90 here under the interpreter."""
    N = qweight.shape[0]
    x2 = flatten_rows(x)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if not r.kernels:
        return y.reshape(*x.shape[:-1], N)
    opts = dict(r.options)
    xq = quantize_activation(x2, scale=scale)
    _run_gemm(opts["gemm"], opts["config"], xq, qweight, kernel_bias(bias), y, imprecise_acc)
    return y.reshape(*x.shape[:-1], N)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           scale=None, imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """y = x . W^T (+ bias) with x quantized to per-tensor FP8 on the fly, on sm_90: route() once,
    then exactly its kernels.

    Args:
        x: bfloat16/float16 [..., K], any strides.
        qweight: fp8_tensor weight QuantizedTensor [N, K] (linear layout) on x's device.
        bias: optional float32/bf16/fp16 [N].
        scale: static activation scale (see quantize_activation); None for dynamic.
        imprecise_acc: max_num_imprecise_acc of the fp8 wgmma (capped at BLOCK_K).
    Returns:
        [..., N] tensor of x's dtype.
    Raises:
        ValueError: naming the argument: wrong weight format, x dtype, K mismatch, devices, bias
            shape or dtype, or a device that is not sm_90.
    """
    check_weight(qweight, FMT)
    N, K = qweight.shape
    check_activation(x, K, K_MULTIPLE, FMT, device=qweight.device)
    check_bias(bias, N, qweight.device)
    cap = check_device(FMT, qweight.device)
    M = x.numel() // K if K else 0
    r = route(M, N, K, capability=cap, sm_count=sm_count(qweight.device), scale=scale,
              tma_aligned=tma_ok(qweight.data))
    return execute(r, x, qweight, bias, scale=scale, imprecise_acc=imprecise_acc)
