"""Mixture-of-experts on Hopper (sm_90): the production MoE for the FP4 variants, next to the
readable lesson kernels_triton.moe (which spells out the layer, the grouping and the roundings).

Served: nvfp4 (W4A4), nvfp4_w4a16, mxfp4 (W4A4), mxfp4_w4a16 (``VARIANTS``), with the lesson's
semantics exactly: the same quantized activations (NVFP4 with each expert's dynamic or static
global scale, MX with its scale rule), the same activation (silu, gpt-oss's SwiGLU, interleaved or
not), biases, router weights, renormalize and the fp32 top_k sum, rounded once. Every product of
decoded operands is exact in bf16 (an e2m1 code times its block scale has at most 6 significant
bits), so the kernels differ from the lesson only in the order of fp32 additions.

Two routes (``route`` decides, the launchers follow it):

    decode (M <= 16)   the experts' weights streamed once per (expert, N tile, K range): no sorting.
                       ``_decode_gemm_kernel`` runs one program per (slot, N tile, K split); the
                       program of a slot that is not its expert's first returns at once, the others
                       gather their expert's slots (at most M * top_k: a compare and a prefix sum
                       over the topk_ids in registers) in chunks of 16 rows and run the swapped
                       product of hopper._fp4_decode: acc [BLOCK_N, 16] = W~ . X~^T, the weight
                       dequantized in registers as nibble planes (``fp4_planes``), the activation
                       read as planes of the same order (W4A4: quantized once before each GEMM by
                       ``_act_quant_kernel`` with the format lesson's tile quantizer, the expert's
                       global scale from an amax pass over its rows, and stored by slot as planes;
                       ``DECODE_A4_PREPASS``). Split-K where the grid would leave SMs idle; W13's split
                       partials meet in ``_act_kernel`` (sum, bias, activation), W2's in ``_combine_kernel``.
    prefill (M > 16)   rows sorted by expert (the lesson's ``align_block_size``), W4A4 activations
                       quantized by the lesson's ``_amax_kernel`` / ``_quantize_kernel`` in sorted
                       order, then ``_gemm_kernel``: one program per (expert block, N tile), both
                       operands dequantized in registers to bf16 (``dequantize_e2m1_tile``) and
                       multiplied by tl.dot's bf16 MMA with fp32 accumulation.
    both               ``_combine_kernel``: y[t] = sum_j w[t, j] (o[t, j] + b2[e_j]) in fp32 (split-K
                       partials added first, renormalize in place), one rounding to x's dtype.

fp16 x with a weight-only variant takes the prefill kernel at every M, which splits each fp16 tile
into two exact bf16 halves (hi + lo) and dots both (the decode planes would round fp16 to bf16).

Under TRITON_INTERPRET=1 (capability None) the same kernels run with fp32 dot operands (tl.dot on
bf16 is wrong there; the decoded values are exact in fp32 too) and plain-op dequantization instead
of inline PTX, with tiles as large as the problem.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from formats.constants import AMAX_FLOOR, NVFP4_GLOBAL_NUMERATOR
from formats.moe import MOE_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT

from .._codecs import (abs_or_inf, amax_or_nan, dequantize_e2m1, dequantize_e4m3, dequantize_e8m0, global_alpha,
                       nan_if_nonfinite, round_to_bf16_rne)
from .._common import check_moe_call, device_capability, interpreting, launch
from .. import moe as lesson
from ..moe import MoEWeights, prepare_experts  # noqa: F401  (the prepared experts are the lesson's: re-exported)
from ..mxfp4 import mxfp4_quantize_tile
from ..nvfp4 import nvfp4_quantize_tile
from . import supported
from ._fp4_decode import a16_planes, act_planes_kernel, fp4_planes, fragment_order, planes_k, store_planes
from ._fp4_gemm import dequantize_e2m1_tile
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._route import Route, TileConfig, check_sm_count_and_x_dtype, sm_count

IMPL = "hopper"
FORMATS = ("nvfp4", "mxfp4")
VARIANTS = ("nvfp4", "nvfp4_w4a16", "mxfp4", "mxfp4_w4a16")
DECODE_MAX_M = 16  # the decode kernel's activation side is 16 rows (the smallest wgmma N Triton emits)
_GROUP = {"nvfp4": 16, "mxfp4": 32}
_NVFP4, _MXFP4 = tl.constexpr(0), tl.constexpr(1)  # FORMATS' indices
_SILU, _SWIGLU = tl.constexpr(0), tl.constexpr(1)  # MOE_ACTIVATIONS[0], [1] (interleaved gate/up)
_FLOOR = tl.constexpr(AMAX_FLOOR)
_G_NUM = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)
DECODE_A4_PREPASS = True
"""Decode route, W4A4. True: each GEMM's activation quantized once by ``_act_quant_kernel`` (every
expert's rows, each K tile once) and stored as the product's planes, which the GEMM loads as they are.
False: every (N tile, K split) program of an expert quantizes its activation tiles in registers
again. tools/probes/hopper_moe_gpu.py --sweep times both."""
DECODE_A16_PLANES = False
"""Decode route, weight-only. True: x laid out once as the product's bf16 planes (hopper._fp4_decode's
act_planes_kernel) and the intermediate stored by W13 straight into W2's planes, so the K loops load
their activation tiles as they are. False (the default): each K step reorders its activation tile in
registers, no extra launch and no plane layout of the intermediate; on the GPU this measured faster
(docs/results.md). tools/probes/hopper_moe_gpu.py --sweep times both."""


# == Device helpers ===============================================================================
@triton.jit
def _chunk_slots(offs_s, mine, rank, c0, BLOCK_M: tl.constexpr):
    """Rows c0 .. c0 + BLOCK_M of this expert's slots in slot order: (their slot numbers int32
    [BLOCK_M], which are real). ``mine`` [S_PAD]: the slots of the expert, ``rank`` their prefix count."""
    r = c0 + tl.arange(0, BLOCK_M)
    hit = mine[None, :] & (rank[None, :] == r[:, None])  # [BLOCK_M, S_PAD], at most one per row
    return tl.sum(tl.where(hit, offs_s[None, :], 0), axis=1), tl.sum(hit.to(tl.int32), axis=1) > 0


@triton.jit
def _plane_col(k, PLANE_K: tl.constexpr):
    """The column of element k in the planes layout (act_planes_kernel, store_planes): each PLANE_K
    tile holds [its even elements, its odd ones], each plane in fragment order (input column
    (KP / 4) q + 4c + 2h + e of a plane goes to 16c + 8h + 2q + e, KP = PLANE_K / 2)."""
    KP: tl.constexpr = PLANE_K // 2
    r = k % PLANE_K
    j = r // 2
    q, rr = j // (KP // 4), j % (KP // 4)
    return k - r + (r % 2) * KP + 16 * (rr // 4) + 8 * ((rr // 2) % 2) + 2 * q + rr % 2


@triton.jit
def _plane_elem(p, PLANE_K: tl.constexpr):
    """The element k held by column p of the planes layout (_plane_col's inverse)."""
    KP: tl.constexpr = PLANE_K // 2
    r = p % PLANE_K
    pp = r % KP
    j = (KP // 4) * ((pp // 2) % 4) + 4 * (pp // 16) + 2 * ((pp // 8) % 2) + pp % 2
    return p - r + 2 * j + r // KP


@triton.jit
def _quantized_values(x, g, FMT: tl.constexpr, RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x fp32 [BLOCK_M, BLOCK_K] quantized by the format lesson's tile quantizer (nvfp4 with global
    scale g, MX with RULE 1 = floor) and decoded again without 1 / g: e2m1 times its block scale,
    exact in bf16, fp32 here (NaN for a block whose scale is NaN)."""
    G: tl.constexpr = 16 + 16 * FMT  # the block: nvfp4 16, mxfp4 32
    if FMT == _NVFP4:
        codes, s = nvfp4_quantize_tile(x, g, BLOCK_M, BLOCK_K)
        sv = dequantize_e4m3(s)
    else:
        codes, s = mxfp4_quantize_tile(x, RULE == 0, BLOCK_M, BLOCK_K)
        sv = dequantize_e8m0(s)
    v = dequantize_e2m1(codes).reshape(BLOCK_M, BLOCK_K // G, G) * sv[:, :, None]
    return v.reshape(BLOCK_M, BLOCK_K)


@triton.jit
def _act_planes(a_ptr, src, ok, k0, K, stride_am, g, FMT: tl.constexpr, A16: tl.constexpr, RULE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decode product's activation tile, rows ``src`` x K [k0, k0 + BLOCK_K): A16 the values as
    they are, else quantized in registers (_quantized_values); as even / odd planes in fragment
    order, the weight planes' order (hopper._fp4_decode)."""
    if A16:
        lo, hi = a16_planes(a_ptr, src, ok, k0, K, stride_am, 1, BLOCK_M, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a_ptr + src[:, None] * stride_am + offs_k[None, :], mask=ok[:, None] & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        v = _quantized_values(x, g, FMT, RULE, BLOCK_M, BLOCK_K)
        lo, hi = v.reshape(BLOCK_M, BLOCK_K // 2, 2).split()
        lo, hi = fragment_order(lo, BLOCK_M, BLOCK_K // 2), fragment_order(hi, BLOCK_M, BLOCK_K // 2)
    return lo, hi


@triton.jit
def _expert_global_scale(a_ptr, static_ptr, e, offs_s, mine, rank, count, K, stride_am, STATIC: tl.constexpr,
                         GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """NVFP4's activation global scale of expert e, as the lesson's: static (a bad value <= 0, Inf
    or NaN becomes NaN), or 2688 / the amax over the expert's own rows (NaN if one holds a NaN/Inf)."""
    if STATIC:
        t = tl.load(static_ptr + e)
        g = nan_if_nonfinite(tl.where(t > 0, t, float("nan")))
    else:
        amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for c0 in range(0, count, BLOCK_M):
            slot, ok = _chunk_slots(offs_s, mine, rank, c0, BLOCK_M)
            src = (slot // TOP_K if GATHER else slot).to(tl.int64)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(a_ptr + src[:, None] * stride_am + offs_k[None, :],
                            mask=ok[:, None] & (offs_k[None, :] < K), other=0.0)
                amax = tl.maximum(amax, abs_or_inf(x.to(tl.float32)))
        amax = amax_or_nan(tl.max(tl.max(amax, axis=1), axis=0), _FLOOR)
        g = tl.math.div_rn(tl.zeros_like(amax) + _G_NUM, amax)
    return g


# == The decode route =============================================================================
@triton.jit
def _act_quant_kernel(a_ptr, static_ptr, ids_ptr, p_ptr, g_ptr, n_slots, K, K_PAD, stride_am, stride_pm,
                      FMT: tl.constexpr, STATIC: tl.constexpr, RULE: tl.constexpr, GATHER: tl.constexpr,
                      TOP_K: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """W4A4 decode: a GEMM's activation quantized once, before it. Program (j, t): if slot j is its
    expert's first, the expert's rows x K tile t, quantized as ``_act_planes`` does inside the GEMM
    (the same quantizer and global scale) and stored by slot as the product's planes, p [n_slots,
    K_PAD] (store_planes: zeros past K); nvfp4's global scale of the expert into g [E] (read by the
    GEMM as a static one)."""
    j = tl.program_id(0)
    offs_s = tl.arange(0, S_PAD)
    pdl_wait(USE_PDL)  # x or the intermediate
    ids = tl.load(ids_ptr + offs_s, mask=offs_s < n_slots, other=-1)
    e = tl.load(ids_ptr + j)
    if tl.sum(((ids == e) & (offs_s < j)).to(tl.int32), axis=0) > 0:
        return
    mine = ids == e
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    count = tl.sum(mine.to(tl.int32), axis=0)
    g = 1.0  # unused by mxfp4's quantizer
    if FMT == _NVFP4:
        g = _expert_global_scale(a_ptr, static_ptr, e, offs_s, mine, rank, count, K, stride_am, STATIC, GATHER,
                                 TOP_K, BLOCK_M, BLOCK_K)
        if tl.program_id(1) == 0:
            tl.store(g_ptr + e, g)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    for c0 in range(0, count, BLOCK_M):
        slot, ok = _chunk_slots(offs_s, mine, rank, c0, BLOCK_M)
        src = (slot // TOP_K if GATHER else slot).to(tl.int64)
        x = tl.load(a_ptr + src[:, None] * stride_am + offs_k[None, :], mask=ok[:, None] & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        v = _quantized_values(x, g, FMT, RULE, BLOCK_M, BLOCK_K)
        store_planes(p_ptr, v, slot, ok, k0, K, K_PAD, stride_pm, BLOCK_M, BLOCK_K, BLOCK_K)
    pdl_launch_dependents(USE_PDL)


# [decode-kernel]
@triton.jit
def _decode_gemm_kernel(
    a_ptr,  # x [M, K] (GATHER: read at each slot's token) or the intermediate [n_slots, K] by slot
    w_ptr, sw_ptr, gw_ptr,  # the experts: e2m1 [E, rows, K/2], scale bytes [E, rows, K/GROUP], nvfp4 g_w [E]
    static_ptr,  # nvfp4 W4A4 with STATIC: the activations' global scale per expert [E]
    bias_ptr, ids_ptr, out_ptr, ws_ptr,  # bias [E, rows]; topk_ids [n_slots] int32; out; split-K partials
    n_slots, N, K, K_PER, alpha, limit,
    stride_am, stride_we, stride_wn, stride_swe, stride_swn, stride_be, stride_om, stride_ws,
    FMT: tl.constexpr, A16: tl.constexpr, STATIC: tl.constexpr, RULE: tl.constexpr, GATHER: tl.constexpr,
    GATED: tl.constexpr,  # W13: gate and up rows, the activation in the epilogue; else W2: o rows, unweighted
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, USE_ASM: tl.constexpr,
    DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, TOP_K: tl.constexpr, S_PAD: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # _pdl: every program waits before its first load
    A_PLANES: tl.constexpr = False,  # A is already in the planes layout at BLOCK_K (K padded): A16's x laid out
    # once, or W4A4's _act_quant_kernel output by slot (GATHER False, its global scales as STATIC)
    OUT_PLANE_K: tl.constexpr = 0,  # W13: > 0 stores the intermediate in W2's planes layout at this PLANE_K
):
    GROUP: tl.constexpr = 16 + 16 * FMT  # nvfp4 16, mxfp4 32
    # ----- this program's expert: slot j's, if j is its expert's first slot (else another program's)
    j = tl.program_id(0)
    offs_s = tl.arange(0, S_PAD)
    pdl_wait(USE_PDL)  # x or the intermediate, the previous kernel's output
    ids = tl.load(ids_ptr + offs_s, mask=offs_s < n_slots, other=-1)
    e = tl.load(ids_ptr + j)
    if tl.sum(((ids == e) & (offs_s < j)).to(tl.int32), axis=0) > 0:
        return
    mine = ids == e
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1  # each of the expert's slots' row among them
    count = tl.sum(mine.to(tl.int32), axis=0)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ACT == _SWIGLU:  # gpt-oss interleaves gate and up rows
        rows_g, rows_u = 2 * offs_n, 2 * offs_n + 1
    else:
        rows_g, rows_u = offs_n, offs_n + N
    w_ptr += e.to(tl.int64) * stride_we
    sw_ptr += e.to(tl.int64) * stride_swe
    k_lo = tl.program_id(2) * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)

    # ----- alpha: nvfp4's 1 / (g_x g_w) (g_x 1 for W4A16, the expert's own for W4A4), applied to
    # each split partial (the epilogue's multiply, moved before the split sum)
    g = 1.0  # unused by mxfp4's quantizer
    scale = 1.0
    if FMT == _NVFP4:
        gw = tl.load(gw_ptr + e)
        if A16:
            scale = global_alpha(tl.zeros_like(gw) + 1.0, gw)
        else:
            g = _expert_global_scale(a_ptr, static_ptr, e, offs_s, mine, rank, count, K, stride_am, STATIC, GATHER,
                                     TOP_K, BLOCK_M, BLOCK_K)
            scale = global_alpha(g, gw)

    # ----- the expert's slots, 16 at a time (one chunk unless a token picked one expert twice)
    for c0 in range(0, count, BLOCK_M):
        slot, ok = _chunk_slots(offs_s, mine, rank, c0, BLOCK_M)
        src = (slot // TOP_K if GATHER else slot).to(tl.int64)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if A_PLANES:  # the tile as it is; past K (padding that may hold anything) reads 0
                offs_p = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_ptr + src[:, None] * stride_am + offs_p[None, :],
                            mask=ok[:, None] & (_plane_elem(offs_p, BLOCK_K) < K)[None, :], other=0.0)
                a = tl.trans(a.to(DOT_DTYPE))
            else:
                a_lo, a_hi = _act_planes(a_ptr, src, ok, k0, K, stride_am, g, FMT, A16, RULE, BLOCK_M, BLOCK_K)
                a = tl.trans(planes_k(a_lo.to(DOT_DTYPE), a_hi.to(DOT_DTYPE), BLOCK_M, BLOCK_K))
            w_lo, w_hi = fp4_planes(w_ptr, sw_ptr, rows_g, n_ok, k0, K, stride_wn, stride_swn, BLOCK_N, BLOCK_K,
                                    GROUP, FMT == _NVFP4, False, USE_ASM, EVEN_K)
            acc_g = tl.dot(planes_k(w_lo.to(DOT_DTYPE), w_hi.to(DOT_DTYPE), BLOCK_N, BLOCK_K), a, acc_g)
            if GATED:
                w_lo, w_hi = fp4_planes(w_ptr, sw_ptr, rows_u, n_ok, k0, K, stride_wn, stride_swn, BLOCK_N, BLOCK_K,
                                        GROUP, FMT == _NVFP4, False, USE_ASM, EVEN_K)
                acc_u = tl.dot(planes_k(w_lo.to(DOT_DTYPE), w_hi.to(DOT_DTYPE), BLOCK_N, BLOCK_K), a, acc_u)
        pdl_launch_dependents(USE_PDL)

        # ----- epilogue, [BLOCK_M, BLOCK_N]
        mask = ok[:, None] & n_ok[None, :]
        y = tl.trans(acc_g) * scale
        if SPLIT_K > 1 or not GATED:  # partials (W2: its o rows, bias and router weight in _combine_kernel)
            ws = ws_ptr + tl.program_id(2).to(tl.int64) * stride_ws + slot.to(tl.int64)[:, None] * stride_om
            tl.store(ws + offs_n[None, :], y, mask=mask)
            if GATED:
                tl.store(ws + N + offs_n[None, :], tl.trans(acc_u) * scale, mask=mask)
        else:
            up = tl.trans(acc_u) * scale
            if HAS_BIAS:
                y += tl.load(bias_ptr + e * stride_be + rows_g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                up += tl.load(bias_ptr + e * stride_be + rows_u, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = lesson._activation(y, up, ACT != _SILU, alpha, limit)
            if ROUND_BF16:  # the weight-only intermediate is W2's bf16 operand (RNE on every backend)
                y = round_to_bf16_rne(y)
            cols = _plane_col(offs_n, OUT_PLANE_K) if OUT_PLANE_K else offs_n
            tl.store(out_ptr + slot.to(tl.int64)[:, None] * stride_om + cols[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=mask)
# [/decode-kernel]


@triton.jit
def _act_kernel(ws_ptr, bias_ptr, ids_ptr, out_ptr, n_slots, N, alpha, limit, stride_ws, stride_wm, stride_be,
                stride_om, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
                SPLIT_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
                OUT_PLANE_K: tl.constexpr = 0):
    """W13 after split-K: per slot, gate and up = the sum of the split partials (in split order),
    plus the bias, then the activation, into the intermediate [n_slots, N]."""
    pdl_wait(USE_PDL)  # the partials
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s_ok, n_ok = offs_s < n_slots, offs_n < N
    mask = s_ok[:, None] & n_ok[None, :]
    rows = ws_ptr + offs_s.to(tl.int64)[:, None] * stride_wm + offs_n[None, :]
    gate = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        gate += tl.load(rows + s * stride_ws, mask=mask, other=0.0)
        up += tl.load(rows + s * stride_ws + N, mask=mask, other=0.0)
    if HAS_BIAS:
        if ACT == _SWIGLU:
            rows_g, rows_u = 2 * offs_n, 2 * offs_n + 1
        else:
            rows_g, rows_u = offs_n, offs_n + N
        b = bias_ptr + tl.load(ids_ptr + offs_s, mask=s_ok, other=0).to(tl.int64)[:, None] * stride_be
        gate += tl.load(b + rows_g[None, :], mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b + rows_u[None, :], mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    y = lesson._activation(gate, up, ACT != _SILU, alpha, limit)
    if ROUND_BF16:
        y = round_to_bf16_rne(y)
    cols = _plane_col(offs_n, OUT_PLANE_K) if OUT_PLANE_K else offs_n  # W2's planes layout (DECODE_A16_PLANES)
    tl.store(out_ptr + offs_s.to(tl.int64)[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


# == The prefill route ============================================================================
# [prefill-kernel]
@triton.jit
def _gemm_kernel(
    a_ptr, sa_ptr, ta_ptr,  # A: sorted codes, scale bytes, per-expert g [E] (W4A4); or x / the bf16 intermediate
    w_ptr, sw_ptr, tw_ptr,  # the experts: packed e2m1 [E, rows, K/2], scale bytes, nvfp4 g_w [E]
    bias_ptr, slot_ptr, expert_ptr, out_ptr,  # bias [E, rows]; the grouping (lesson.Blocks); out
    N, K, n_slots, alpha, limit,
    stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_be, stride_om,
    FMT: tl.constexpr, A16: tl.constexpr, SPLIT_A16: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, DOT_DTYPE: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    GROUP: tl.constexpr = 16 + 16 * FMT  # nvfp4 16, mxfp4 32
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk)
    if e < 0:  # past the last expert's blocks
        return
    r, slot, m_ok, a_rows = lesson._block_rows(slot_ptr, blk, n_slots, GATHER, TOP_K, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ACT == _SWIGLU:
        rows_g, rows_u = 2 * offs_n, 2 * offs_n + 1
    else:
        rows_g, rows_u = offs_n, offs_n + N
    w_ptr += e.to(tl.int64) * stride_we
    sw_ptr += e.to(tl.int64) * stride_swe

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if A16:
            x = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        else:
            x = dequantize_e2m1_tile(a_ptr, sa_ptr, r, m_ok, k0, K, stride_am, stride_sam, BLOCK_M, BLOCK_K, GROUP,
                                     FMT == _NVFP4)
        a = x.to(DOT_DTYPE)  # exact: a decoded code times its scale, or bf16 x
        a_lo = (x - a.to(tl.float32)).to(DOT_DTYPE)  # SPLIT_A16: fp16 x's exact bf16 remainder
        w = dequantize_e2m1_tile(w_ptr, sw_ptr, rows_g, n_ok, k0, K, stride_wn, stride_swn, BLOCK_N, BLOCK_K, GROUP,
                                 FMT == _NVFP4, not A16)
        w = tl.trans(w.to(DOT_DTYPE))
        acc_g = tl.dot(a, w, acc_g)
        if SPLIT_A16:
            acc_g = tl.dot(a_lo, w, acc_g)
        if GATED:
            w = dequantize_e2m1_tile(w_ptr, sw_ptr, rows_u, n_ok, k0, K, stride_wn, stride_swn, BLOCK_N, BLOCK_K,
                                     GROUP, FMT == _NVFP4, not A16)
            w = tl.trans(w.to(DOT_DTYPE))
            acc_u = tl.dot(a, w, acc_u)
            if SPLIT_A16:
                acc_u = tl.dot(a_lo, w, acc_u)

    # ----- epilogue: alpha, then (W13) bias and activation into the sorted intermediate, or (W2) the
    # slot's o row, unweighted (bias and router weight in _combine_kernel)
    if FMT == _NVFP4:
        scale = global_alpha(tl.load(ta_ptr + e), tl.load(tw_ptr + e))
        acc_g = acc_g * scale
        acc_u = acc_u * scale
    mask = m_ok[:, None] & n_ok[None, :]
    if GATED:
        if HAS_BIAS:
            acc_g += tl.load(bias_ptr + e * stride_be + rows_g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias_ptr + e * stride_be + rows_u, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = lesson._activation(acc_g, acc_u, ACT != _SILU, alpha, limit)
        if ROUND_BF16:
            y = round_to_bf16_rne(y)
        tl.store(out_ptr + r[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + slot[:, None] * stride_om + offs_n[None, :], acc_g, mask=mask)
# [/prefill-kernel]


# == Both routes: the top_k sum ===================================================================
@triton.jit
def _combine_kernel(o_ptr, bias_ptr, ids_ptr, topk_w_ptr, y_ptr, H, stride_ws, stride_om, stride_be, stride_ym,
                    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT_K: tl.constexpr,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    """y[t] = sum_j w[t, j] (o[t, j] + b2[e_j]) in fp32, j in order (o: the sum of the split
    partials, in split order); renormalize: w[t, j] / sum_j w[t, j] first; one rounding to y's dtype."""
    pdl_wait(USE_PDL)  # W2's o rows
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_j = tl.arange(0, K_PAD)
    w_sum = tl.sum(tl.load(topk_w_ptr + t * TOP_K + offs_j, mask=offs_j < TOP_K, other=0.0).to(tl.float32), axis=0)
    y = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = t * TOP_K + j
        o = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            o += tl.load(o_ptr + s * stride_ws + slot.to(tl.int64) * stride_om + offs_h, mask=h_ok, other=0.0)
        if HAS_BIAS:
            e = tl.load(ids_ptr + slot).to(tl.int64)
            o += tl.load(bias_ptr + e * stride_be + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(topk_w_ptr + slot).to(tl.float32)
        if RENORM:
            w = tl.math.div_rn(w, w_sum)  # a zero sum gives NaN, as the oracle
        y += o * w
    if ROUND_BF16:
        y = round_to_bf16_rne(y)
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + offs_h, y.to(y_ptr.dtype.element_ty), mask=h_ok)


# == Tiles and the route ==========================================================================
@dataclasses.dataclass(frozen=True)
class Plan:
    """A call's decisions: ``route``; ``kind`` "none", "decode" or "prefill"; ``w13`` and ``w2``,
    the two GEMMs' TileConfigs (hopper._route.TileConfig, with SPLIT_K)."""

    route: Route
    kind: str
    w13: Optional[TileConfig]
    w2: Optional[TileConfig]


def _decode_split(tiles: int, K: int, bk: int, n_sms: int) -> int:
    """Split-K of a decode GEMM with ``tiles`` (expert, N tile) programs: the largest power of two
    keeping the grid within four programs per SM, each split >= 2 K steps (an MoE decode program
    streams a whole expert row block: fewer, fatter programs than the dense decode's, whose rule is
    two per SM and >= 4 steps; the partials are a few KB), then the count whole BLOCK_K ranges give."""
    split, steps = 1, triton.cdiv(K, bk)
    while tiles * split * 2 <= 4 * n_sms and steps >= 4 * split:
        split *= 2
    per = triton.cdiv(steps, split)
    return triton.cdiv(steps, per)


def decode_tiles(M: int, E: int, top_k: int, H: int, I: int, fmt: str, capability, n_sms: int):
    """(W13 tile, W2 tile) of the decode route. BLOCK_M 16 (the slots of one expert per chunk);
    BLOCK_N 128 intermediate columns for W13 (its gate and up rows: 256 weight rows, two accumulators),
    128 rows for W2 (the wider W13 tile measured faster than 64 on the GPU); BLOCK_K 128 (the planes need >= 4 block-scale groups: 128 for mxfp4). Split-K
    from the programs of the experts a call can touch at most, min(M top_k, E) (the routing is not
    read on the host). Interpreter (capability None): tiles as large as the problem, no split. Pure,
    raises nothing; n_sms: the device's SMs. Source: hopper._twopass.decode_split's rule, retuned
    (``_decode_split``)."""
    if capability is None:
        p2 = triton.next_power_of_2
        bk13, bk2 = (min(512, max(128, p2(k))) for k in (H, I))
        return (TileConfig(16, min(256, max(16, p2(I))), bk13, GROUP_M=1, num_stages=1),
                TileConfig(16, min(256, max(16, p2(H))), bk2, GROUP_M=1, num_stages=1))
    experts = min(M * top_k, E)
    t13 = TileConfig(16, 128, 128, GROUP_M=1, num_warps=4, num_stages=3)
    t2 = TileConfig(16, 128, 128, GROUP_M=1, num_warps=4, num_stages=3)
    return tuple(dataclasses.replace(t, SPLIT_K=_decode_split(experts * triton.cdiv(n, t.BLOCK_N), k, t.BLOCK_K, n_sms))
                 for t, n, k in ((t13, I, H), (t2, H, I)))


def prefill_tiles(M: int, E: int, top_k: int, H: int, I: int, fmt: str, capability):
    """(W13 tile, W2 tile) of the prefill route. BLOCK_M: the lesson's rule (the mean rows per expert,
    16 to 64); BLOCK_N 64 for W13 (two accumulators), 128 for W2; BLOCK_K 64 (bf16 tiles of two
    dequantized operands in registers); 8 warps at 64-row blocks. Interpreter: as large as the problem.
    Pure, raises nothing. Source: kernels_triton.moe.tile_config's BLOCK_M rule."""
    bm = min(64, max(16, triton.next_power_of_2(triton.cdiv(max(M * top_k, 1), E))))
    if capability is None:
        p2 = triton.next_power_of_2
        return tuple(TileConfig(bm, min(256, max(16, p2(n))), min(512, max(64, p2(k))), num_stages=1)
                     for n, k in ((I, H), (H, I)))
    w = 8 if bm == 64 else 4
    return (TileConfig(bm, 64, 64, num_warps=w, num_stages=3), TileConfig(bm, 128, 64, num_warps=w, num_stages=3))


def _check_capability(capability) -> None:
    if capability is None:
        return
    ok, why = supported(capability)
    if not ok:
        raise ValueError(f"capability must be None (the interpreter) or an sm_90 one, (9, x), for the hopper MoE, "
                         f"got {capability!r}: {why}")


def plan(M: int, E: int, top_k: int, H: int, I: int, *, fmt: str, a16: bool = False, capability=None,
         sm_count: int = 132, x_dtype: torch.dtype = torch.bfloat16, dynamic: tuple = (True, True),
         tiles: Optional[tuple] = None) -> Plan:
    """The decisions of one call (``route`` has the arguments); ``dynamic``: (W13, W2) whose nvfp4
    activation global scale is dynamic (an amax kernel on the prefill route); ``tiles``: (W13, W2)
    TileConfigs forcing both GEMMs' tiles (a decode tile's SPLIT_K included). Pure; raises what
    ``route`` raises."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} for the hopper MoE (variants {VARIANTS}), got {fmt!r}")
    _check_capability(capability)
    if isinstance(M, bool) or min(M, E, top_k, H, I) < 0 or min(E, top_k, H, I) == 0:
        raise ValueError(f"M must be >= 0 and E, top_k, H, I > 0, got {(M, E, top_k, H, I)}")
    if H % _GROUP[fmt] or I % _GROUP[fmt]:
        raise ValueError(f"{fmt} needs H and I (the two GEMMs' K) to be multiples of {_GROUP[fmt]}, got H={H} I={I}")
    check_sm_count_and_x_dtype(sm_count, x_dtype)
    name = f"{fmt}{'_w4a16' if a16 else ''}"
    if M == 0:
        return Plan(Route(IMPL, (), why=f"{name}: no tokens, nothing to launch"), "none", None, None)
    fp16_a16 = a16 and x_dtype == torch.float16
    if M <= DECODE_MAX_M and not fp16_a16:
        t13, t2 = tiles or decode_tiles(M, E, top_k, H, I, fmt, capability, sm_count)
        for t in (t13, t2):
            if t.BLOCK_M != 16 or t.BLOCK_K < 4 * _GROUP[fmt] or t.BLOCK_K & (t.BLOCK_K - 1):
                raise ValueError(f"a decode tile needs BLOCK_M 16 and BLOCK_K a power of two >= {4 * _GROUP[fmt]}, "
                                 f"got {t}")
        quant = ("_act_quant_kernel",) * (not a16 and DECODE_A4_PREPASS)
        kernels = ("act_planes_kernel",) * (a16 and DECODE_A16_PLANES) + quant + ("_decode_gemm_kernel",) + \
            (("_act_kernel",) if t13.SPLIT_K > 1 else ()) + quant + ("_decode_gemm_kernel", "_combine_kernel")
        act = ("x laid out once as bf16 planes, the intermediate stored as W2's planes" if a16 and DECODE_A16_PLANES
               else "each activation tile reordered in registers" if a16
               else "each GEMM's activation quantized once by _act_quant_kernel, loaded as planes" if DECODE_A4_PREPASS
               else "the activation quantized in registers")
        why = (f"{name} at M = {M} <= {DECODE_MAX_M}: the decode route, no sorting: one program per (slot, N tile, "
               f"K split), the programs of each expert's first slot stream its weights once per N tile ({act}, the "
               f"swapped product on nibble planes); split-K W13 {t13.SPLIT_K}, W2 {t2.SPLIT_K} (at most "
               f"{min(M * top_k, E)} experts x N tiles over {sm_count} SMs); the top_k sum in _combine_kernel")
        return Plan(Route(IMPL, kernels, f"W13 {t13} / W2 {t2}", max(t13.SPLIT_K, t2.SPLIT_K), why), "decode",
                    t13, t2)
    t13, t2 = tiles or prefill_tiles(M, E, top_k, H, I, fmt, capability)
    quant = [() if a16 else ("_amax_kernel",) * (d and fmt == "nvfp4") + ("_quantize_kernel",) for d in dynamic]
    kernels = quant[0] + ("_gemm_kernel",) + quant[1] + ("_gemm_kernel", "_combine_kernel")
    how = ("fp16 x with a weight-only variant: every M takes this route (each fp16 tile as two exact bf16 halves)"
           if fp16_a16 and M <= DECODE_MAX_M else f"M = {M} > {DECODE_MAX_M}")
    why = (f"{name}: the prefill route ({how}): rows sorted by expert in blocks of {t13.BLOCK_M} (a grid of "
           f"{triton.cdiv(M * top_k, t13.BLOCK_M) + min(M * top_k, E)} blocks)"
           f"{'' if a16 else ', the activations quantized by the lesson in sorted order'}, "
           f"both operands dequantized in registers to bf16 for tl.dot's MMA (fp32 accumulation); the top_k sum "
           f"in _combine_kernel")
    return Plan(Route(IMPL, kernels, f"W13 {t13} / W2 {t2}", 1, why), "prefill", t13, t2)


def route(M: int, E: int, top_k: int, H: int, I: int, *, fmt: str, a16: bool = False, capability=None,
          sm_count: int = 132, x_dtype: torch.dtype = torch.bfloat16, w13_act_opts=None, w2_act_opts=None,
          tiles: Optional[tuple] = None) -> Route:
    """The Route ``fused_moe`` launches for x [M, H] (``x_dtype``) and E experts (W13 [2I, H],
    W2 [H, I]) in ``fmt`` ("nvfp4" / "mxfp4"; ``a16``: weight-only), top_k per token, on a device of
    ``capability`` ((9, x); None: the interpreter) with ``sm_count`` SMs (decode split-K targets):
    its kernels in launch order, both tiles and why. A static nvfp4 ``global_scale`` in an act
    option drops that GEMM's amax kernel from the prefill route. Pure. ValueError: a format not served, a
    capability that is not sm_90, a bad size, sm_count or x_dtype, H or I not a multiple of the
    format's block, a decode tile other than 16 rows with BLOCK_K >= 4 groups."""
    dynamic = tuple((o or {}).get("global_scale") is None for o in (w13_act_opts, w2_act_opts))
    return plan(M, E, top_k, H, I, fmt=fmt, a16=a16, capability=capability, sm_count=sm_count, x_dtype=x_dtype,
                dynamic=dynamic, tiles=tiles).route


# == The launchers ================================================================================
def _dot_dtype():
    return tl.float32 if interpreting() else tl.bfloat16


def _decode_gemm(a, w: tuple, fmt: str, tile: TileConfig, ids, n_slots: int, out, *, a16: bool, gather: bool,
                 act: int, bias, static, rule: int, top_k: int, alpha: float, limit: float, a_planes: bool = False,
                 out_plane_k: int = 0):
    """One decode GEMM: W13 (act >= 0) into ``out`` (the intermediate [n_slots, I]), or W2 (act -1)
    into ``out`` = the split partials [SPLIT_K, n_slots, H] fp32. Returns the W13 partials
    [SPLIT_K, n_slots, 2I] when W13 splits K (``_act_kernel`` finishes them), else None."""
    data, block, per_expert = w
    E, N_rows, K = data.shape[0], data.shape[1], data.shape[2] * 2
    gated = act >= 0
    N = N_rows // 2 if gated else N_rows
    split = tile.SPLIT_K
    k_per = triton.cdiv(triton.cdiv(K, tile.BLOCK_K), split) * tile.BLOCK_K
    if gated and split == 1:  # the epilogue writes the intermediate
        ws, stride_om, stride_ws = out, out.stride(0), 0
    else:  # partials [SPLIT_K, n_slots, 2I (gate, then up) or H]
        ws = torch.empty((split, n_slots, 2 * N), dtype=torch.float32, device=data.device) if gated else out
        stride_om, stride_ws = ws.stride(1), ws.stride(0)
    bias_t = bias if bias is not None else data
    launch(_decode_gemm_kernel, (n_slots, triton.cdiv(N, tile.BLOCK_N), split),
           a, data, block, per_expert if per_expert is not None else data, static if static is not None else data,
           bias_t, ids, out, ws, n_slots, N, K, k_per, alpha, limit,
           a.stride(0), data.stride(0), data.stride(1), block.stride(0), block.stride(1),
           bias_t.stride(0) if bias is not None else 0, stride_om, stride_ws,
           FMT=FORMATS.index(fmt), A16=a16, STATIC=static is not None, RULE=rule, GATHER=gather, GATED=gated,
           ACT=max(act, 0), HAS_BIAS=bias is not None, ROUND_BF16=a16 and gated, USE_ASM=not interpreting(),
           DOT_DTYPE=_dot_dtype(), EVEN_K=K % tile.BLOCK_K == 0, TOP_K=top_k,
           S_PAD=max(16, triton.next_power_of_2(n_slots)), SPLIT_K=split, BLOCK_N=tile.BLOCK_N,
           BLOCK_M=tile.BLOCK_M, BLOCK_K=tile.BLOCK_K, num_warps=tile.num_warps, num_stages=tile.num_stages,
           A_PLANES=a_planes, OUT_PLANE_K=out_plane_k, **pdl_launch(data.device))
    return ws if gated and split > 1 else None


def plane_columns(K: int, plane_k: int, device=None) -> torch.Tensor:
    """int64 [K]: the column of each element k in the planes layout at ``plane_k`` (_plane_col, on the
    host): ``planes[:, plane_columns(K, pk)]`` is the [rows, K] matrix in K order. ``plane_k``: a
    power of two >= 64 (not checked). Pure. Source: hopper._fp4_decode's fragment_order and planes_k."""
    k = torch.arange(K, device=device)
    kp = plane_k // 2
    r = k % plane_k
    j = r // 2
    q, rr = j // (kp // 4), j % (kp // 4)
    return k - r + (r % 2) * kp + 16 * (rr // 4) + 8 * ((rr // 2) % 2) + 2 * q + rr % 2


def _combine(o, split: int, bias, ids, topk_w, M: int, top_k: int, H: int, out_dtype, renormalize: bool):
    y = torch.empty((M, H), dtype=out_dtype, device=o.device)
    bh = min(1024, triton.next_power_of_2(H)) if interpreting() else 256
    stride_ws = o.stride(0) if o.dim() == 3 else 0
    stride_om = o.stride(-2)
    bias_t = bias if bias is not None else o
    launch(_combine_kernel, (M, triton.cdiv(H, bh)), o, bias_t, ids, topk_w, y, H, stride_ws, stride_om,
           bias_t.stride(0) if bias is not None else 0, y.stride(0), HAS_BIAS=bias is not None, RENORM=renormalize,
           ROUND_BF16=interpreting() and out_dtype == torch.bfloat16, SPLIT_K=split, TOP_K=top_k,
           K_PAD=triton.next_power_of_2(top_k), BLOCK_H=bh, num_warps=4, **pdl_launch(o.device))
    return y


def _prefill_gemm(a, sa, ta, w: tuple, blocks, out, fmt: str, tile: TileConfig, *, a16: bool, gather: bool,
                  act: int, bias, top_k: int, alpha: float, limit: float) -> None:
    data, block, per_expert = w
    gated = act >= 0
    N = data.shape[1] // 2 if gated else data.shape[1]
    bias_t = bias if bias is not None else out
    launch(_gemm_kernel, (blocks.expert.numel(), triton.cdiv(N, tile.BLOCK_N)),
           a, sa, ta, data, block, per_expert if per_expert is not None else ta, bias_t, blocks.slot, blocks.expert,
           out, N, data.shape[2] * 2, blocks.n_slots, alpha, limit,
           a.stride(0), sa.stride(0), data.stride(0), data.stride(1), block.stride(0), block.stride(1),
           bias_t.stride(0), out.stride(0),
           FMT=FORMATS.index(fmt), A16=a16, SPLIT_A16=a16 and a.dtype == torch.float16 and not interpreting(),
           GATHER=gather, GATED=gated, ACT=max(act, 0), HAS_BIAS=bias is not None and gated,
           ROUND_BF16=a16 and gated, DOT_DTYPE=_dot_dtype(), TOP_K=top_k, BLOCK_M=tile.BLOCK_M,
           BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, num_warps=tile.num_warps, num_stages=tile.num_stages)


# == The public functions =========================================================================
def _static_scales(opts, fmt: str, E: int, device, name: str) -> tuple[Optional[torch.Tensor], int]:
    """(nvfp4's static global scales [E] or None: dynamic; MX's RULE) from the act options, as the
    lesson reads them (its _act_opts: ValueError naming the option)."""
    return lesson._act_opts(opts, fmt, E, device, name)


def fused_moe(x: torch.Tensor, prepared: MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              activation: str = "silu", renormalize: bool = False, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, a16: bool = False, w13_act_opts=None, w2_act_opts=None,
              swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
              tiles: Optional[tuple] = None) -> torch.Tensor:
    """y [M, H] of x's dtype: one MoE layer's routed experts as formats.reference_moe computes them
    from the same arguments (the lesson kernels_triton.moe.fused_moe's semantics), with the kernels
    of ``route``, on an sm_90 GPU or under the interpreter.

    x: bf16/fp16 [M, H] on the experts' device; prepared: kernels_triton.moe.prepare_experts(w13, w2)
    of nvfp4 or mxfp4 experts; topk_ids: integer [M, top_k] in [0, E); topk_weights: float [M, top_k];
    activation: one of formats.MOE_ACTIVATIONS (swiglu_alpha, swiglu_limit: the SwiGLU ones');
    renormalize: each token's weights divided by their sum (a zero sum gives NaN); w13_bias float
    [E, 2I] (W13's row order), w2_bias float [E, H]; a16: weight-only (nvfp4_w4a16, mxfp4_w4a16);
    w13_act_opts, w2_act_opts: the format's activation option (nvfp4 ``global_scale``: a number or
    [E], else each expert's dynamic value; mxfp4 ``scale_rule``); tiles: (W13, W2) TileConfigs
    forcing both GEMMs' tiles.
    ValueError naming the argument: prepared not MoEWeights of nvfp4/mxfp4; the device neither an
    sm_90 GPU nor the interpreter; then the lesson's checks (kernels_triton._common.check_moe_call):
    x not bf16/fp16 [M, H] on the device; topk_ids not integer [M, top_k] on the device or outside
    [0, E) (read: a device synchronization); topk_weights not float [M, top_k] on the device; an
    unknown activation; biases not float [E, 2I] / [E, H] on the device; a bad act option or tile.
    Source: formats.reference_moe (the numbers), vLLM's fused_moe (the grouping)."""
    if not isinstance(prepared, MoEWeights):
        raise ValueError(f"prepared must be a MoEWeights (kernels_triton.moe.prepare_experts), got "
                         f"{type(prepared).__name__}")
    if prepared.fmt not in FORMATS:
        raise ValueError(f"prepared must hold experts of {FORMATS} for the hopper MoE, got {prepared.fmt!r}")
    if not interpreting():
        _check_capability(device_capability(prepared.device))
    check_moe_call(x, topk_ids, topk_weights, E=prepared.num_experts, H=prepared.hidden, I=prepared.intermediate,
                   fmt=prepared.fmt, device=prepared.device, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias)
    return fused_moe_unchecked(x, prepared, topk_ids, topk_weights, activation=activation, renormalize=renormalize,
                               w13_bias=w13_bias, w2_bias=w2_bias, a16=a16, w13_act_opts=w13_act_opts,
                               w2_act_opts=w2_act_opts, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                               tiles=tiles)


def _a4_prepass(pl: Plan, a16: bool) -> bool:
    """Whether route ``pl`` quantizes each W4A4 decode GEMM's activation once (DECODE_A4_PREPASS)."""
    return bool(not a16 and pl.kind == "decode" and "_act_quant_kernel" in pl.route.kernels)


def _act_quant(a, ids, fmt: str, bk: int, *, static, rule: int, gather: bool, top_k: int, E: int):
    """``_act_quant_kernel`` on x (gather: rows by token) or the intermediate (by slot): (the planes
    [n_slots, K padded to bk], the experts' global scales [E] fp32 for the GEMM's STATIC read; nvfp4
    only, else None)."""
    n, K = ids.numel(), a.shape[1]
    k_pad = triton.cdiv(K, bk) * bk
    planes = torch.empty((n, k_pad), dtype=torch.float32 if interpreting() else torch.bfloat16, device=a.device)
    g = torch.empty(E, dtype=torch.float32, device=a.device) if fmt == "nvfp4" else None
    launch(_act_quant_kernel, (n, triton.cdiv(K, bk)), a, static if static is not None else a, ids, planes,
           g if g is not None else planes, n, K, k_pad, a.stride(0), planes.stride(0), FMT=FORMATS.index(fmt),
           STATIC=static is not None, RULE=rule, GATHER=gather, TOP_K=top_k,
           S_PAD=max(16, triton.next_power_of_2(n)), BLOCK_M=16, BLOCK_K=bk, num_warps=4, num_stages=1,
           **pdl_launch(a.device))
    return planes, g


def _a16_planes(pl: Plan, a16: bool) -> bool:
    """Whether route ``pl`` lays the weight-only activations out as planes (DECODE_A16_PLANES)."""
    return bool(a16 and pl.kind == "decode" and "act_planes_kernel" in pl.route.kernels)


def fused_moe_unchecked(x, prepared: MoEWeights, topk_ids, topk_weights, *, activation="silu", renormalize=False,
                        w13_bias=None, w2_bias=None, a16=False, w13_act_opts=None, w2_act_opts=None,
                        swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, tiles=None) -> torch.Tensor:
    """``fused_moe`` without its argument checks (the act options and tiles are still read), for a
    caller that made them (dispatch's HopperMoE): the same result; wrong arguments give wrong numbers."""
    p, (M, top_k) = prepared, topk_ids.shape
    E, H, I, fmt = p.num_experts, p.hidden, p.intermediate, p.fmt
    if a16 and (w13_act_opts or w2_act_opts):
        raise ValueError(f"w13_act_opts and w2_act_opts must be empty for a weight-only variant, got "
                         f"{w13_act_opts}, {w2_act_opts}")
    s13, rule13 = (None, 0) if a16 else _static_scales(w13_act_opts, fmt, E, x.device, "w13_act_opts")
    s2, rule2 = (None, 0) if a16 else _static_scales(w2_act_opts, fmt, E, x.device, "w2_act_opts")
    pl = plan(M, E, top_k, H, I, fmt=fmt, a16=a16, capability=device_capability(x.device),
              sm_count=sm_count(x.device) if not interpreting() else 132, x_dtype=x.dtype,
              dynamic=(s13 is None, s2 is None), tiles=tiles)
    if pl.kind == "none":
        return x.new_empty((0, H))
    ids = topk_ids.to(torch.int32).contiguous()
    wts = topk_weights.float().contiguous().view(-1)
    common = dict(a16=a16, top_k=top_k, alpha=float(swiglu_alpha), limit=float(swiglu_limit))
    inter, blocks = _w13(x, p, ids, pl, activation=activation, bias=w13_bias, static=s13, rule=rule13, **common)
    n = M * top_k
    if pl.kind == "decode":
        o = torch.empty((pl.w2.SPLIT_K, n, H), dtype=torch.float32, device=x.device)
        a, planes = inter, _a16_planes(pl, a16)
        if _a4_prepass(pl, a16):  # the intermediate quantized once, by slot, with the experts' global scales
            a, s2 = _act_quant(inter, ids.view(-1), fmt, pl.w2.BLOCK_K, static=s2, rule=rule2, gather=False,
                               top_k=top_k, E=E)
            planes = True
        _decode_gemm(a, p.w2, fmt, pl.w2, ids.view(-1), n, o, gather=False, act=-1, bias=None, static=s2,
                     rule=rule2, a_planes=planes, **common)
    else:  # the lesson's quantizer in sorted order, then this GEMM into the slots' o rows
        ones = torch.ones(E, dtype=torch.float32, device=x.device)
        a = (inter, inter, ones) if a16 else lesson._quantize(inter, blocks, fmt, s2, rule2, False, top_k, E)
        o = torch.empty((n, H), dtype=torch.float32, device=x.device)
        _prefill_gemm(*a, p.w2, blocks, o, fmt, pl.w2, gather=False, act=-1, bias=None, **common)
    return _combine(o, pl.w2.SPLIT_K if pl.kind == "decode" else 1, w2_bias, ids.view(-1), wts, M, top_k, H, x.dtype,
                    renormalize)


def _w13(x, p: MoEWeights, ids, pl: Plan, *, activation, bias, static, rule, a16, top_k, alpha, limit):
    """W13 and the activation of route ``pl``: (the intermediate, the lesson's Blocks or None). Decode:
    [M top_k, I] by slot, no Blocks (weight-only with DECODE_A16_PLANES: [M top_k, I padded to W2's
    BLOCK_K] in W2's planes layout, ``plane_columns`` reads it back); prefill: [rows, I] in sorted
    order. fp32, or bf16 for a16."""
    E, I, fmt, n = p.num_experts, p.intermediate, p.fmt, ids.numel()
    x = x.contiguous()
    act = MOE_ACTIVATIONS.index(activation)
    common = dict(a16=a16, top_k=top_k, alpha=alpha, limit=limit)
    inter_dtype = torch.bfloat16 if a16 else torch.float32
    if pl.kind == "decode":
        flat = ids.reshape(-1)
        planes = _a16_planes(pl, a16)
        out_pk = pl.w2.BLOCK_K if planes else 0
        inter = torch.empty((n, triton.cdiv(I, out_pk) * out_pk if planes else I), dtype=inter_dtype, device=x.device)
        if planes:  # x as the product's planes, once (zeros past H)
            bk, H, M = pl.w13.BLOCK_K, x.shape[1], x.shape[0]
            xp = torch.empty((M, triton.cdiv(H, bk) * bk), dtype=torch.float32 if interpreting() else torch.bfloat16,
                             device=x.device)
            launch(act_planes_kernel, (triton.cdiv(H, bk),), x, x, xp, M, H, x.stride(0), x.stride(1), 0, xp.stride(0),
                   GROUP=32, SCALE_E4M3=False, A16=True, F16_DEQUANTIZE=False, USE_ASM=False, DOT_DTYPE=_dot_dtype(),
                   EVEN_K=H % bk == 0, BLOCK_M=16, BLOCK_K=bk, num_warps=4, num_stages=1, **pdl_launch(x.device))
            x = xp
        gather = True
        if _a4_prepass(pl, a16):  # x quantized once per expert's rows, by slot
            x, static = _act_quant(x, flat, fmt, pl.w13.BLOCK_K, static=static, rule=rule, gather=True, top_k=top_k,
                                   E=E)
            gather, planes = False, True
        ws = _decode_gemm(x, p.w13, fmt, pl.w13, flat, n, inter, gather=gather, act=act, bias=bias, static=static,
                          rule=rule, a_planes=planes, out_plane_k=out_pk, **common)
        if ws is not None:  # split-K: the partials' sum, bias and activation
            p2 = triton.next_power_of_2
            bs, bn = (16, 64) if not interpreting() else (p2(n), min(256, p2(I)))
            launch(_act_kernel, (triton.cdiv(n, bs), triton.cdiv(I, bn)), ws, bias if bias is not None else ws, flat,
                   inter, n, I, alpha, limit, ws.stride(0), ws.stride(1), bias.stride(0) if bias is not None else 0,
                   inter.stride(0), ACT=act, HAS_BIAS=bias is not None, ROUND_BF16=a16, SPLIT_K=pl.w13.SPLIT_K,
                   BLOCK_S=bs, BLOCK_N=bn, OUT_PLANE_K=out_pk, **pdl_launch(x.device))
        return inter, None
    if pl.w2.BLOCK_M != pl.w13.BLOCK_M:
        raise ValueError(f"tiles must share BLOCK_M (one grouping of the rows), got {pl.w13} and {pl.w2}")
    blocks = lesson.align_block_size(ids, E, pl.w13.BLOCK_M)
    ones = torch.ones(E, dtype=torch.float32, device=x.device)
    a = (x, x, ones) if a16 else lesson._quantize(x, blocks, fmt, static, rule, True, top_k, E)
    inter = torch.empty((blocks.slot.numel(), I), dtype=inter_dtype, device=x.device)
    _prefill_gemm(*a, p.w13, blocks, inter, fmt, pl.w13, gather=a16, act=act, bias=bias, **common)
    return inter, blocks


__all__ = ["DECODE_A16_PLANES", "DECODE_A4_PREPASS", "DECODE_MAX_M", "FORMATS", "Plan", "VARIANTS", "decode_tiles", "fused_moe",
           "fused_moe_unchecked", "plan", "plane_columns", "prefill_tiles", "prepare_experts", "route"]
