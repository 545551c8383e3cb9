"""Mixture-of-experts in Triton, the lesson: one MoE layer's routed experts in every format. The one
lesson that imports other lessons: their public tile helpers (``<fmt>_quantize_tile``,
``<fmt>_dequantize_tile``), so each format's arithmetic stays written once, in its own lesson.

What a layer computes (formats/moe.py: the spec and the float64 oracle), for token t and each of its
top_k experts e = topk_ids[t, j] with router weight w[t, j]:

    a_j  = act(x[t] . W13[e]^T + b13[e])            W13[e] [2I, H]: gate rows, then up rows
    y[t] = sum_j w[t, j] (a_j . W2[e]^T + b2[e])    W2[e] [H, I]

A loop over experts launches 2E GEMMs, most of them tiny (a decode step sends one token to top_k
of E experts). The fused way takes four steps:

1. Group the rows by expert (``align_block_size``: vLLM's moe_align_block_size, in torch). The
   M * top_k (token, j) pairs, the slots (slot = token * top_k + j), are sorted by expert (token
   order inside one) and each expert's run is padded to a multiple of BLOCK_M, so that each block
   of BLOCK_M sorted rows belongs to one expert (P: padding, the slot M * top_k):

       topk_ids = [[2, 0], [2, 3], [0, 2], [2, 0]]      M = 4, top_k = 2, E = 4, BLOCK_M = 4
       sorted row    0  1  2  3 |  4  5  6  7 |  8  9 10 11 | 12 .. 23
       slot          1  4  7  P |  0  2  5  6 |  3  P  P  P |  P
       expert            0      |      2      |      3      |  -1 -1 -1      (expert 1: no rows)

   No count goes back to the host: the grid has the most blocks any routing needs,
   cdiv(M top_k, BLOCK_M) + min(M top_k, E), and a program of a block with expert -1 returns.
2. Quantize each expert's GEMM input (``_amax_kernel``, ``_quantize_kernel``): x's rows gathered in
   sorted order for W13, the intermediate for W2. Row and block scales do not depend on the grouping;
   a per-tensor value (fp8_tensor's scale, nvfp4's global scale) is the expert's: static (one per
   expert) or the amax over the expert's own rows, as the oracle (a partial amax per block; each
   program reduces its expert's blocks). fp8_channel's per-token scale is its row's own amax (the
   amax kernel keeps one per row), or static per expert. Weight-only variants (a16) read x as it is.
3. The grouped GEMM (``_grouped_gemm_kernel``): one program per (block, N tile) loads its block's
   expert e, and the rest is a dense lesson's K loop over W[e]:

       for k0 in range(0, K, BLOCK_K):
           a = the block's A rows, decoded (<fmt>_dequantize_tile)     fp32 [BLOCK_M, BLOCK_K]
           w = W[e]'s rows of the tile, decoded                        fp32 [BLOCK_N, BLOCK_K]
           acc += dot(a, w^T)              (fp8_block: times sx sw, constant over the 128-deep step)
       acc = acc * alpha[e] + bias[e]      (alpha: fp8_tensor sx sw, nvfp4 1 / (g_x g_w),
                                            fp8_channel sx[row] sw[column]: the row scales leave the sum)

   For W13 a program owns BLOCK_N intermediate columns and accumulates their gate and up rows side
   by side, so the activation is its epilogue. For W2 the epilogue multiplies each row by its
   router weight and stores it at its slot. Portably the operands are decoded to fp32 and dotted in
   TF32, which is exact: TF32 keeps 11 significant bits, a decoded code times its scales has at
   most 6, bf16 x 8, fp16 x 11. On SM12x (path "native") codes and scales go to tl.dot_scaled as
   in each format's lesson.
4. Combine (torch): y[t] = the sum of its top_k slot rows in fp32, rounded once to x's dtype.

Roundings (the tests' bound follows them): fp32 sums and epilogues; the intermediate quantized from
its fp32 value (within its fp32 error of a rounding boundary the code may differ from the oracle's
float64 one), or, weight-only, rounded to bf16 (the tensor core's operand; the oracle keeps
float64); the top_k sum in fp32; one rounding to x's dtype. Non-finite values (docs/formats.md):
NaN/Inf in a token's row reach its outputs (with a dynamic per-tensor scale, every row of its
experts); the SwiGLU clamps give NaN for a non-finite gate or up, never the limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor, spec
from formats.constants import AMAX_FLOOR, E4M3_MAX, NVFP4_GLOBAL_NUMERATOR
from formats.moe import MOE_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT
from formats.validate import check_weight

from ._codecs import abs_or_inf, amax_or_nan, nan_if_nonfinite, round_to_bf16_rne
from ._common import Route, TileConfig, check_moe_call, device_capability, epilogue, interpreting, launch, route_path
from .fp8_block import fp8_block_dequantize_tile, fp8_block_quantize_tile
from .fp8_channel import fp8_channel_dequantize_tile, fp8_channel_quantize_tile
from .fp8_tensor import fp8_tensor_dequantize_tile, fp8_tensor_quantize_tile
from .mxfp4 import mxfp4_dequantize_tile, mxfp4_quantize_tile
from .mxfp8 import mxfp8_dequantize_tile, mxfp8_quantize_tile
from .nvfp4 import nvfp4_dequantize_tile, nvfp4_quantize_tile

FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "fp8_channel")  # constexpr FMT is the index
A16_FORMATS = ("mxfp8", "nvfp4", "mxfp4")  # weight-only: mxfp8_w8a16, nvfp4_w4a16, mxfp4_w4a16
ACT_OPTION = {"fp8_tensor": "scale", "fp8_block": "ue8m0", "mxfp8": "scale_rule", "nvfp4": "global_scale",
              "mxfp4": "scale_rule", "fp8_channel": "scale"}  # the one activation option of each (formats.quantize's)
DYNAMIC_AMAX = ("fp8_tensor", "nvfp4", "fp8_channel")  # an amax kernel before the quantizer unless static
_FP8_TENSOR, _FP8_BLOCK, _MXFP8, _NVFP4, _MXFP4, _FP8_CHANNEL = (tl.constexpr(i) for i in range(6))
_SILU, _SWIGLU = tl.constexpr(0), tl.constexpr(1)  # MOE_ACTIVATIONS[0], [1] (interleaved gate/up)
_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_G_NUM = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)


# == 1. Rows grouped by expert ====================================================================
@dataclass(frozen=True)
class Blocks:
    """The sorted, padded rows (``align_block_size``): ``slot`` int32 [num_blocks * block_m] (the
    slot of each sorted row; n_slots = M * top_k marks padding), ``expert`` int32 [num_blocks] (each
    block's expert; -1: unused), ``first_block`` int32 [E + 1] (expert e owns blocks
    [first_block[e], first_block[e + 1])), ``block_m``, ``n_slots``."""

    slot: torch.Tensor
    expert: torch.Tensor
    first_block: torch.Tensor
    block_m: int
    n_slots: int


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Blocks:
    """topk_ids [M, top_k] (integers in [0, num_experts), not checked) -> Blocks, on its device, with
    no host synchronization (vLLM's moe_align_block_size, in plain torch)."""
    # [align]
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    first_block = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    first_block[1:] = torch.cumsum((counts + block_m - 1) // block_m, 0)  # each expert's blocks, padded
    num_blocks = triton.cdiv(n, block_m) + min(n, num_experts)  # every routing fits
    order = torch.argsort(ids, stable=True)  # slots by expert, token order inside one
    first_slot = torch.cumsum(counts, 0) - counts  # where each expert's run starts among the sorted slots
    rank = torch.arange(n, device=ids.device) - first_slot[ids[order]]
    slot = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    slot[first_block[ids[order]] * block_m + rank] = order.int()
    # block b belongs to the expert e with first_block[e] <= b < first_block[e + 1]
    expert = torch.searchsorted(first_block[1:], torch.arange(num_blocks, device=ids.device), right=True)
    expert = torch.where(expert < num_experts, expert, -1).int()
    return Blocks(slot, expert, first_block.int(), block_m, n)
    # [/align]


@triton.jit
def _block_rows(slot_ptr, blk, n_slots, GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block ``blk``'s sorted rows r, their slots, which are real (not padding), and the row each
    reads of its input: x's token slot // top_k (GATHER) or r itself (inputs kept in sorted order)."""
    r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + r)
    ok = slot < n_slots
    if GATHER:
        src = tl.where(ok, slot // TOP_K, 0).to(tl.int64)
    else:
        src = r.to(tl.int64)
    return r.to(tl.int64), slot.to(tl.int64), ok, src


# == 2. Each expert's GEMM input quantized ========================================================
@triton.jit
def _quantize_tile(x, t, FMT: tl.constexpr, RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The format lesson's tile quantizer on x fp32 [BLOCK_M, BLOCK_K], t the expert's per-tensor value
    (fp8_tensor's scale, nvfp4's g) and RULE fp8_block's ue8m0 / MX's floor rule -> (codes uint8
    [BLOCK_M, BLOCK_K], block scales [BLOCK_M, BLOCK_K / block] (fp8_tensor: the codes, unused;
    fp8_channel: t, the row scales [BLOCK_M] or one static value))."""
    if FMT == _FP8_CHANNEL:
        s = t + tl.zeros((BLOCK_M,), dtype=tl.float32)
        q = fp8_channel_quantize_tile(x, s)
    elif FMT == _FP8_TENSOR:
        q = fp8_tensor_quantize_tile(x, t)
        s = q
    elif FMT == _FP8_BLOCK:  # one 128-wide group per row of the reshaped tile
        q, s = fp8_block_quantize_tile(x.reshape(BLOCK_M * (BLOCK_K // 128), 128), RULE)
        q, s = q.reshape(BLOCK_M, BLOCK_K), s.reshape(BLOCK_M, BLOCK_K // 128)
    elif FMT == _MXFP8:  # one 32-wide block per last axis
        q, s = mxfp8_quantize_tile(x.reshape(BLOCK_M, BLOCK_K // 32, 32), RULE)
        q = q.reshape(BLOCK_M, BLOCK_K)
    elif FMT == _NVFP4:
        q, s = nvfp4_quantize_tile(x, t, BLOCK_M, BLOCK_K)
    else:
        q, s = mxfp4_quantize_tile(x, RULE == 0, BLOCK_M, BLOCK_K)
    return q, s


@triton.jit
def _amax_kernel(src_ptr, slot_ptr, expert_ptr, partial_ptr, K, n_slots, stride_src, ROWS: tl.constexpr,
                 GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """partial[block] = max |input| over the block's rows (+Inf marks a NaN/Inf), for dynamic scales;
    ROWS: partial[row] per sorted row instead (fp8_channel's per-token scale)."""
    blk = tl.program_id(0)
    if tl.load(expert_ptr + blk) < 0:
        return
    r, _, ok, src = _block_rows(slot_ptr, blk, n_slots, GATHER, TOP_K, BLOCK_M)
    amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(src_ptr + src[:, None] * stride_src + offs_k[None, :], mask=ok[:, None] & (offs_k[None, :] < K),
                    other=0.0)
        amax = tl.maximum(amax, abs_or_inf(x.to(tl.float32)))
    if ROWS:
        tl.store(partial_ptr + r, tl.max(amax, axis=1))
    else:
        tl.store(partial_ptr + blk, tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def _quantize_kernel(
    src_ptr,  # x [M, K] (GATHER) or the intermediate fp32 [rows, K] in sorted order
    slot_ptr, expert_ptr, first_block_ptr,  # the grouping (Blocks)
    partial_ptr, static_ptr,  # the blocks' (fp8_channel: rows') partial amaxes (DYNAMIC) or the static values [E]
    q_ptr, s_ptr, t_ptr,  # out: codes [rows, K or K/2] uint8, block (row) scales [rows, K/VEC], per-expert value [E]
    K, n_slots, stride_src, stride_q, stride_s,
    FMT: tl.constexpr, VEC: tl.constexpr, RULE: tl.constexpr, DYNAMIC: tl.constexpr, GATHER: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    blk = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.load(expert_ptr + blk)
    if e < 0:
        return
    r, _, ok, src = _block_rows(slot_ptr, blk, n_slots, GATHER, TOP_K, BLOCK_M)

    # ----- the expert's per-tensor value t: static, or from the amax over its blocks; fp8_channel's
    # per-token scales [BLOCK_M] from each row's amax
    t = 1.0
    if FMT == _FP8_CHANNEL and DYNAMIC:
        t = tl.math.div_rn(amax_or_nan(tl.load(partial_ptr + r), _FLOOR), _E4M3_MAX)  # amax / 448, NaN: a bad row
    elif FMT == _FP8_TENSOR or FMT == _NVFP4 or FMT == _FP8_CHANNEL:
        if DYNAMIC:
            first, end = tl.load(first_block_ptr + e), tl.load(first_block_ptr + e + 1)
            amax = tl.zeros((BLOCK_P,), dtype=tl.float32)
            for p0 in range(first, end, BLOCK_P):
                offs_p = p0 + tl.arange(0, BLOCK_P)
                amax = tl.maximum(amax, tl.load(partial_ptr + offs_p, mask=offs_p < end, other=0.0))
            amax = amax_or_nan(tl.max(amax, axis=0), _FLOOR)  # NaN if the expert's rows hold a NaN/Inf
            if FMT == _FP8_TENSOR:
                t = tl.math.div_rn(amax, _E4M3_MAX)  # the scale, amax / 448
            else:
                t = tl.math.div_rn(tl.zeros_like(amax) + _G_NUM, amax)  # g = 2688 / amax
            tl.store(t_ptr + e, t, mask=(blk == first) & (pid_k == 0))
        else:  # a bad static value (<= 0, Inf, NaN) becomes NaN: NaN outputs, never zeros
            t = tl.load(static_ptr + e)
            t = nan_if_nonfinite(tl.where(t > 0, t, float("nan")))

    # ----- the tile [BLOCK_M, BLOCK_K], quantized by the format's lesson, stored in sorted order
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(src_ptr + src[:, None] * stride_src + offs_k[None, :], mask=ok[:, None] & (offs_k[None, :] < K),
                other=0.0).to(tl.float32)
    codes, scales = _quantize_tile(x, t, FMT, RULE, BLOCK_M, BLOCK_K)
    if FMT == _NVFP4 or FMT == _MXFP4:  # two codes per byte, element 2j in the low nibble
        even, odd = tl.split(codes.reshape(BLOCK_M, BLOCK_K // 2, 2))
        offs_b = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(q_ptr + r[:, None] * stride_q + offs_b[None, :], even | (odd << 4), mask=offs_b[None, :] < K // 2)
    else:
        tl.store(q_ptr + r[:, None] * stride_q + offs_k[None, :], codes, mask=offs_k[None, :] < K)
    if FMT == _FP8_CHANNEL:
        if pid_k == 0:  # one scale per row
            tl.store(s_ptr + r * stride_s, scales)
    elif FMT != _FP8_TENSOR:
        offs_s = pid_k * (BLOCK_K // VEC) + tl.arange(0, BLOCK_K // VEC)
        tl.store(s_ptr + r[:, None] * stride_s + offs_s[None, :], scales, mask=offs_s[None, :] < K // VEC)


# == 3. The grouped GEMM ==========================================================================
@triton.jit
def _operand(ptr, s_ptr, rows, ok, k0, K, stride, stride_s, FMT: tl.constexpr, VEC: tl.constexpr,
             SCALE_ROWS: tl.constexpr, NATIVE: tl.constexpr, A16: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Rows ``rows`` x K [k0, k0 + BLOCK_K) of a GEMM operand, as the step needs them: natively the
    codes and block scales tl.dot_scaled takes; portably the fp32 values, block scales applied (A16:
    the unquantized rows). The second value is fp8_block's fp32 scale of each row for this 128-deep
    step (weight rows share one per SCALE_ROWS = 128), the block scales (native), or unused."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = ok[:, None] & (offs_k[None, :] < K)
    if A16:
        v = tl.load(ptr + rows[:, None] * stride + offs_k[None, :], mask=k_ok, other=0.0).to(tl.float32)
        s = v
    elif FMT == _FP8_TENSOR or FMT == _FP8_BLOCK or FMT == _FP8_CHANNEL:  # e4m3 codes: natively as they are
        v = tl.load(ptr + rows[:, None] * stride + offs_k[None, :], mask=k_ok, other=0)
        s = v
        if FMT == _FP8_BLOCK:
            s = tl.load(s_ptr + (rows // SCALE_ROWS) * stride_s + k0 // 128, mask=ok, other=0.0)
        if not NATIVE and FMT == _FP8_CHANNEL:
            v = fp8_channel_dequantize_tile(v)
        elif not NATIVE:
            v = fp8_block_dequantize_tile(v) if FMT == _FP8_BLOCK else fp8_tensor_dequantize_tile(v)
    elif NATIVE:  # codes (e2m1: packed bytes [rows, BLOCK_K / 2]) and their block scale bytes
        if FMT == _MXFP8:
            v = tl.load(ptr + rows[:, None] * stride + offs_k[None, :], mask=k_ok, other=0)
        else:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            v = tl.load(ptr + rows[:, None] * stride + offs_b[None, :], mask=ok[:, None] & (offs_b[None, :] < K // 2),
                        other=0)
        offs_s = k0 // VEC + tl.arange(0, BLOCK_K // VEC)
        s = tl.load(s_ptr + rows[:, None] * stride_s + offs_s[None, :], mask=ok[:, None] & (offs_s[None, :] < K // VEC),
                    other=0)
    elif FMT == _MXFP8:
        v = mxfp8_dequantize_tile(ptr, s_ptr, rows, ok, k0, K, stride, 1, stride_s, 1, BLOCK_R, BLOCK_K)
        s = v
    elif FMT == _NVFP4:
        v = nvfp4_dequantize_tile(ptr, s_ptr, rows, ok, k0, K, stride, stride_s, BLOCK_R, BLOCK_K)
        s = v
    else:
        v = mxfp4_dequantize_tile(ptr, s_ptr, rows, ok, k0, K, stride, stride_s, BLOCK_R, BLOCK_K)
        s = v
    return v, s


# [partial]
@triton.jit
def _partial(a, sa, w, sw, FMT: tl.constexpr, NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """One K step's [BLOCK_M, BLOCK_N] fp32 sum of A . W^T, from two ``_operand`` results."""
    if NATIVE and FMT == _NVFP4:
        p = tl.dot_scaled(a, sa.to(tl.float8e4nv, bitcast=True), "e2m1",
                          w.T, sw.to(tl.float8e4nv, bitcast=True), "e2m1")
    elif NATIVE and FMT == _MXFP4:
        p = tl.dot_scaled(a, sa, "e2m1", w.T, sw, "e2m1")
    elif NATIVE and FMT == _MXFP8:
        p = tl.dot_scaled(a, sa, "e4m3", w.T, sw, "e4m3")
    elif NATIVE:  # fp8_tensor, fp8_block, fp8_channel: unit E8M0 scales, for the full-rate MMA (fp8_tensor.py)
        p = tl.dot_scaled(a, tl.full((BLOCK_M, BLOCK_K // 32), 127, tl.uint8), "e4m3",
                          w.T, tl.full((BLOCK_N, BLOCK_K // 32), 127, tl.uint8), "e4m3")
    else:
        p = tl.dot(a, tl.trans(w), input_precision="tf32")
    if FMT == _FP8_BLOCK:  # this step's scales multiply its partial (fp8_block.py)
        p = p * (sa[:, None] * sw[None, :])
    return p
# [/partial]


@triton.jit
def _activation(gate, up, SWIGLU: tl.constexpr, alpha, limit):
    """silu(gate) * up, or gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with
    g = min(gate, limit), fp32; IEEE division keeps -Inf / Inf NaN on every backend. The clamps would
    turn +-Inf into the limit: a non-finite gate or up gives NaN (formats.moe_activation)."""
    if SWIGLU:
        gate = tl.where(tl.abs(gate) <= 3.4028234663852886e38, tl.minimum(gate, limit), float("nan"))
        up = tl.where(tl.abs(up) <= 3.4028234663852886e38, tl.minimum(tl.maximum(up, -limit), limit), float("nan"))
        return (up + 1.0) * tl.math.div_rn(gate, 1.0 + tl.exp(-alpha * gate))
    return tl.math.div_rn(gate, 1.0 + tl.exp(-gate)) * up


# [grouped-gemm]
@triton.jit
def _grouped_gemm_kernel(
    a_ptr, sa_ptr, ta_ptr,  # A: codes in sorted order, or x / the bf16 intermediate (A16); its block scales; [E] values
    w_ptr, sw_ptr, tw_ptr,  # W: codes [E, rows, K or K/2] uint8; block scales [E, ...]; [E] values
    bias_ptr, topk_w_ptr, slot_ptr, expert_ptr, out_ptr,  # bias [E, rows]; router weights [M * top_k] fp32
    N, K, n_slots, alpha, limit,
    stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_be, stride_om,
    FMT: tl.constexpr, VEC: tl.constexpr, NATIVE: tl.constexpr, A16: tl.constexpr,
    GATHER: tl.constexpr,  # A is x, read at each row's token (W13 of a weight-only variant)
    GATED: tl.constexpr,  # W13: gate and up rows, the activation in the epilogue; else W2: router weights, scatter
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk)
    if e < 0:  # past the last expert's blocks
        return
    r, slot, m_ok, a_rows = _block_rows(slot_ptr, blk, n_slots, GATHER, TOP_K, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # the weight rows of this tile: W2's own; W13's gate and up rows of intermediate columns offs_n
    if ACT == _SWIGLU:  # gpt-oss interleaves them
        rows_g, rows_u = 2 * offs_n, 2 * offs_n + 1
    else:
        rows_g, rows_u = offs_n, offs_n + N
    # all the grouping changes in the GEMM: the expert's weight, scales and bias
    w_ptr += e.to(tl.int64) * stride_we
    sw_ptr += e.to(tl.int64) * stride_swe
    bias_ptr += e.to(tl.int64) * stride_be

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, sa = _operand(a_ptr, sa_ptr, a_rows, m_ok, k0, K, stride_am, stride_sam, FMT, VEC, 1, NATIVE, A16,
                         BLOCK_M, BLOCK_K)
        w, sw = _operand(w_ptr, sw_ptr, rows_g, n_ok, k0, K, stride_wn, stride_swn, FMT, VEC, 128, NATIVE, False,
                         BLOCK_N, BLOCK_K)
        acc_g += _partial(a, sa, w, sw, FMT, NATIVE, BLOCK_M, BLOCK_N, BLOCK_K)
        if GATED:
            w, sw = _operand(w_ptr, sw_ptr, rows_u, n_ok, k0, K, stride_wn, stride_swn, FMT, VEC, 128, NATIVE, False,
                             BLOCK_N, BLOCK_K)
            acc_u += _partial(a, sa, w, sw, FMT, NATIVE, BLOCK_M, BLOCK_N, BLOCK_K)

    # ----- epilogue: alpha and bias, then the activation (W13) or the router weight (W2)
    if FMT == _FP8_CHANNEL:  # the token and channel scales (contiguous) meet first, as in fp8_channel.py
        sa = tl.load(sa_ptr + r, mask=m_ok, other=0.0)
        acc_g = acc_g * (sa[:, None] * tl.load(sw_ptr + rows_g, mask=n_ok, other=0.0)[None, :])
        if GATED:
            acc_u = acc_u * (sa[:, None] * tl.load(sw_ptr + rows_u, mask=n_ok, other=0.0)[None, :])
    y = epilogue(acc_g, rows_g, n_ok, ta_ptr + e, tw_ptr + e, bias_ptr, TENSOR_SCALES=FMT == _FP8_TENSOR,
                 GLOBAL_SCALES=FMT == _NVFP4, HAS_BIAS=HAS_BIAS, ROUND_BF16=False)
    if GATED:
        up = epilogue(acc_u, rows_u, n_ok, ta_ptr + e, tw_ptr + e, bias_ptr, TENSOR_SCALES=FMT == _FP8_TENSOR,
                      GLOBAL_SCALES=FMT == _NVFP4, HAS_BIAS=HAS_BIAS, ROUND_BF16=False)
        y = _activation(y, up, ACT != _SILU, alpha, limit)
        if A16:  # the weight-only intermediate is W2's bf16 operand (RNE on every backend)
            y = round_to_bf16_rne(y)
        out_rows = r
    else:
        y = y * tl.load(topk_w_ptr + slot, mask=m_ok, other=0.0)[:, None]
        out_rows = slot
    tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
# [/grouped-gemm]


# == 4. The experts, the route ====================================================================
@dataclass(frozen=True)
class MoEWeights:
    """The experts stacked once (``prepare_experts``); ``w13``, ``w2``: (codes uint8 [E, N, K] or
    packed e2m1 [E, N, K/2]; block scales [E, ...], linear (fp32 for fp8_block, else bytes; None for
    fp8_tensor); one fp32 per expert [E]: fp8_tensor's weight scale, nvfp4's global scale, or None)."""

    fmt: str
    w13: tuple
    w2: tuple
    num_experts = property(lambda self: self.w13[0].shape[0])
    hidden = property(lambda self: self.w2[0].shape[1])
    intermediate = property(lambda self: self.w13[0].shape[1] // 2)
    device = property(lambda self: self.w13[0].device)


def _stack(ws, name: str) -> tuple:
    """One GEMM's experts checked (formats.validate.check_weight, one format, shape and device) and stacked."""
    if isinstance(ws, QuantizedTensor) or not isinstance(ws, Sequence) or len(ws) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of weight QuantizedTensors, one per expert, "
                         f"got {type(ws).__name__}")
    for e, q in enumerate(ws):
        check_weight(q, name=f"{name}[{e}]", layouts=("linear",))
        if (q.fmt, q.shape, q.device) != (ws[0].fmt, ws[0].shape, ws[0].device):
            raise ValueError(f"every expert of {name} must have {name}[0]'s format, shape and device ({ws[0].fmt}, "
                             f"{ws[0].shape}, {ws[0].device}), got {name}[{e}]: {q.fmt}, {q.shape}, {q.device}")
    if ws[0].fmt not in FORMATS:
        raise ValueError(f"{name}: the MoE lesson serves {FORMATS}, got {ws[0].fmt!r}")
    block = None if ws[0].block_shape is None else torch.stack([q.scale for q in ws])
    per_expert = [q.scale if q.block_shape is None else q.global_scale for q in ws]
    return (torch.stack([q.data.view(torch.uint8) for q in ws]),
            block if block is None or block.dtype == torch.float32 else block.view(torch.uint8),
            None if per_expert[0] is None else torch.stack([v.reshape(()) for v in per_expert]).float())


def prepare_experts(w13: Sequence[QuantizedTensor], w2: Sequence[QuantizedTensor]) -> MoEWeights:
    """The experts as formats.reference_moe takes them (E weight QuantizedTensors each: W13 [2I, H],
    gate rows then up rows or interleaved; W2 [H, I]; a format of FORMATS, linear scales, one device),
    stacked once for the kernels. ValueError naming the argument: not a list of weights, a malformed
    expert (formats.validate.check_weight), mixed formats, shapes or devices, a format without a lesson
    here, W13 and W2 of other formats, expert counts or shapes than [2I, H] and [H, I]."""
    p = MoEWeights(None, _stack(w13, "w13"), _stack(w2, "w2"))
    if w2[0].fmt != w13[0].fmt or len(w2) != len(w13) or w13[0].shape != (2 * w2[0].shape[1], w2[0].shape[0]):
        raise ValueError(f"w13 must be E experts [2I, H] and w2 E experts [H, I] of one format, got {len(w13)} x "
                         f"{w13[0].fmt} {list(w13[0].shape)} and {len(w2)} x {w2[0].fmt} {list(w2[0].shape)}")
    return MoEWeights(w13[0].fmt, p.w13, p.w2)


def tile_config(M: int, E: int, top_k: int, H: int, I: int, fmt: str, path: str, capability=None) -> TileConfig:
    """Both GEMMs' tile without ``tile=``. BLOCK_M, the rows of an expert block: the mean rows per
    expert (M top_k / E), 16 to 64 (an expert pads at most BLOCK_M - 1 rows). BLOCK_N x BLOCK_K: as
    large as the problem under the interpreter; on a GPU 64 x 128 natively, 64 x 64 portably (decoded
    fp32 tiles live in registers); fp8_block's BLOCK_K is its 128-wide scale group."""
    block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(max(M * top_k, 1), E))))
    if capability is None:
        bn, bk = min(256, triton.next_power_of_2(max(H, I))), min(512, max(64, triton.next_power_of_2(max(H, I))))
    else:
        bn, bk = 64, 128 if path == "native" else 64
    big = capability is not None and block_m == 64  # W13's two accumulators stay in registers over 8 warps, 1 stage
    return TileConfig(block_m, bn, 128 if fmt == "fp8_block" else bk, num_warps=8 if big else 4,
                      num_stages=1 if big or capability is None else 2)


def _act_opts(opts, fmt: str, E: int, device, name: str) -> tuple[Optional[torch.Tensor], int]:
    """(static per-expert values float32 [E], or None: dynamic; RULE) of formats.quantize's activation
    options ``opts`` (a value may hold one number per expert). ValueError naming the option."""
    key, opts = ACT_OPTION[fmt], dict(opts or {})
    v = opts.get(key)
    if set(opts) - {key} or (key == "scale_rule" and v not in (None, "ceil", "floor")):
        rule = " ('ceil' or 'floor')" if key == "scale_rule" else ""
        raise ValueError(f"{name} takes only {key!r}{rule} for {fmt}, got {opts}")
    if key in ("scale_rule", "ue8m0") or v is None:
        return None, int(v in ("floor", True))
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() in (1, E):  # values checked in-kernel
        return v.to(device=device, dtype=torch.float32).reshape(-1).expand(E).contiguous(), 0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise ValueError(f"{name}[{key!r}] must be one positive number or a float tensor of 1 or {E} (one per "
                         f"expert) values, got {v!r}")
    return torch.full((E,), float(v), device=device), 0


def _plan(M, E, top_k, H, I, fmt, a16, capability, path, tile, w13_act_opts, w2_act_opts):
    """(the route, its GEMM path, its tile): the one place a call's kernels are decided."""
    if fmt not in FORMATS or (a16 and fmt not in A16_FORMATS):
        raise ValueError(f"fmt must be one of {FORMATS} ({A16_FORMATS} with a16=True), got {fmt!r}, a16={a16}")
    if min(M, E, top_k, H, I) < 0 or min(E, top_k, H, I) == 0:
        raise ValueError(f"M must be >= 0 and E, top_k, H, I > 0, got {(M, E, top_k, H, I)}")
    if a16 and path != "native":  # the block-scaled MMA takes FP8 x FP8 or FP4 x FP4 only
        path, why = "portable", "weight-only: x (or the bf16 intermediate) dots the decoded weight in tf32, exactly"
    else:
        path, why = route_path(path, fmt, capability, a16=a16)
    tile = tile or tile_config(M, E, top_k, H, I, fmt, path, capability)
    if fmt == "fp8_block" and tile.BLOCK_K != 128:
        raise ValueError(f"fp8_block needs tile.BLOCK_K == 128 (one scale per K step), got {tile}")
    if M == 0:
        return Route("triton", (), why=f"{fmt}: no tokens, nothing to launch"), path, tile
    dynamic = [fmt in DYNAMIC_AMAX and (o or {}).get(ACT_OPTION[fmt]) is None
               for o in (w13_act_opts, w2_act_opts)]  # an amax kernel before the quantizer
    quant = [() if a16 else ("_amax_kernel",) * d + ("_quantize_kernel",) for d in dynamic]
    why = (f"{fmt}{' weight-only' if a16 else ''}: rows sorted by expert in blocks of {tile.BLOCK_M} (a grid of "
           f"{triton.cdiv(M * top_k, tile.BLOCK_M) + min(M * top_k, E)} blocks, the most any routing of {M} x "
           f"{top_k} over {E} experts needs); W13 + activation, {'bf16' if a16 else 'quantized'} intermediate, "
           f"W2 + router weights, then the top_k sum; {path} GEMMs: {why}")
    return Route("triton", quant[0] + ("_grouped_gemm_kernel",) + quant[1] + ("_grouped_gemm_kernel",), str(tile), 1,
                 why), path, tile


def route(M: int, E: int, top_k: int, H: int, I: int, *, fmt: str, a16: bool = False, capability=None,
          sm_count: int = 1, path: Optional[str] = None, tile: Optional[TileConfig] = None,
          w13_act_opts=None, w2_act_opts=None) -> Route:
    """The Route ``fused_moe`` launches for x [M, H] and E experts (W13 [2I, H], W2 [H, I]), top_k per
    token, in ``fmt`` (``a16``: weight-only) on a device of ``capability`` ((major, minor); None: the
    interpreter); a static per-tensor value in the act opts drops an amax kernel; sm_count changes
    nothing. Pure. ValueError: a format or a16 not served here, a bad size or tile, or a path
    _common.route_path refuses (nvfp4 native under the interpreter)."""
    return _plan(M, E, top_k, H, I, fmt, a16, capability, path, tile, w13_act_opts, w2_act_opts)[0]


# == 5. The launchers (arguments checked by the caller) ===========================================
def _vec(fmt: str) -> int:
    """Elements per activation block scale along K (fp8_tensor 32, unused; fp8_channel's row scale: 1)."""
    return (spec(fmt).activation_block or (1, 32))[1] or 1


def _quantize(src, blocks: Blocks, fmt: str, static, rule: int, gather: bool, top_k: int, E: int):
    """Step 2 on src (x [M, K] gathered, or the fp32 intermediate in sorted order): (codes, block
    scales, per-expert values [E]) of every sorted row."""
    K, rows, nb = src.shape[1], blocks.slot.numel(), blocks.expert.numel()
    vec, per_row = _vec(fmt), fmt == "fp8_channel"
    q = torch.empty((rows, K // 2 if spec(fmt).element == "e2m1" else K), dtype=torch.uint8, device=src.device)
    s = torch.empty((rows, 1 if per_row else K // vec), dtype=torch.float32 if fmt in ("fp8_block", "fp8_channel")
                    else torch.uint8, device=src.device)
    t = torch.ones(E, dtype=torch.float32, device=src.device) if static is None else static
    bk = max(128, min(1024, triton.next_power_of_2(K))) if interpreting() else 128
    dynamic = static is None and fmt in DYNAMIC_AMAX
    partial = torch.empty(rows if per_row else nb, dtype=torch.float32, device=src.device) if dynamic else t
    common = dict(GATHER=gather, TOP_K=top_k, BLOCK_M=blocks.block_m, BLOCK_K=bk)
    if dynamic:
        launch(_amax_kernel, (nb,), src, blocks.slot, blocks.expert, partial, K, blocks.n_slots, src.stride(0),
               ROWS=per_row, **common)
    launch(_quantize_kernel, (nb, triton.cdiv(K, bk)), src, blocks.slot, blocks.expert, blocks.first_block, partial,
           t, q, s, t, K, blocks.n_slots, src.stride(0), q.stride(0), s.stride(0), FMT=FORMATS.index(fmt), VEC=vec,
           RULE=rule, DYNAMIC=dynamic, BLOCK_P=min(1024, max(16, triton.next_power_of_2(nb))), **common)
    return q, s, t


def _gemm(a, sa, ta, w: tuple, blocks: Blocks, out, fmt: str, path: str, tile: TileConfig, *, a16: bool, gather: bool,
          act: int, bias, topk_w, top_k: int, alpha: float, limit: float) -> None:
    """Step 3 for one GEMM into ``out``: W13 (act >= 0) the intermediate [rows, I] in sorted order, W2
    (act = -1) the slot rows [M * top_k, H] fp32."""
    data, block, per_expert = w
    block = data if block is None else block
    bias_t = bias.contiguous() if bias is not None else out
    launch(_grouped_gemm_kernel, (blocks.expert.numel(), triton.cdiv(out.shape[1], tile.BLOCK_N)),
           a, sa, ta, data, block, ta if per_expert is None else per_expert, bias_t, topk_w, blocks.slot, blocks.expert,
           out, out.shape[1], data.shape[2] * (2 if spec(fmt).element == "e2m1" else 1), blocks.n_slots, alpha, limit,
           a.stride(0), sa.stride(0), data.stride(0), data.stride(1), block.stride(0),
           block.stride(1) if block.dim() > 1 else 0, bias_t.stride(0), out.stride(0),
           FMT=FORMATS.index(fmt), VEC=_vec(fmt), NATIVE=path == "native", A16=a16,
           GATHER=gather, GATED=act >= 0, ACT=max(act, 0), HAS_BIAS=bias is not None, TOP_K=top_k,
           BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, num_warps=tile.num_warps,
           num_stages=tile.num_stages)


# == 6. The public functions: check, then launch ==================================================
def fused_moe(x: torch.Tensor, prepared: MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              activation: str = "silu", renormalize: bool = False, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, a16: bool = False, w13_act_opts=None, w2_act_opts=None,
              swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
              tile: Optional[TileConfig] = None, path: Optional[str] = None) -> torch.Tensor:
    """y [M, H] of x's dtype: one MoE layer's routed experts as formats.reference_moe computes them
    from the same arguments, with the kernels of ``route``. x: bf16/fp16 [M, H] on the experts'
    device; prepared: ``prepare_experts(w13, w2)``; topk_ids: integer [M, top_k] in [0, E);
    topk_weights: float [M, top_k]; activation: one of formats.MOE_ACTIVATIONS (swiglu_alpha,
    swiglu_limit: the SwiGLU ones'); renormalize: each token's weights divided by their sum (a zero sum
    gives NaN); w13_bias float [E, 2I] (W13's row order), w2_bias float [E, H]; a16: weight-only
    (mxfp8_w8a16, nvfp4_w4a16, mxfp4_w4a16); w13_act_opts, w2_act_opts: formats.quantize's activation
    option of the format (fp8_tensor ``scale`` / nvfp4 ``global_scale``: a number or [E], one per
    expert; without one, each expert's dynamic value; fp8_block ``ue8m0``; MX ``scale_rule``); tile:
    both GEMMs' TileConfig (BLOCK_M: the rows of an expert block); path: None, "native" or "portable".
    ValueError naming the argument (_common.check_moe_call): x not bf16/fp16 [M, H] on the device;
    topk_ids not integer [M, top_k] on the device or outside [0, E) (read: a device synchronization);
    topk_weights not float [M, top_k] on the device; an unknown activation; biases not float [E, 2I] /
    [E, H] on the device; a16 for a format without a weight-only variant; a bad act option, tile or
    path. Source: formats.reference_moe (the numbers), vLLM's fused_moe Triton kernel (the grouping)."""
    if not isinstance(prepared, MoEWeights):
        raise ValueError(f"prepared must be a MoEWeights (prepare_experts), got {type(prepared).__name__}")
    check_moe_call(x, topk_ids, topk_weights, E=prepared.num_experts, H=prepared.hidden, I=prepared.intermediate,
                   fmt=prepared.fmt, device=prepared.device, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias)
    return fused_moe_unchecked(x, prepared, topk_ids, topk_weights, activation=activation, renormalize=renormalize,
                               w13_bias=w13_bias, w2_bias=w2_bias, a16=a16, w13_act_opts=w13_act_opts,
                               w2_act_opts=w2_act_opts, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                               tile=tile, path=path)


def fused_moe_unchecked(x, prepared: MoEWeights, topk_ids, topk_weights, *, activation="silu", renormalize=False,
                        w13_bias=None, w2_bias=None, a16=False, w13_act_opts=None, w2_act_opts=None,
                        swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, tile=None, path=None) -> torch.Tensor:
    """``fused_moe`` without its argument checks (the act options, tile and path are still read), for a
    caller that made them (dispatch's bound call): the same result; wrong arguments give wrong numbers."""
    return _steps(x, prepared, topk_ids, topk_weights, activation=activation, renormalize=renormalize,
                  w13_bias=w13_bias, w2_bias=w2_bias, a16=a16, w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts,
                  alpha=swiglu_alpha, limit=swiglu_limit, tile=tile, path=path)


@dataclass(frozen=True)
class Stages:
    """Each step's result of one ``fused_moe`` call (``fused_moe_stages``), one row per slot
    (slot = token * top_k + j, the (token, j) pair), for a debugger (``b12x-dual diff``):

    x_q:  the W13 input quantized, (codes uint8 [slots, H or H/2], block scales [slots, H/VEC] (fp8_channel:
          [slots, 1]), per-expert values float32 [E]); None for a weight-only variant (x is read as it is)
    h:    float32 [slots, 2I]: W13's output after alpha and bias, before the activation (W13's GEMM run
          once more without the activation epilogue, so that the two can be told apart)
    a:    [slots, I]: the activated intermediate (float32; bfloat16 weight-only)
    a_q:  the W2 input quantized, as x_q; None weight-only
    o:    float32 [slots, H]: W2's output times the router weight (renormalized if asked)
    y:    [M, H] of x's dtype: the result, as ``fused_moe`` returns it"""

    x_q: Optional[tuple]
    h: torch.Tensor
    a: torch.Tensor
    a_q: Optional[tuple]
    o: torch.Tensor
    y: torch.Tensor


def fused_moe_stages(x, prepared: MoEWeights, topk_ids, topk_weights, *, activation="silu", renormalize=False,
                     w13_bias=None, w2_bias=None, a16=False, w13_act_opts=None, w2_act_opts=None,
                     swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, tile=None, path=None) -> Stages:
    """``fused_moe_unchecked``'s call with every step kept (:class:`Stages`): the same kernels on the same
    arguments (y is the same), plus one more launch of W13's GEMM without the activation, so that a
    debugger can compare each step with the oracle's. Arguments are not checked (as fused_moe_unchecked)."""
    keep: dict = {}
    _steps(x, prepared, topk_ids, topk_weights, activation=activation, renormalize=renormalize, w13_bias=w13_bias,
           w2_bias=w2_bias, a16=a16, w13_act_opts=w13_act_opts, w2_act_opts=w2_act_opts, alpha=swiglu_alpha,
           limit=swiglu_limit, tile=tile, path=path, keep=keep)
    return Stages(**keep)


def _by_slot(t: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Rows in sorted order -> rows in slot order (padding dropped)."""
    real = blocks.slot < blocks.n_slots
    out = t.new_empty((blocks.n_slots,) + tuple(t.shape[1:]))
    out[blocks.slot[real].long()] = t[real]
    return out


def _steps(x, p: MoEWeights, topk_ids, topk_weights, *, activation, renormalize, w13_bias, w2_bias, a16, w13_act_opts,
           w2_act_opts, alpha, limit, tile, path, keep: Optional[dict] = None) -> torch.Tensor:
    """Steps 1 to 4; ``keep``: a dict that receives each step's result (fused_moe_stages)."""
    M, top_k = topk_ids.shape
    _, path, tile = _plan(M, p.num_experts, top_k, p.hidden, p.intermediate, p.fmt, a16, device_capability(x.device),
                          path, tile, w13_act_opts, w2_act_opts)
    if M == 0:
        return x.new_empty((0, p.hidden))
    blocks, a13, inter = _w13(x, p, topk_ids, path, tile, a16=a16, act_opts=w13_act_opts, activation=activation,
                              bias=w13_bias, alpha=alpha, limit=limit)
    w = topk_weights.float()
    w = (w / w.sum(dim=-1, keepdim=True) if renormalize else w).reshape(-1).contiguous()
    slots = torch.empty((M * top_k, p.hidden), dtype=torch.float32, device=x.device)
    a = (inter, inter, torch.ones(p.num_experts, device=x.device)) if a16 else \
        _quantize(inter, blocks, p.fmt, *_act_opts(w2_act_opts, p.fmt, p.num_experts, x.device, "w2_act_opts"), False,
                  top_k, p.num_experts)
    _gemm(*a, p.w2, blocks, slots, p.fmt, path, tile, a16=a16, gather=False, act=-1, bias=w2_bias, topk_w=w,
          top_k=top_k, alpha=0.0, limit=0.0)
    y = slots.view(M, top_k, p.hidden).sum(dim=1).to(x.dtype)  # the top_k sum in fp32, one rounding
    if keep is not None:  # a debugger's copy of each step (not on the serving path)
        h = torch.empty((M * top_k, 2 * p.intermediate), dtype=torch.float32, device=x.device)
        _gemm(*a13, p.w13, blocks, h, p.fmt, path, tile, a16=a16, gather=a16, act=-1, bias=w13_bias,
              topk_w=torch.ones(M * top_k, device=x.device), top_k=top_k, alpha=0.0, limit=0.0)
        keep.update(x_q=None if a16 else (_by_slot(a13[0], blocks), _by_slot(a13[1], blocks), a13[2]), h=h,
                    a=_by_slot(inter, blocks),
                    a_q=None if a16 else (_by_slot(a[0], blocks), _by_slot(a[1], blocks), a[2]),
                    o=slots, y=y)
    return y


def _w13(x, p: MoEWeights, topk_ids, path, tile, *, a16, act_opts, activation, bias, alpha, limit):
    """Steps 1 to 3 for W13: (the Blocks, W13's input (codes, scales, per-expert values; x itself for a16),
    the activated intermediate [rows, I] in sorted order: fp32, or bf16 for a16)."""
    E, top_k, x = p.num_experts, topk_ids.shape[1], x.contiguous()
    blocks = align_block_size(topk_ids, E, tile.BLOCK_M)
    inter = torch.empty((blocks.slot.numel(), p.intermediate), dtype=torch.bfloat16 if a16 else torch.float32,
                        device=x.device)
    a = (x, x, torch.ones(E, device=x.device)) if a16 else \
        _quantize(x, blocks, p.fmt, *_act_opts(act_opts, p.fmt, E, x.device, "w13_act_opts"), True, top_k, E)
    _gemm(*a, p.w13, blocks, inter, p.fmt, path, tile, a16=a16, gather=a16, act=MOE_ACTIVATIONS.index(activation),
          bias=bias, topk_w=inter, top_k=top_k, alpha=float(alpha), limit=float(limit))
    return blocks, a, inter
