"""The second kernels of the Hopper (sm_90) GEMMs of all five formats: the split-K reduction and
the plain bf16 GEMM that follows a dequantizing pre-pass.

Both exist for the same reason: a quantized GEMM on Hopper has two regimes that one fused kernel
serves badly.

Decode (small M): the work is streaming the weight once. One program per [BLOCK_M, BLOCK_N] output
tile gives only N / BLOCK_N programs (128 for N = 8192), each walking all of K one tile at a time:
one or two programs per SM cannot keep enough loads in flight to reach HBM bandwidth. Split-K gives
every output tile SPLIT_K programs, each summing a contiguous K range into its own fp32 slice of a
workspace [SPLIT_K, M, N]; ``splitk_reduce_kernel`` then adds the slices in a fixed order (so the
result does not depend on timing, unlike atomics) and applies the epilogue once:

    y[m, n] = (sum_s ws[s, m, n]) * alpha + bias[n]        cast to the output dtype

The workspace costs SPLIT_K * M * N * 4 bytes written and read: 4 MB at M = 16, N = 8192, SPLIT_K = 8,
against 38 to 67 MB of weights.

Prefill (large M): a dequantizing kernel (mxfp8, nvfp4, mxfp4) decodes each weight tile once per
row tile, M / BLOCK_M times in all, and the bit arithmetic of the decode then costs more than the
tensor-core work. The pre-pass decodes every operand exactly once into bf16 scratch (every decoded
value is exact in bf16: see _fp4_gemm and mxfp8), and ``bf16_gemm_kernel`` multiplies the scratch
matrices with the scales already applied. Same function, same fp32 accumulation; the price is
2 bytes per element of scratch traffic, small next to 2 * M * N * K FLOPs once M is a few hundred.

alpha is the epilogue's ALPHA_MODE (``epilogue`` below: none, s1 * s2, or nvfp4's (1 / s1) * (1 / s2));
the lessons' epilogue (_common) names the same choices with two flags.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._codecs import global_alpha, round_to_bf16_rne
from .._common import interpreting, launch
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._route import TileConfig


# ---------------------------------------------------------------------------------------------
# The epilogue of the hopper kernels: acc * alpha + bias, alpha chosen by an integer mode
# ---------------------------------------------------------------------------------------------
# ALPHA_MODE (constexpr): what multiplies the fp32 accumulator before the bias
ALPHA_NONE = 0          # 1: every scale was applied in the K loop
ALPHA_SCALES = 1        # s1 * s2: fp8_tensor's two per-tensor scales (they meet first: acc * s1
                        # alone can overflow where the result does not)
ALPHA_GLOBAL_RECIP = 2  # (1 / s1) * (1 / s2): nvfp4's global scales, read from device tensors (no
                        # host sync); NaN unless both are finite and > 0 (_codecs.global_alpha)
NO_ALPHA = tl.constexpr(ALPHA_NONE)  # for kernels that call epilogue() with every scale already applied
_ALPHA_SCALES = tl.constexpr(ALPHA_SCALES)
_ALPHA_GLOBAL_RECIP = tl.constexpr(ALPHA_GLOBAL_RECIP)


@triton.jit
def epilogue(acc, offs_n, n_ok, s1_ptr, s2_ptr, bias_ptr,
             ALPHA_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 * alpha (ALPHA_MODE) + bias[offs_n] (any float dtype, added in
    fp32), rounded to bf16 values (RNE) when ROUND_BF16 (the interpreter's fp32 -> bf16 cast truncates)."""
    if ALPHA_MODE == _ALPHA_SCALES:
        acc = acc * (tl.load(s1_ptr) * tl.load(s2_ptr))
    if ALPHA_MODE == _ALPHA_GLOBAL_RECIP:
        acc = acc * global_alpha(tl.load(s1_ptr), tl.load(s2_ptr))
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_to_bf16_rne(acc)
    return acc


@triton.jit
def swapped_tile(N, M, K, K_PER, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's place in a swapped-operand decode GEMM (grid (N tiles, splits); acc [BLOCK_N,
    BLOCK_M], the weight rows on the MMA's M side): (offs_n, offs_m, n_mask, m_mask, k_lo, k_hi),
    its weight rows, the padded activation rows, their masks and its K range [k_lo, k_hi)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k_lo = tl.program_id(1) * K_PER
    return offs_n, offs_m, offs_n < N, offs_m < M, k_lo, tl.minimum(k_lo + K_PER, K)


@triton.jit
def store_splitk_partial(ws_ptr, acc, pid_k, offs_m, offs_n, M, N, mask):
    """Write one program's fp32 partial sum into slice pid_k of the workspace [SPLIT_K, M, N] (the
    layout splitk_reduce_kernel reads); the epilogue runs there, once, after the ordered sum."""
    tl.store(ws_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :], acc, mask=mask)


