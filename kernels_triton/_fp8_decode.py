"""Decode-sized FP8 GEMM (M <= 16) on sm_90: the performance path of fp8_tensor and fp8_block.

The lesson kernels' 16-row tile is below wgmma's 64-row minimum, so at M <= 16 Triton lowers them
to mma.sync. Swapping the operands (acc[n, m] = sum_k W[n, k] * X[m, k], the weight on the MMA's
M side) gives wgmma m64n16k32 with both e4m3 operands K-major from shared memory, fed by the
pipelined loads. Split-K partials go through _twopass's ordered reduction.

Two scale encodings share the kernel body (BLOCK_SCALED, constexpr):
    per-tensor (fp8_tensor)   acc = dot(w, x^T, acc), the wgmma accumulator promoted to fp32 every
                              IMPRECISE_ACC products as in the lesson kernel; s_x * s_w and the
                              bias applied once, in the epilogue or the split-K reduction.
    block (fp8_block)         one 128-deep K step is one scale block: part = dot(w, x^T) into a
                              fresh accumulator, then acc += part * (sw[n // 128, kb] * sx[m, kb]),
                              i.e. fp32 promotion per 128-K interval as fp8_block's lesson kernel;
                              partials are already scaled, so the reduction adds the bias only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import TileConfig, interpreting
from ._paths import device_capability, sm_count
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._twopass import (ALPHA_NONE, ALPHA_SCALES, NO_ALPHA, epilogue, launch_splitk_reduce, splitk_plan,
                       splitk_workspace, store_splitk_partial)

_ALPHA_SCALES = tl.constexpr(ALPHA_SCALES)
_SCALE_BLOCK = tl.constexpr(128)  # fp8_block: 1x128 activation groups, 128x128 weight blocks


@triton.jit
def fp8_decode_gemm_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
    stride_sxm, stride_sxk, stride_swn, stride_swk,  # BLOCK_SCALED only: sx [M, K/128], sw [N/128, K/128]
    HAS_BIAS: tl.constexpr, IMPRECISE_ACC: tl.constexpr, BLOCK_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # _pdl
):
    if BLOCK_SCALED:
        tl.static_assert(BLOCK_K == _SCALE_BLOCK, "block FP8 needs BLOCK_K == 128: one scale per K step")
        # a tile's weight rows then lie in one 128-row scale block: one scalar sw per K step
        tl.static_assert(_SCALE_BLOCK % BLOCK_N == 0, "block FP8 needs BLOCK_N to divide 128")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    pdl_wait(USE_PDL)  # the quantized activation and its scales
    if BLOCK_SCALED:
        sw_row = sw_ptr + ((pid_n * BLOCK_N) // _SCALE_BLOCK).to(tl.int64) * stride_swn
        sx_rows = sx_ptr + offs_m.to(tl.int64) * stride_sxm
        # scales of K step kb are loaded one step ahead: the pipeliner does not prefetch these small
        # loads, and an HBM miss on them would otherwise stall every step after its MMA
        kb = k_lo // _SCALE_BLOCK
        sw_next = tl.load(sw_row + kb * stride_swk)
        sx_next = tl.load(sx_rows + kb * stride_sxk, mask=m_mask, other=0.0)  # padded rows: part is 0 there
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_SCALED:
            sw, sx = sw_next, sx_next
            kb = k0 // _SCALE_BLOCK + 1
            more = kb * _SCALE_BLOCK < k_hi
            sw_next = tl.load(sw_row + kb * stride_swk, mask=more, other=0.0)
            sx_next = tl.load(sx_rows + kb * stride_sxk, mask=m_mask & more, other=0.0)
            part = tl.dot(w, tl.trans(x), max_num_imprecise_acc=IMPRECISE_ACC)  # fresh 128-deep sum
            acc += part * (sw * sx)[None, :]  # scales meet first: part * sw alone can overflow
        else:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_ACC)
    pdl_launch_dependents(USE_PDL)
    out = tl.trans(acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        store_splitk_partial(ws_ptr, out, pid_k, offs_m, offs_n, M, N, mask)
        return
    if BLOCK_SCALED:
        out = epilogue(out, offs_n, n_mask, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, False)
    else:
        out = epilogue(out, offs_n, n_mask, sx_ptr, sw_ptr, bias_ptr, _ALPHA_SCALES, HAS_BIAS, False)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def _is_sm90(device) -> bool:
    if interpreting():
        return False
    cap = device_capability(device)
    return cap is not None and cap[0] == 9


def fp8_decode_applies(M: int, device) -> bool:
    """fp8_tensor's and fp8_block's GEMMs take this kernel for 1 <= M <= 16 on sm_90 (not under
    the interpreter)."""
    return 1 <= M <= 16 and _is_sm90(device)


def fp8_decode_config(M: int, N: int, K: int, n_sms: int = 132, *, bn: int = 64, bk: int = 128,
                      stages: int = 6, warps: int = 4, programs_per_sm: int = 1) -> TileConfig:
    """64 weight rows x 16 (padded) activation rows per program, 6 stages of 128-wide K; split-K
    until the grid covers every SM once (H200, N = K = 8192, M = 16: 16x64x128 s6 split 2 took
    21.8 us against 24.4 for s4 split 4 and 28.3 for the lesson's mma.sync tile; fp8_block 22.5
    against 24.2 / 30.2; docs/perf_notes.md)."""
    tiles = triton.cdiv(N, bn)
    split = 1
    while tiles * split < programs_per_sm * n_sms and triton.cdiv(K, bk) >= 8 * split:
        split *= 2
    return TileConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)


def hopper_config(M: int, N: int, K: int, device, *, block_scaled: bool = False) -> TileConfig | None:
    """The fp8 GEMM's tile on sm_90 where it differs from _e4m3_gemm.gemm_config (None elsewhere):
    the decode kernel's for M <= 16; for fp8_tensor (not ``block_scaled``) also 4 stages instead
    of 3 for the 128 x 128 x 128 prefill tile (H200, 8192^3: 1184 vs 1256 us)."""
    if not _is_sm90(device):
        return None
    if 1 <= M <= 16:
        return fp8_decode_config(M, N, K, sm_count(device))
    if M > 256 and not block_scaled:
        return TileConfig(128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4)
    return None


def launch_fp8_decode(x, w, sx, sw, bias, y, *, block_scaled: bool = False, imprecise_acc: int = 128,
                      config: TileConfig | None = None):
    """y [M, N] = x [M, K] e4m3 . w [N, K]^T e4m3, scaled, + bias, M <= 16, on a GPU; x and w
    K-contiguous.

    Per-tensor scales (fp8_tensor): sx, sw float32 0-d, y = (x . w^T) * sx * sw + bias.
    ``block_scaled`` (fp8_block): sx float32 [M, K/128], sw float32 [ceil(N/128), K/128], K a
    multiple of 128, y = sum_kb (x_kb . w_kb^T) * sx[:, kb] * sw[n // 128, kb] + bias.
    Raises ValueError for M > 16, or a block-scaled config whose BLOCK_K is not 128 or whose
    BLOCK_N does not divide 128.
    """
    M, K = x.shape
    N = w.shape[0]
    if M > 16:
        raise ValueError(f"M must be <= 16 for the decode kernel, got {M}")
    # the tile tile_config reports (hopper_config) is the tile launched
    cfg = config or hopper_config(M, N, K, y.device, block_scaled=block_scaled) or fp8_decode_config(M, N, K)
    if block_scaled and (cfg.BLOCK_K != 128 or 128 % cfg.BLOCK_N):
        raise ValueError(f"block-scaled FP8 needs BLOCK_K == 128 (one scale per K step) and BLOCK_N dividing 128, "
                         f"got BLOCK_K={cfg.BLOCK_K} BLOCK_N={cfg.BLOCK_N}")
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    s_strides = (*sx.stride(), *sw.stride()) if block_scaled else (0, 0, 0, 0)
    fp8_decode_gemm_kernel[(triton.cdiv(N, cfg.BLOCK_N), n_split)](
        x, w, sx, sw, bias if bias is not None else y, y, ws,
        M, N, K, k_per, x.stride(0), w.stride(0), y.stride(0), *s_strides,
        HAS_BIAS=bias is not None, IMPRECISE_ACC=min(imprecise_acc, cfg.BLOCK_K), BLOCK_SCALED=block_scaled,
        BLOCK_N=cfg.BLOCK_N, BLOCK_M=16, BLOCK_K=cfg.BLOCK_K, SPLIT_K=n_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(y.device),
    )
    if n_split > 1:
        if block_scaled:  # every scale was applied in the K loop
            launch_splitk_reduce(ws, y, bias=bias, alpha_mode=ALPHA_NONE)
        else:
            launch_splitk_reduce(ws, y, bias=bias, alpha_mode=ALPHA_SCALES, s1=sx, s2=sw)
    return y
