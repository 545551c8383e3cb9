"""Decode-sized per-tensor FP8 GEMM (M <= 16) on sm_90: the performance path of fp8_tensor.

The lesson kernel's 16-row tile is below wgmma's 64-row minimum, so at M <= 16 Triton lowers it to
mma.sync. Swapping the operands (acc[n, m] = sum_k W[n, k] * X[m, k], the weight on the MMA's
M side) gives wgmma m64n16k32 with both e4m3 operands K-major from shared memory, fed by the
pipelined loads. The wgmma accumulator is promoted to fp32 every IMPRECISE_ACC products, as in the
lesson kernel; split-K partials go through _twopass's ordered reduction, which applies
s_x * s_w and the bias once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import TileConfig, interpreting
from ._paths import device_capability, sm_count
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._twopass import ALPHA_SCALES, epilogue, launch_splitk_reduce, splitk_plan, splitk_workspace, store_splitk_partial

_ALPHA_SCALES = tl.constexpr(ALPHA_SCALES)


@triton.jit
def fp8_decode_gemm_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # _pdl
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    pdl_wait(USE_PDL)  # the quantized activation
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_ACC)
    pdl_launch_dependents(USE_PDL)
    out = tl.trans(acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        store_splitk_partial(ws_ptr, out, pid_k, offs_m, offs_n, M, N, mask)
        return
    out = epilogue(out, offs_n, n_mask, sx_ptr, sw_ptr, bias_ptr, _ALPHA_SCALES, HAS_BIAS, False)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def _is_sm90(device) -> bool:
    if interpreting():
        return False
    cap = device_capability(device)
    return cap is not None and cap[0] == 9


def fp8_decode_applies(M: int, device) -> bool:
    """fp8_tensor's GEMM takes this kernel for 1 <= M <= 16 on sm_90 (not under the interpreter)."""
    return 1 <= M <= 16 and _is_sm90(device)


def fp8_decode_config(M: int, N: int, K: int, n_sms: int = 132, *, bn: int = 64, bk: int = 128,
                      stages: int = 6, warps: int = 4, programs_per_sm: int = 1) -> TileConfig:
    """64 weight rows x 16 (padded) activation rows per program, 6 stages of 128-wide K; split-K
    until the grid covers every SM once (H200, N = K = 8192: 16x64x128 s6 split 2 took 21.8 us
    at M = 16 against 24.4 for s4 split 4 and 28.3 for the lesson's mma.sync tile; docs/perf_notes.md)."""
    tiles = triton.cdiv(N, bn)
    split = 1
    while tiles * split < programs_per_sm * n_sms and triton.cdiv(K, bk) >= 8 * split:
        split *= 2
    return TileConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)


def hopper_config(M: int, N: int, K: int, device) -> TileConfig | None:
    """fp8_tensor's tile on sm_90 where it differs from _e4m3_gemm.gemm_config (None elsewhere):
    the decode kernel's for M <= 16, and 4 stages instead of 3 for the 128 x 128 x 128 prefill
    tile (H200, 8192^3: 1184 vs 1256 us)."""
    if not _is_sm90(device):
        return None
    if 1 <= M <= 16:
        return fp8_decode_config(M, N, K, sm_count(device))
    if M > 256:
        return TileConfig(128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4)
    return None


def launch_fp8_decode(x, w, sx, sw, bias, y, *, imprecise_acc: int = 128, config: TileConfig | None = None):
    """y [M, N] = (x [M, K] e4m3 . w [N, K]^T e4m3) * sx * sw + bias, M <= 16, on a GPU."""
    M, K = x.shape
    N = w.shape[0]
    if M > 16:
        raise ValueError(f"M must be <= 16 for the decode kernel, got {M}")
    cfg = config or fp8_decode_config(M, N, K, sm_count(y.device))
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    fp8_decode_gemm_kernel[(triton.cdiv(N, cfg.BLOCK_N), n_split)](
        x, w, sx, sw, bias if bias is not None else y, y, ws,
        M, N, K, k_per, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IMPRECISE_ACC=min(imprecise_acc, cfg.BLOCK_K),
        BLOCK_N=cfg.BLOCK_N, BLOCK_M=16, BLOCK_K=cfg.BLOCK_K, SPLIT_K=n_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(y.device),
    )
    if n_split > 1:
        launch_splitk_reduce(ws, y, bias=bias, alpha_mode=ALPHA_SCALES, s1=sx, s2=sw)
    return y
