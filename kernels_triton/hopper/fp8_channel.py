"""Per-channel FP8 (fp8_channel, W8A8 with per-token activation scales) on Hopper (sm_90): the
production kernels and their route.

The lesson (``kernels_triton.fp8_channel``) teaches this GEMM: fp8_tensor's plain matmul of e4m3
codes, with an epilogue that multiplies the accumulator tile by sx[m] (per token) x sw[n] (per
output channel). Here the GEMMs are fp8_tensor's Hopper kernels with that epilogue (their
``channel`` switch), and the quantizer spreads each row's K over many programs. By M:

    quantize   two stages, the grid over row tiles and K: ``_row_amax_kernel`` writes per-row
               partial maxima of |x| (each program a tile of rows and every PK-th K tile), then
               ``_quantize_kernel`` (one program per [BLOCK_M, BLOCK_K] tile) reduces its rows'
               partials to sx[m] and encodes the tile with the lesson's fp8_channel_quantize_tile.
               A static scale skips the first stage. The lesson's quantizer gives a program whole
               rows and walks K twice: M programs in all, each a serial K walk.
    M <= 16    _fp8_decode's swapped-operand wgmma kernel (TENSOR_DECODE_TILE), split-K by the SM
               count; a split's partial is scaled by sx x sw before its store, so split-K's
               ordered reduction adds the bias only
    M <= 256   the lesson's fp8 tl.dot GEMM (_portable_gemm_kernel) on the sm_90 e4m3 tile
               (hopper._tiles.e4m3_config), one program per output tile (no split-K: its
               reduction has no row x column scales)
    M > 256    _fp8_prefill's TMA-descriptor kernel when K is a multiple of 16 and both operands
               suit TMA (_fp8_prefill.tma_ok); otherwise the fp8 tl.dot GEMM on the same tile, or on
               128 x 128 x 128 with 8 warps and 4 stages when K is not a multiple of 16

``route`` is that table as data; ``linear`` computes it once and launches exactly its kernels, the
quantizer and the decode kernel with programmatic dependent launch (_pdl).
NaN/Inf follow docs/formats.md's non-finite rule: a row holding one gets a NaN scale (dynamic) or
0x7F codes (static), and only that row of y is NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E4M3_MAX
from formats.validate import check_quantized_activation, static_scale

from .._codecs import abs_or_inf, amax_or_nan
from .._common import (check_activation, check_gemm_operands, check_linear, flatten_rows, interpreting,
                       kernel_bias, launch)
from ..fp8_channel import _portable_gemm_kernel, fp8_channel_quantize_tile
from ..tuning import int_specialization, quant_config
from ._route import Route, TileConfig, check_device, check_route, e4m3_operand, sm_count
from . import supported  # noqa: F401  (each format module answers supported(capability))
from ._fp8_decode import TENSOR_SCALE, decode_config, launch_fp8_decode
from ._fp8_prefill import TENSOR_PREFILL_TILE, launch_fp8_prefill, tma_ok
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._tiles import e4m3_config
from ._twopass import splitk_plan

FMT = "fp8_channel"
K_MULTIPLE = 1
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
IMPRECISE_ACC = 128  # max_num_imprecise_acc: fp32 promotion every 128 products (as fp8_tensor)
DECODE_MAX_M = 16
PREFILL_MIN_M = 257
LARGE_TILE = TileConfig(128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4)  # M > 256, K % 16 != 0
MAX_PARTIALS = 64  # K partials per row at most (stage 2 reduces them in one [BLOCK_M, 64] load)
QUANT_PROGRAMS = 2  # stage 1 aims at this many programs per SM


# ---------------------------------------------------------------------------------------------
# The quantizer: per-row amax partials over K, then scale and codes per tile
# ---------------------------------------------------------------------------------------------
@triton.jit
def _row_amax_kernel(
    x_ptr, partials_ptr,  # partials float32 [M, num_pk]
    M, K, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    """partials[m, pid_k] = max |x[m, k]| over the K tiles pid_k, pid_k + Pk, ... of rows
    [pid_m*BLOCK_M, (pid_m+1)*BLOCK_M); +Inf where a NaN/Inf sits (abs_or_inf)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pk = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    row_off = offs_m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    pdl_wait(USE_PDL)  # x is the previous kernel's output
    for k0 in range(pid_k * BLOCK_K, K, num_pk * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = m_ok[:, None] & (offs_k[None, :] < K)
        # masked elements read as 0, which never raises a max of |x|
        x = tl.load(x_ptr + row_off[:, None] + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(abs_or_inf(x.to(tl.float32)), axis=1))
    pdl_launch_dependents(USE_PDL)
    tl.store(partials_ptr + offs_m.to(tl.int64) * num_pk + pid_k, amax, mask=m_ok)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, partials_ptr,
    M, K, num_pk,
    stride_xm, stride_xk, stride_qm, stride_qk,
    STATIC_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PK_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """q[tile] = e4m3(x[tile] / sx[rows]); with dynamic scales sx[m] = max(amax_m, floor) / 448 from
    row m's num_pk partials (every K tile's program redoes this small reduction: no grid-wide
    barrier in Triton); the programs of the first K tile store sx."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    pdl_wait(USE_PDL)  # the partials (and x) come from earlier kernels
    if STATIC_SCALE:
        scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(static_ptr)
    else:
        offs_p = tl.arange(0, PK_BLOCK)
        p = tl.load(partials_ptr + offs_m.to(tl.int64)[:, None] * num_pk + offs_p[None, :],
                    mask=m_ok[:, None] & (offs_p[None, :] < num_pk), other=0.0)
        # div_rn: IEEE division as the oracle's; NaN for a row that held a NaN/Inf (its codes 0x7F)
        scale = tl.math.div_rn(amax_or_nan(tl.max(p, axis=1), _AMAX_FLOOR), _E4M3_MAX)
    if pid_k == 0:  # sx [M] (the static scale repeated: the GEMM epilogue reads a vector)
        tl.store(scale_ptr + offs_m, scale, mask=m_ok)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = m_ok[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk,
                mask=mask, other=0.0).to(tl.float32)
    q = fp8_channel_quantize_tile(x, scale)
    pdl_launch_dependents(USE_PDL)
    tl.store(q_ptr + offs_m.to(tl.int64)[:, None] * stride_qm + offs_k[None, :].to(tl.int64) * stride_qk, q,
             mask=mask)


def quant_plan(M: int, K: int, interp: bool, n_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, Pk) of the quantizer for x [M, K]: the tile of tuning.quant_config (group
    32), and Pk, the K partials per row stage 1 writes (its grid: row tiles times Pk), enough that
    the grid holds about QUANT_PROGRAMS programs per SM, at most MAX_PARTIALS and the K tiles;
    1 under the interpreter."""
    block_m, block_k = quant_config(M, K, interp, group=32)
    if interp:
        return block_m, block_k, 1
    pm = triton.cdiv(max(M, 1), block_m)
    pk = max(1, min(triton.cdiv(K, block_k), MAX_PARTIALS, triton.cdiv(QUANT_PROGRAMS * n_sms, pm)))
    return block_m, block_k, pk


def _quantize(x2: torch.Tensor, scale, plan: Optional[tuple[int, int, int]] = None) -> QuantizedTensor:
    """quantize_activation on x2 [M, K] (checked): the two stages (one with a static scale);
    ``plan`` (BLOCK_M, BLOCK_K, Pk) overrides quant_plan's (tests cover Pk > 1 on the CPU)."""
    M, K = x2.shape
    s = torch.empty((M,), dtype=torch.float32, device=x2.device)
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    if M == 0:
        return QuantizedTensor(FMT, "activation", data, s, None, (1, K), (M, K))
    static = s if scale is None else static_scale(scale, x2.device)  # s: an unread placeholder pointer
    block_m, block_k, pk = plan or quant_plan(M, K, interpreting(), sm_count(x2.device))
    pm = triton.cdiv(M, block_m)
    partials = s  # unread with a static scale
    if scale is None:
        pk = min(pk, triton.cdiv(K, block_k))
        partials = torch.empty((M, pk), dtype=torch.float32, device=x2.device)
        launch(_row_amax_kernel, (pm, pk), x2, partials, M, K, x2.stride(0), x2.stride(1),
               BLOCK_M=block_m, BLOCK_K=block_k, **pdl_launch(x2.device))
    q = data.view(torch.uint8)
    launch(_quantize_kernel, (pm, triton.cdiv(K, block_k)),
           x2, q, s, static, partials, M, K, pk,
           x2.stride(0), x2.stride(1), q.stride(0), q.stride(1),
           STATIC_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_K=block_k,
           PK_BLOCK=triton.next_power_of_2(pk), **pdl_launch(x2.device))
    return QuantizedTensor(FMT, "activation", data, s, None, (1, K), (M, K))


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
    cfg = dataclasses.replace(e4m3_config(M, N, K), SPLIT_K=1)
    return "portable", cfg, f"16 < M={M} <= 256: the fp8 tl.dot GEMM, one program per tile"


def _gemm_kernels(kind: str, cfg: TileConfig, K: int) -> tuple[tuple[str, ...], int]:
    """(kernel names, split-K launched) of a GEMM plan."""
    if kind == "prefill":
        return ("fp8_prefill_kernel",), 1
    if kind == "portable":
        return ("_portable_gemm_kernel",), 1
    n_split = splitk_plan(K, cfg)[0]
    return ("fp8_decode_gemm_kernel",) + (("splitk_reduce_kernel",) if n_split > 1 else ()), n_split


def route(M: int, N: int, K: int, *, capability, sm_count: int, a16: bool = False, scale=None,
          tma_aligned: bool = True) -> Route:
    """The kernels ``linear`` launches for an [M, K] x [N, K]^T fp8_channel problem on sm_90.

    Args:
        M, N, K: the problem (M rows of activation, N output features, K the reduction).
        capability: the device's (major, minor); must be (9, 0) (``supported``).
        sm_count: the device's SM count (the decode kernel's split-K and the quantizer's grid).
        a16: must be False (fp8_channel has no weight-only mode).
        scale: the activation option of ``linear``: a static scale skips the amax kernel.
        tma_aligned: whether both e4m3 operands suit TMA (``_fp8_prefill.tma_ok``).
    Returns:
        Route(impl="hopper", kernels, tile, split_k, why, options): options hold the GEMM kind, its
        TileConfig, the quantizer's (BLOCK_M, BLOCK_K) and, with dynamic scales, its partials
        block and Pk's Triton class (quant_plan; what warmup must compile).
    Raises:
        ValueError: a capability other than sm_90 (naming it and why), a16=True, or a negative size.
    """
    check_route(FMT, capability, a16, M, N, K)
    if M == 0:
        return Route("hopper", (), "", 1, "M=0: nothing to launch")
    qplan = quant_plan(M, K, False, sm_count)
    quant = ("_quantize_kernel",) if scale is not None else ("_row_amax_kernel", "_quantize_kernel")
    qwhy = (f"quantizer: {'static scale, one kernel' if scale is not None else 'per-row amax partials then codes'}"
            f" on {qplan[0]} x {qplan[1]} tiles")
    # what the quantizer compiles, as far as M decides it: its tile, and with dynamic scales stage
    # 2's partials block (a power of two) and the Triton class of Pk
    qopts = (("quant_tile", qplan[:2]),)
    if scale is None:
        qwhy += f", {qplan[2]} K partials per row"
        qopts += (("pk_block", triton.next_power_of_2(qplan[2])), ("num_partials", int_specialization(qplan[2])))
    if N == 0:
        return Route("hopper", quant, "", 1, f"N=0: an empty output, no GEMM to launch; {qwhy}", qopts)
    kind, cfg, gwhy = _gemm_plan(M, N, K, sm_count, tma_aligned)
    kernels, n_split = _gemm_kernels(kind, cfg, K)
    return Route("hopper", quant + kernels, str(cfg), n_split, f"{gwhy}; {qwhy}",
                 (("gemm", kind), ("config", cfg)) + qopts)


def tile_config(M: int, N: int, K: int, device=None) -> TileConfig:
    """The GEMM tile ``gemm`` launches for M rows on ``device`` (None: the current GPU), assuming
    TMA-aligned operands (what the bench reports)."""
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return _gemm_plan(max(M, 1), N, K, sm_count(dev), True)[1]


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def quantize_activation(x: torch.Tensor, *, scale=None) -> QuantizedTensor:
    """The lesson's quantize_activation (bit for bit ``formats.quantize(x, "fp8_channel",
    role="activation", scale=scale)``) by the two-stage quantizer with PDL (module docstring).

    Args:
        x: bfloat16/float16 [..., K] (any K >= 1, any leading dims, any strides); NaN/Inf follow
            the non-finite rule (docs/formats.md): the row's scale is NaN and its codes 0x7F.
        scale: one static positive scale for every row (number or 0-d tensor); None for each row's
            max(amax, AMAX_FLOOR) / 448.
    Returns:
        QuantizedTensor(fmt="fp8_channel", role="activation", data float8_e4m3fn [M, K], scale
        float32 [M], block_shape (1, K)).
    Raises:
        ValueError: x not a bf16/fp16 tensor with K >= 1, or a non-positive/non-finite ``scale``.
    """
    check_activation(x, None, K_MULTIPLE, FMT)
    return _quantize(flatten_rows(x), scale)


def _run_gemm(kind: str, cfg: TileConfig, xq, qweight, bias, y, imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """Launch one GEMM plan into y [M, N] (bias already kernel_bias's)."""
    sx, sw = xq.scale.contiguous(), qweight.scale.contiguous()
    if kind == "decode":
        return launch_fp8_decode(xq.data.contiguous(), qweight.data.contiguous(), sx, sw, bias, y,
                                 imprecise_acc=imprecise_acc, config=cfg, channel=True)
    if kind == "prefill":
        return launch_fp8_prefill(xq.data, qweight.data, sx, sw, bias, y, config=cfg,
                                  imprecise_acc=imprecise_acc, channel=True)
    M, N = y.shape
    K = qweight.shape[1]
    dot_fp8 = not interpreting()
    x = e4m3_operand(xq.data, dot_fp8)
    w = e4m3_operand(qweight.data, dot_fp8)
    launch(_portable_gemm_kernel, (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),),
           x, w, sx, sw, bias if bias is not None else y, y,
           M, N, K,
           x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
           HAS_BIAS=bias is not None, DOT_FP8=dot_fp8, ROUND_BF16=not dot_fp8 and y.dtype == torch.bfloat16,
           BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
           IMPRECISE_ACC=min(imprecise_acc, cfg.BLOCK_K),  # Triton needs it <= BLOCK_K
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """y = (qx . qw^T) * sx[m] * sw[n] (+ bias) on sm_90, by the route's GEMM (module docstring).

    Args:
        xq: fp8_channel activation QuantizedTensor [M, K] (scale float32 [M]); qweight: fp8_channel
            weight [N, K] (scale float32 [N]), linear layout.
        bias: optional float32/bf16/fp16 [N], added in fp32 in the epilogue.
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
        imprecise_acc: max_num_imprecise_acc of the fp8 wgmma (capped at BLOCK_K).
    Returns:
        [M, N] tensor of out_dtype.
    Raises:
        ValueError: wrong formats/roles, K mismatch, a scale of the wrong length, different devices,
            bad bias or out_dtype, or a device that is not sm_90.
    """
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    check_quantized_activation(xq, FMT, K)  # its scale vector too: the epilogue reads sx[0:M]
    check_device(FMT, qweight.device)
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    kind, cfg, _ = _gemm_plan(M, N, K, sm_count(qweight.device), tma_ok(xq.data) and tma_ok(qweight.data))
    return _run_gemm(kind, cfg, xq, qweight, kernel_bias(bias), y, imprecise_acc)


def execute(r: Route, x: torch.Tensor, qweight: QuantizedTensor, bias=None, *, scale=None,
            imprecise_acc: int = IMPRECISE_ACC, quant_plan_override: Optional[tuple[int, int, int]] = None
            ) -> torch.Tensor:
    """Run the route ``r`` (this module's ``route`` for x's rows) on checked operands: the
    quantizer, then the GEMM plan the route names. ``linear`` is route + execute; tests run a route
    of sm_90 here under the interpreter (``quant_plan_override``: the quantizer's (BLOCK_M,
    BLOCK_K, Pk) in place of the interpreter's own)."""
    N = qweight.shape[0]
    x2 = flatten_rows(x)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if not r.kernels:
        return y.reshape(*x.shape[:-1], N)
    opts = dict(r.options)
    xq = _quantize(x2, scale, quant_plan_override)  # quant_plan's (the route's on a GPU of its SM count)
    if "gemm" in opts:
        _run_gemm(opts["gemm"], opts["config"], xq, qweight, kernel_bias(bias), y, imprecise_acc)
    return y.reshape(*x.shape[:-1], N)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           scale=None, imprecise_acc: int = IMPRECISE_ACC) -> torch.Tensor:
    """y = x . W^T (+ bias) with x quantized per token on the fly, on sm_90: route() once, then
    exactly its kernels.

    Args:
        x: bfloat16/float16 [..., K], any strides.
        qweight: fp8_channel weight QuantizedTensor [N, K] (linear layout, scale float32 [N]) on
            x's device.
        bias: optional float32/bf16/fp16 [N].
        scale: static activation scale (see quantize_activation); None for dynamic per-token scales.
        imprecise_acc: max_num_imprecise_acc of the fp8 wgmma (capped at BLOCK_K).
    Returns:
        [..., N] tensor of x's dtype.
    Raises:
        ValueError: naming the argument: wrong weight format (or scale length), x dtype, K
            mismatch, devices, bias shape or dtype, a bad static scale, or a device that is not sm_90.
    Follows the lesson (kernels_triton.fp8_channel) and formats.reference_linear's fp8_channel.
    """
    check_linear(x, qweight, bias, FMT, K_MULTIPLE)
    N, K = qweight.shape
    cap = check_device(FMT, qweight.device)
    M = x.numel() // K if K else 0
    r = route(M, N, K, capability=cap, sm_count=sm_count(qweight.device), scale=scale,
              tma_aligned=tma_ok(qweight.data))
    return execute(r, x, qweight, bias, scale=scale, imprecise_acc=imprecise_acc)
