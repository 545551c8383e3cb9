"""Prefill-sized FP8 GEMM (M > 256) on sm_90: the performance path of fp8_tensor, fp8_block and
fp8_channel.

The same sums as the lesson kernels (fp8_tensor._gemm_kernel, fp8_block._gemm_kernel), with the
operand tiles fetched by TMA (host-side tensor descriptors, ``triton.tools.tensor_descriptor``)
instead of pointer loads, at 4 warps (one warpgroup), with 96 KB or less of shared memory:

    per-tensor (fp8_tensor,   acc = dot(x, w^T, acc), the wgmma accumulator promoted into fp32
    SCALE_K = 0)              every IMPRECISE_ACC (128) products; sx * sw and the bias once, in
                              the epilogue.
    block (fp8_block,         part = dot(x_kb, w_kb^T) into a fresh accumulator per 128-K step,
    SCALE_K = 128)            then acc += part * (sx[m, kb] * sw[n // 128, kb]): fp32 promotion
                              per scale block, as the lesson kernel. BLOCK_N divides 128, so a
                              tile's weight rows share one scale per step (a scalar).

fp8_channel (CHANNEL, with SCALE_K = 0) runs fp8_tensor's loop and tile; its epilogue multiplies
the accumulator by sx[m] * sw[n] (per token x per output channel) in place of sx * sw.

Why this shape: the fp32 promotion serializes each step's wgmma and its FMAs inside one
warpgroup. A 4-warp CTA with 3 stages of 32 KB (fp8_tensor's 128 x 128 tile) or 4 of 24 KB
(fp8_block's 64 x 128) uses ~96 KB of shared memory, so two CTAs share an SM (228 KB) and one's
promotion overlaps the other's MMAs (faster than the pointer kernels on the H200 for both formats:
docs/perf_notes.md).
Triton's warp_specialize would be the other way, but it gives wrong sums on this loop in 3.6.
The kernel does not take part in programmatic dependent launch (_pdl): at these sizes a launch gap
is a fraction of a percent, and it runs in plain stream order.

TMA reads outside the tensor as zeros, so M, N and K tails need no load masks (the K tail of
fp8_tensor meets zeros in both operands); stores stay masked. TMA needs a 16-byte aligned base
and row stride and unit column stride: ``tma_ok`` checks them, and the callers fall back to the
lesson kernel where they fail (e.g. fp8_tensor with K not a multiple of 16).

Under the interpreter (tests on the CPU; gemm never picks this kernel there) DOT_FP8 is False:
the descriptors hold uint8 codes, decoded to fp32 with _codecs.dequantize_e4m3 before each dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from formats.constants import FP8_BLOCK

from .._codecs import dequantize_e4m3, grouped_tile
from .._common import launch, interpreting
from ._route import TileConfig
from . import is_sm90
from ._twopass import ALPHA_SCALES, NO_ALPHA, epilogue

PREFILL_MIN_M = 257  # M above the medium tiles of gemm_config (M <= 256)
_BLOCK = tl.constexpr(FP8_BLOCK)
_ALPHA_SCALES = tl.constexpr(ALPHA_SCALES)
SCALE_KS = (0, FP8_BLOCK)  # SCALE_K of fp8_tensor (per-tensor) and fp8_block (128-wide blocks)

# The launched tiles, the fastest of the H200 probe (docs/perf_notes.md): fp8_tensor at 4
# stages or 8 warps no longer fits two CTAs per SM. fp8_block: a 128 x 128 tile holds the
# accumulator and the fresh partial, 2 x 128 fp32 registers per thread at 4 warps, and spills;
# 64 x 128 at 4 stages (96 KB, two CTAs per SM) beat 3 stages (74 KB, where three fit).
TENSOR_PREFILL_TILE = TileConfig(128, 128, 128, GROUP_M=8, num_warps=4, num_stages=3)
BLOCK_PREFILL_TILE = TileConfig(64, 128, 128, GROUP_M=8, num_warps=4, num_stages=4)


@triton.jit
def fp8_prefill_kernel(
    x_desc, w_desc,  # TMA descriptors: x [M, K] in [BLOCK_M, BLOCK_K] boxes, w [N, K] in [BLOCK_N, BLOCK_K]
    sx_ptr, sw_ptr,  # SCALE_K 0: float32 [1] each; 128: sx [M, K/128], sw [ceil(N/128), K/128]
    bias_ptr, y_ptr,
    M, N, K, stride_ym, stride_sxm, stride_sxk, stride_swn, stride_swk,
    HAS_BIAS: tl.constexpr, SCALE_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP8: tl.constexpr = True,  # False under the interpreter: uint8 codes, decoded to fp32
    ROUND_BF16: tl.constexpr = False,  # the interpreter's fp32 -> bf16 cast truncates: round first
    CHANNEL: tl.constexpr = False,  # fp8_channel (SCALE_K 0): sx float32 [M], sw float32 [N]
):
    if SCALE_K == _BLOCK:
        tl.static_assert(BLOCK_K == _BLOCK, "block FP8 needs BLOCK_K == 128: one scale per K step")
        tl.static_assert(128 % BLOCK_N == 0, "block FP8 needs BLOCK_N to divide 128")
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    om = pid_m * BLOCK_M
    on = pid_n * BLOCK_N
    offs_m = om + tl.arange(0, BLOCK_M)
    offs_n = on + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if SCALE_K == _BLOCK:
        sx_rows = sx_ptr + offs_m.to(tl.int64) * stride_sxm
        sw_row = sw_ptr + (on // _BLOCK).to(tl.int64) * stride_swn
        last = K // BLOCK_K - 1
        # each step's scales are loaded one step ahead: the pipeliner does not prefetch these
        # small loads, and a miss would stall the FMAs after every wgmma
        sx_next = tl.load(sx_rows, mask=m_ok, other=0.0)
        sw_next = tl.load(sw_row)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([om, k0])
        b = w_desc.load([on, k0])
        if not DOT_FP8:
            a = dequantize_e4m3(a)
            b = dequantize_e4m3(b)
        if SCALE_K == 0:
            if DOT_FP8:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=IMPRECISE_ACC)
            else:
                acc = tl.dot(a, b.T, acc)
        else:
            sx, sw = sx_next, sw_next
            kn = tl.minimum(k0 // BLOCK_K + 1, last)  # in bounds: the last step reloads its own
            sx_next = tl.load(sx_rows + kn * stride_sxk, mask=m_ok, other=0.0)
            sw_next = tl.load(sw_row + kn * stride_swk)
            if DOT_FP8:
                part = tl.dot(a, b.T, max_num_imprecise_acc=IMPRECISE_ACC)  # a fresh 128-deep sum
            else:
                part = tl.dot(a, b.T)
            acc += part * (sx * sw)[:, None]  # the scales meet first: part * sx alone can overflow
    if CHANNEL:  # the token scales down the rows, the channel scales across; they meet first
        sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
        y = epilogue(acc * (sx[:, None] * sw[None, :]), offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA,
                     HAS_BIAS, ROUND_BF16)
    elif SCALE_K == 0:
        y = epilogue(acc, offs_n, n_ok, sx_ptr, sw_ptr, bias_ptr, _ALPHA_SCALES, HAS_BIAS, ROUND_BF16)
    else:
        y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, ROUND_BF16)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor can back a TMA descriptor: unit column stride, 16-byte aligned base and
    row stride (a [rows, K] e4m3 matrix: K, or the view's row stride, a multiple of 16)."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def prefill_config(M: int, N: int, K: int, device, *, scale_k: int = 0) -> TileConfig | None:
    """The prefill tile on sm_90 (TENSOR_PREFILL_TILE / BLOCK_PREFILL_TILE) for M > 256 and K a
    multiple of 16 (TMA's row-stride rule for a contiguous e4m3 [M, K]); None elsewhere."""
    if M >= PREFILL_MIN_M and K % 16 == 0 and is_sm90(device):
        return BLOCK_PREFILL_TILE if scale_k == FP8_BLOCK else TENSOR_PREFILL_TILE
    return None


def fp8_prefill_applies(x: torch.Tensor, w: torch.Tensor, device) -> bool:
    """fp8_tensor's and fp8_block's GEMMs take this kernel on sm_90 for M > 256 when both e4m3
    operands suit TMA (tma_ok) and prefill_config has its tile (K a multiple of 16: a padded-row
    view can pass tma_ok with another K, and would otherwise run a tile never measured here); not
    under the interpreter."""
    return (prefill_config(x.shape[0], w.shape[0], x.shape[1], device) is not None
            and tma_ok(x) and tma_ok(w))


def launch_fp8_prefill(x, w, sx, sw, bias, y, *, scale_k: int = 0, config: TileConfig | None = None,
                       imprecise_acc: int = 128, channel: bool = False):
    """y = x . w^T, scaled, + bias: the TMA-descriptor kernel (sm_90; the interpreter runs it with
    the codes decoded to fp32).

    Args:
        x: torch.float8_e4m3fn [M, K] e4m3 codes, tma_ok (unit column stride, 16-byte aligned
            base and row stride).
        w: torch.float8_e4m3fn [N, K] e4m3 codes, tma_ok.
        sx, sw: the scales, by ``scale_k``:
            0 (fp8_tensor): float32, one element each; y = (x . w^T) * (sx * sw) + bias.
            0 with channel=True (fp8_channel): float32 sx [M] (per token), sw [N] (per output
                channel), contiguous; y = (x . w^T) * (sx[m] * sw[n]) + bias.
            128 (fp8_block): float32 sx [M, K/128] (1x128 groups), sw [ceil(N/128), K/128]
                (128x128 blocks), K a multiple of 128;
                y = sum_kb (x_kb . w_kb^T) * (sx[:, kb] * sw[n // 128, kb]) + bias.
        bias: None or a contiguous float32 / bf16 / fp16 [N] (kernel_bias's), added in fp32.
        y: the output, bfloat16 / float16 / float32 [M, N] with unit column stride; written and
            returned.
        scale_k: 0 or 128 (above).
        channel: fp8_channel's row x column scales (scale_k must be 0).
        config: the tile; None: TENSOR_PREFILL_TILE / BLOCK_PREFILL_TILE. No split-K.
        imprecise_acc: Hopper's fp8 wgmma promotion interval (max_num_imprecise_acc), capped at
            BLOCK_K.
    Returns:
        y.
    Raises:
        ValueError: scale_k not 0 or 128; channel with scale_k 128; an operand that fails tma_ok; a split-K config; for
            block scales, K not a multiple of 128, BLOCK_K not 128 or BLOCK_N not dividing 128.
    Follows the lesson kernels' sums: per-tensor FP8 with fp32 promotion every 128 products, and
    block FP8 as DeepSeek-V3 / vLLM define it (1x128 activation groups, 128x128 weight blocks).
    """
    if scale_k not in SCALE_KS:
        raise ValueError(f"scale_k must be one of {SCALE_KS} (fp8_tensor, fp8_block), got {scale_k!r}")
    if channel and scale_k:
        raise ValueError(f"channel=True (fp8_channel's row and column scales) needs scale_k=0, got {scale_k!r}")
    for name, t in (("x", x), ("w", w)):
        if not tma_ok(t):
            raise ValueError(f"{name} must be 2-D with unit column stride and a 16-byte aligned base and row "
                             f"stride for TMA, got shape {tuple(t.shape)} stride {t.stride()} "
                             f"base % 16 = {t.data_ptr() % 16}")
    M, K = x.shape
    N = w.shape[0]
    cfg = config or (BLOCK_PREFILL_TILE if scale_k else TENSOR_PREFILL_TILE)
    if cfg.SPLIT_K != 1:
        raise ValueError(f"the prefill kernel has no split-K, got SPLIT_K={cfg.SPLIT_K}")
    if scale_k and (K % FP8_BLOCK or cfg.BLOCK_K != FP8_BLOCK or FP8_BLOCK % cfg.BLOCK_N):
        raise ValueError(f"block-scaled FP8 needs K a multiple of 128, BLOCK_K == 128 and BLOCK_N dividing 128, "
                         f"got K={K} BLOCK_K={cfg.BLOCK_K} BLOCK_N={cfg.BLOCK_N}")
    dot_fp8 = not interpreting()
    if not dot_fp8:
        x, w = x.view(torch.uint8), w.view(torch.uint8)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.BLOCK_M, cfg.BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.BLOCK_N, cfg.BLOCK_K])
    s_strides = (*sx.stride(), *sw.stride()) if scale_k else (0, 0, 0, 0)
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),)
    launch(fp8_prefill_kernel, grid,
        x_desc, w_desc, sx, sw, bias if bias is not None else y, y,
        M, N, K, y.stride(0), *s_strides,
        HAS_BIAS=bias is not None, SCALE_K=scale_k, IMPRECISE_ACC=min(imprecise_acc, cfg.BLOCK_K),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        DOT_FP8=dot_fp8, ROUND_BF16=not dot_fp8 and y.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"CHANNEL": True} if channel else {}),  # fp8_tensor's launch (and compile key) as before
    )
    return y