# ---------------------------------------------------------------------------------------------
# Split-K: sum the fp32 slices in order, then the epilogue
# ---------------------------------------------------------------------------------------------
@triton.jit
def splitk_reduce_kernel(
    ws_ptr, y_ptr, s1_ptr, s2_ptr, bias_ptr,
    M, N, stride_ym,
    SPLIT_K: tl.constexpr, ALPHA_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """y[tile] = epilogue(sum_s ws[s, tile]); ws is contiguous fp32 [SPLIT_K, M, N]. USE_PDL: _pdl."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    mask = m_ok[:, None] & n_ok[None, :]
    rows = offs_m.to(tl.int64)  # int64: the workspace [SPLIT_K * M, N] may pass 2^31 elements
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_wait(USE_PDL)  # the GEMM's partials
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits every run
        acc += tl.load(ws_ptr + (rows + s * M)[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    pdl_launch_dependents(USE_PDL)
    acc = epilogue(acc, offs_n, n_ok, s1_ptr, s2_ptr, bias_ptr, ALPHA_MODE, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


TARGET_PROGRAMS = 1024  # Hopper: 132 SMs, ~8 small programs each in flight


def split_k_for(M: int, N: int, K: int, bm: int, bn: int, bk: int, target: int = TARGET_PROGRAMS) -> int:
    """Smallest power-of-two split that brings the grid to ``target`` programs, keeping at least
    4 K tiles per program (fewer makes the fp32 workspace cost more than the extra programs gain)."""
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = 1
    while tiles * split < target and triton.cdiv(K, bk) >= 8 * split:
        split *= 2
    return split


def splitk_plan(K: int, cfg: TileConfig) -> tuple[int, int]:
    """(programs along K, K elements per program): K_PER is a multiple of BLOCK_K, so no program's
    tile crosses into the next one's range; the split count may shrink for short K."""
    k_tiles = triton.cdiv(K, cfg.BLOCK_K)
    k_per = triton.cdiv(k_tiles, max(1, cfg.SPLIT_K)) * cfg.BLOCK_K
    return triton.cdiv(K, k_per), k_per


def decode_split(cfg: TileConfig, N: int, K: int, max_programs: float) -> TileConfig:
    """cfg with the split-K of the swapped decode kernels (_fp4_decode, _e4m3_decode): the largest
    power of two that keeps cdiv(N, BLOCK_N) * split <= max_programs and every split >= 4 K steps,
    then the count splitk_plan launches for it, so that the reported SPLIT_K is the launched one."""
    tiles, k_steps = triton.cdiv(N, cfg.BLOCK_N), triton.cdiv(K, cfg.BLOCK_K)
    split = 1
    while tiles * split * 2 <= max_programs and k_steps >= 8 * split:
        split *= 2
    return dataclasses.replace(cfg, SPLIT_K=splitk_plan(K, dataclasses.replace(cfg, SPLIT_K=split))[0])


def splitk_workspace(split: int, M: int, N: int, device) -> torch.Tensor:
    return torch.empty((split, M, N), dtype=torch.float32, device=device)


def launch_splitk_reduce(ws, y, *, bias=None, alpha_mode=ALPHA_NONE, s1=None, s2=None) -> torch.Tensor:
    """y [M, N] (row stride free, column stride 1) = epilogue(ws.sum(0)), summed in order."""
    split, M, N = ws.shape
    bm, bn = (min(64, triton.next_power_of_2(M)), min(256, triton.next_power_of_2(N))) if interpreting() \
        else (16, 256)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    launch(splitk_reduce_kernel, grid,
        ws, y, s1 if s1 is not None else ws, s2 if s2 is not None else ws,
        bias if bias is not None else ws,
        M, N, y.stride(0),
        SPLIT_K=split, ALPHA_MODE=alpha_mode, HAS_BIAS=bias is not None,
        ROUND_BF16=interpreting() and y.dtype == torch.bfloat16,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=4, **pdl_launch(y.device),
    )
    return y


# ---------------------------------------------------------------------------------------------
# Pre-pass path: a plain GEMM of two decoded (bf16 on GPU, fp32 in the interpreter) matrices
# ---------------------------------------------------------------------------------------------
@triton.jit
def bf16_gemm_kernel(
    a_ptr, b_ptr, s1_ptr, s2_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_ym,
    ALPHA_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y = epilogue(A [M, K] . B [N, K]^T). A and B are already decoded with their scales applied,
    so the K loop is the textbook Triton matmul (Hopper: wgmma fed by pipelined loads)."""
    pid = tl.program_id(0)
    # grouped ordering: GROUP_M row tiles walk one column of weight tiles together (L2 reuse)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = epilogue(acc, offs_n, n_ok, s1_ptr, s2_ptr, bias_ptr, ALPHA_MODE, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def bf16_gemm_config(M: int, N: int, K: int, interp: bool) -> TileConfig:
    """Tiles of the pre-pass GEMM: whole small problems in the interpreter; on Hopper the usual
    128 x 256 x 64, 8 warps, 3 stages (3 * (128 + 256) * 64 * 2 B = 144 KB of shared memory)."""
    if interp:
        p = triton.next_power_of_2
        return TileConfig(min(128, max(16, p(M))), min(128, max(16, p(N))), min(256, max(16, p(K))),
                          num_warps=4, num_stages=1)
    return TileConfig(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3)


def scratch_dtype() -> torch.dtype:
    """The pre-pass scratch dtype: bf16 on GPU; fp32 in the interpreter, whose bf16 tl.dot is wrong."""
    return torch.float32 if interpreting() else torch.bfloat16


def launch_bf16_gemm(a, b, y, *, bias=None, alpha_mode=ALPHA_NONE, s1=None, s2=None,
                     config: TileConfig | None = None) -> torch.Tensor:
    """y [M, N] = epilogue(a [M, K] . b [N, K]^T); a and b share one dtype (bf16, or fp32 in the interpreter)."""
    M, K = a.shape
    N = b.shape[0]
    interp = interpreting()
    cfg = config or bf16_gemm_config(M, N, K, interp)
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),)
    launch(bf16_gemm_kernel, grid,
        a, b, s1 if s1 is not None else a, s2 if s2 is not None else a, bias if bias is not None else y, y,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0),
        ALPHA_MODE=alpha_mode, HAS_BIAS=bias is not None, ROUND_BF16=interp and y.dtype == torch.bfloat16,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
