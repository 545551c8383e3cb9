"""Decode-sized FP8 GEMM (M <= 16) on sm_90: the performance path of fp8_tensor, fp8_block, mxfp8
and fp8_channel.

The lesson kernels' 16-row tile is below wgmma's 64-row minimum, so at M <= 16 Triton lowers them
to mma.sync. Swapping the operands (acc[n, m] = sum_k W[n, k] * X[m, k], the weight on the MMA's
M side) gives wgmma m64n16k32 with both e4m3 operands K-major from shared memory, fed by the
pipelined loads. Split-K partials go through _twopass's ordered reduction.

Three scale encodings share the kernel body (SCALE_K, constexpr: the K extent of one scale):
    per-tensor (fp8_tensor,   acc = dot(w, x^T, acc), the wgmma accumulator promoted to fp32 every
    SCALE_K = 0)              IMPRECISE_ACC products as in the lesson kernel; s_x * s_w and the
                              bias applied once, in the epilogue or the split-K reduction.
    block (fp8_block,         one 128-deep K step is one scale block: part = dot(w, x^T) into a
    SCALE_K = 128)            fresh accumulator, then acc += part * (sw[n // 128, kb] * sx[m, kb]),
                              i.e. fp32 promotion per 128-K interval as fp8_block's lesson kernel.
    MX (mxfp8, SCALE_K = 32)  the same per 32-K scale block: each K step issues BLOCK_K / 32 dots of
                              32-deep [BLOCK_N, 32] / [16, 32] tiles, each into a fresh accumulator
                              scaled by 2^ew[n, kb] * 2^ex[m, kb] (E8M0, decoded exactly by
                              _e8m0_byte: 0x00 -> 2^-127, 0xFF -> NaN). Products of e4m3 codes are exact,
                              a power-of-two scale is exact, so what rounds is the fp8 wgmma's sum
                              inside one 32-deep partial and the fp32 accumulation: the lesson's
                              bf16 decode rounds only the latter.
fp8_channel (CHANNEL, with SCALE_K = 0) runs the per-tensor K loop; its epilogue multiplies the
accumulator by sx[m] * sw[n] (_channel_scales), before split-K's store when the K range is split.
The scales meet first (sw * sx), then multiply the partial: part * sx alone overflows where the
result does not (a 3e38 activation times a small weight). For scales our quantizers make, sw * sx
overflows only when the two blocks' largest magnitudes multiply past 2^143, i.e. beyond fp32
unless they sit at different k.
Block and MX partials are already scaled, so the split-K reduction adds the bias only.

Under the interpreter (tests on the CPU; gemm never picks this kernel there) DOT_FP8 is False: the
codes arrive as uint8 and are decoded to fp32 with _codecs.dequantize_e4m3 before each dot, as in the
lesson kernels (the interpreter's fp8 dot reads the NaN codes as +-480).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._codecs import dequantize_e4m3
from .._common import launch, interpreting
from ._route import TileConfig, e4m3_operand, sm_count
from ._fp8_prefill import prefill_config
from . import is_sm90
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._twopass import (ALPHA_NONE, ALPHA_SCALES, NO_ALPHA, epilogue, launch_splitk_reduce, splitk_plan,
                       splitk_workspace, store_splitk_partial, swapped_tile)
TENSOR_SCALE, FP8_BLOCK_SCALE, MX_SCALE = 0, 128, 32  # SCALE_K of fp8_tensor, fp8_block, mxfp8
_ALPHA_SCALES = tl.constexpr(ALPHA_SCALES)
_FP8_BLOCK = tl.constexpr(FP8_BLOCK_SCALE)  # fp8_block: 1x128 activation groups, 128x128 weight blocks
_MX = tl.constexpr(MX_SCALE)
SCALE_KINDS = (TENSOR_SCALE, FP8_BLOCK_SCALE, MX_SCALE)


@triton.jit
def _load_scales(sw_rows, sx_rows, kb, stride_swk, stride_sxk, n_mask, m_mask):
    """The scales of K step kb: fp8_block one fp32 sw (the tile's weight block) and sx [BLOCK_M];
    mxfp8 the E8M0 bytes of the step's BLOCK_K / 32 blocks, packed into one integer per row (the
    host views the uint8 scales as an integer BLOCK_K / 32 bytes wide), sw [BLOCK_N], sx [BLOCK_M].
    Masked rows get 0 (fp32 0, or E8M0 2^-127): their partials are 0 or never stored."""
    sw = tl.load(sw_rows + kb * stride_swk, mask=n_mask, other=0)
    sx = tl.load(sx_rows + kb * stride_sxk, mask=m_mask, other=0)
    return sw, sx


@triton.jit
def _load_codes(ptr, rows, row_ok, stride, offs_k, K, MASK_K: tl.constexpr, DOT_FP8: tl.constexpr):
    """e4m3 codes [rows, offs_k] of a K-contiguous matrix, 0 where masked (rows outside row_ok;
    with MASK_K also k >= K); not DOT_FP8 (the interpreter): uint8 codes decoded to fp32."""
    mask = row_ok[:, None]
    if MASK_K:
        mask = mask & (offs_k < K)[None, :]
    t = tl.load(ptr + rows.to(tl.int64)[:, None] * stride + offs_k[None, :], mask=mask, other=0.0)
    if not DOT_FP8:
        t = dequantize_e4m3(t)
    return t


@triton.jit
def _e8m0_byte(word, j: tl.constexpr):
    """E8M0 byte j of packed bytes -> 2^(b - 127) float32 (0x00 -> 2^-127, 0xFF -> NaN), as
    _codecs.dequantize_e8m0 but in fewer instructions (it runs per scale block): the byte goes straight
    into fp32's exponent field. Bytes >= 1 give patterns >= 0x00800000 (2^-126), above 2^-127's
    subnormal pattern 0x00400000, so a max turns only byte 0's zero into 2^-127; 0xFF lands on
    Inf's pattern, which becomes NaN."""
    bits = tl.maximum(((word.to(tl.int32) >> (8 * j)) & 0xFF) << 23, 0x00400000)
    return tl.where(bits == 0x7F800000, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _scale_of_block(sw, sx, j: tl.constexpr, SCALE_K: tl.constexpr):
    """sw * sx of 32-block j of the step ([BLOCK_N, BLOCK_M]); fp8_block: its one block."""
    if SCALE_K == _MX:  # byte j of the packed E8M0 bytes (little-endian)
        s = _e8m0_byte(sw, j)[:, None] * _e8m0_byte(sx, j)[None, :]
    else:
        s = (sw * sx)[None, :]
    return s


@triton.jit
def _channel_scales(sx_ptr, sw_ptr, offs_m, m_ok, offs_n, n_ok):
    """fp8_channel's sx[offs_m] x sw[offs_n] [BLOCK_M, BLOCK_N] (the token scales down the rows, the
    channel scales across): the scales meet first, acc * sx alone can overflow where y does not.
    Masked rows and columns get 0; they are never stored."""
    sx = tl.load(sx_ptr + offs_m, mask=m_ok, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=0.0)
    return sx[:, None] * sw[None, :]


@triton.jit
def fp8_decode_gemm_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
    # SCALE_K > 0 only: fp8_block sx [M, K/128], sw [N/128, K/128] fp32; mxfp8 sx [M, K/BLOCK_K],
    # sw [N, K/BLOCK_K] of BLOCK_K/32-byte integers (the E8M0 bytes of one K step)
    stride_sxm, stride_sxk, stride_swn, stride_swk,
    HAS_BIAS: tl.constexpr, IMPRECISE_ACC: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_FP8: tl.constexpr = True,  # False under the interpreter: uint8 codes, decoded to fp32
    ROUND_BF16: tl.constexpr = False,  # the interpreter's fp32 -> bf16 cast truncates: round first
    USE_PDL: tl.constexpr = False,  # _pdl
    CHANNEL: tl.constexpr = False,  # fp8_channel (SCALE_K 0): sx float32 [M], sw float32 [N]
):
    # literals, not the constexpr globals, beside %: the interpreter has no int % constexpr
    if SCALE_K == _FP8_BLOCK:
        tl.static_assert(BLOCK_K == _FP8_BLOCK, "block FP8 needs BLOCK_K == 128: one scale per K step")
        # a tile's weight rows then lie in one 128-row scale block: one scalar sw per K step
        tl.static_assert(128 % BLOCK_N == 0, "block FP8 needs BLOCK_N to divide 128")
    if SCALE_K == _MX:
        tl.static_assert(BLOCK_K % 32 == 0 and BLOCK_K <= 128, "MX needs BLOCK_K in 32, 64, 128")
    offs_n, offs_m, n_mask, m_mask, k_lo, k_hi = swapped_tile(N, M, K, K_PER, BLOCK_N, BLOCK_M)
    pdl_wait(USE_PDL)  # the quantized activation and its scales
    if SCALE_K > 0:
        if SCALE_K == _MX:
            sw_rows = sw_ptr + offs_n.to(tl.int64) * stride_swn
            sw_mask = n_mask
        else:
            sw_rows = sw_ptr + ((tl.program_id(0) * BLOCK_N) // _FP8_BLOCK).to(tl.int64) * stride_swn
            sw_mask = True
        sx_rows = sx_ptr + offs_m.to(tl.int64) * stride_sxm
        # scales of K step kb are loaded one step ahead: the pipeliner does not prefetch these small
        # loads, and an HBM miss on them would otherwise stall every step after its MMA
        sw_next, sx_next = _load_scales(sw_rows, sx_rows, k_lo // BLOCK_K, stride_swk, stride_sxk, sw_mask, m_mask)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SCALE_K == 0:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = _load_codes(w_ptr, offs_n, n_mask, stride_wn, offs_k, K, True, DOT_FP8)
            x = _load_codes(x_ptr, offs_m, m_mask, stride_xm, offs_k, K, True, DOT_FP8)
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            sw, sx = sw_next, sx_next
            kb = k0 // BLOCK_K + 1
            # the next step's scales only inside this split. tl.where folds away on the GPU; the
            # interpreter splats a bare scalar comparison to int32, which tl.load refuses as a mask
            more = tl.where(kb * BLOCK_K < k_hi, True, False)
            sw_next, sx_next = _load_scales(sw_rows, sx_rows, kb, stride_swk, stride_sxk, sw_mask & more,
                                            m_mask & more)
            # one [BLOCK_N, SCALE_K] / [BLOCK_M, SCALE_K] load pair per scale block, each its own
            # pipelined shared-memory tile, so every dot is a wgmma straight from shared memory
            # (no K mask: BLOCK_K divides K here)
            for j in tl.static_range(BLOCK_K // SCALE_K):
                offs_k = k0 + j * SCALE_K + tl.arange(0, SCALE_K)
                w = _load_codes(w_ptr, offs_n, n_mask, stride_wn, offs_k, K, False, DOT_FP8)
                x = _load_codes(x_ptr, offs_m, m_mask, stride_xm, offs_k, K, False, DOT_FP8)
                part = tl.dot(w, tl.trans(x), max_num_imprecise_acc=IMPRECISE_ACC)  # a fresh sum
                acc += part * _scale_of_block(sw, sx, j, SCALE_K)
    pdl_launch_dependents(USE_PDL)
    out = tl.trans(acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if CHANNEL:  # before split-K's store: the partials arrive scaled and the reduction adds the bias only
        out = out * _channel_scales(sx_ptr, sw_ptr, offs_m, m_mask, offs_n, n_mask)
    if SPLIT_K > 1:
        store_splitk_partial(ws_ptr, out, tl.program_id(1), offs_m, offs_n, M, N, mask)
        return
    if CHANNEL:
        out = epilogue(out, offs_n, n_mask, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, ROUND_BF16)
    elif SCALE_K > 0:
        out = epilogue(out, offs_n, n_mask, bias_ptr, bias_ptr, bias_ptr, NO_ALPHA, HAS_BIAS, ROUND_BF16)
    else:
        out = epilogue(out, offs_n, n_mask, sx_ptr, sw_ptr, bias_ptr, _ALPHA_SCALES, HAS_BIAS, ROUND_BF16)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_decode_applies(M: int, device) -> bool:
    """fp8_tensor's, fp8_block's and mxfp8's GEMMs take this kernel for 1 <= M <= 16 on sm_90 (not
    under the interpreter)."""
    return 1 <= M <= 16 and is_sm90(device)


def fp8_decode_config(M: int, N: int, K: int, n_sms: int = 132, *, bn: int = 64, bk: int = 128,
                      stages: int = 6, warps: int = 4, programs_per_sm: float = 1) -> TileConfig:
    """64 weight rows x 16 (padded) activation rows per program, 6 stages of 128-wide K; split-K
    until the grid covers every SM once: deep pipelines and enough programs keep the weight bytes
    in flight (the fp8_tensor and fp8_block measurements: docs/perf_notes.md)."""
    tiles = triton.cdiv(N, bn)
    split = 1
    while tiles * split < programs_per_sm * n_sms and triton.cdiv(K, bk) >= 8 * split:
        split *= 2
    return TileConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)


# fp8_tensor's decode tile: per-tensor scales leave the wgmma chain unbroken, so one program per
# 64-row tile with 8 stages keeps enough bytes in flight once the tiles fill half the SMs, and the
# split-K reduction's launch is saved (docs/perf_notes.md)
TENSOR_DECODE_TILE = dict(stages=8, programs_per_sm=0.5)

# mxfp8's decode tile (fp8_decode_config's knobs): 128 weight rows (fewer loop instructions per
# weight byte than 64), 4 stages, split-K to one program per SM (docs/perf_notes.md)
MX_DECODE_TILE = dict(bn=128, stages=4)


def check_scale_k(scale_k) -> None:
    """ValueError unless scale_k is one of SCALE_KINDS (TENSOR_SCALE 0, FP8_BLOCK_SCALE 128, MX_SCALE 32)."""
    if scale_k not in SCALE_KINDS:
        raise ValueError(f"scale_k must be one of {SCALE_KINDS} (fp8_tensor, fp8_block, mxfp8), got {scale_k!r}")


def mx_block_k(K: int) -> int:
    """The widest K step (128, 64, 32) dividing K: one step's E8M0 bytes are read as one integer.
    Raises ValueError unless K is a positive multiple of 32 (mxfp8's K rule)."""
    if K <= 0 or K % MX_SCALE:
        raise ValueError(f"mxfp8 needs K to be a positive multiple of {MX_SCALE}, got K={K}")
    return next(bk for bk in (128, 64, MX_SCALE) if K % bk == 0)


def decode_config(M: int, N: int, K: int, scale_k: int = TENSOR_SCALE, n_sms: int = 132) -> TileConfig:
    """The decode kernel's tile for scale kind ``scale_k`` (as in launch_fp8_decode) on ``n_sms`` SMs."""
    check_scale_k(scale_k)
    if scale_k == MX_SCALE:
        return fp8_decode_config(M, N, K, n_sms, bk=mx_block_k(K), **MX_DECODE_TILE)
    if scale_k == TENSOR_SCALE:
        return fp8_decode_config(M, N, K, n_sms, **TENSOR_DECODE_TILE)
    return fp8_decode_config(M, N, K, n_sms)


def hopper_config(M: int, N: int, K: int, device, *, scale_k: int = TENSOR_SCALE) -> TileConfig | None:
    """The fp8 GEMM's tile on sm_90 where it differs from _tiles.e4m3_config (None elsewhere):
    the decode kernel's for M <= 16 (decode_config); for M > 256 with fp8_tensor or fp8_block
    scales the TMA prefill kernel's (_fp8_prefill.prefill_config, K a multiple of 16; an operand
    whose base is misaligned for TMA runs this tile on the lesson kernel), and for fp8_tensor with
    another K 4 stages instead of 3 for the 128 x 128 x 128 tile (docs/perf_notes.md).
    Raises ValueError for a bad scale_k (check_scale_k) and, at M <= 16 with MX scales, K not a
    positive multiple of 32."""
    check_scale_k(scale_k)
    if not is_sm90(device):
        return None
    if 1 <= M <= 16:
        return decode_config(M, N, K, scale_k, sm_count(device))
    if M > 256 and scale_k in (TENSOR_SCALE, FP8_BLOCK_SCALE):
        cfg = prefill_config(M, N, K, device, scale_k=scale_k)
        if cfg is not None:
            return cfg
    if M > 256 and scale_k == TENSOR_SCALE:
        return TileConfig(128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4)
    return None


_MX_WORD = {32: torch.uint8, 64: torch.int16, 128: torch.int32}  # one K step's E8M0 bytes


def launch_fp8_decode(x, w, sx, sw, bias, y, *, scale_k: int = TENSOR_SCALE, imprecise_acc: int = 128,
                      config: TileConfig | None = None, channel: bool = False):
    """y = x . w^T, scaled, + bias, for M <= 16 rows: the swapped wgmma kernel (sm_90; any GPU
    compiles it, and the interpreter runs it with the codes decoded to fp32).

    Args:
        x: torch.float8_e4m3fn [M, K] e4m3 codes, M <= 16, K-contiguous (stride(1) == 1).
        w: torch.float8_e4m3fn [N, K] e4m3 codes, K-contiguous.
        sx, sw: the scales, by ``scale_k``:
            TENSOR_SCALE (0, fp8_tensor): float32, one element each (0-d or [1]);
                y = (x . w^T) * sx * sw + bias.
            TENSOR_SCALE with channel=True (fp8_channel): float32 sx [M] (per token), sw [N] (per
                output channel), contiguous; y = (x . w^T) * (sx[m] * sw[n]) + bias.
            FP8_BLOCK_SCALE (128, fp8_block): float32 sx [M, K/128] (1x128 groups), sw
                [ceil(N/128), K/128] (128x128 blocks), K a multiple of 128;
                y = sum_kb (x_kb . w_kb^T) * sx[:, kb] * sw[n // 128, kb] + bias.
            MX_SCALE (32, mxfp8): uint8 E8M0 sx [M, K/32], sw [N, K/32] (linear layout), K a
                multiple of 32; y = sum_kb (x_kb . w_kb^T) * 2^(sx[:, kb] - 127) * 2^(sw[n, kb] - 127)
                + bias (OCP MX 1.0: byte 0x00 is 2^-127, 0xFF NaN).
        bias: None or a contiguous float32 / bf16 / fp16 [N] (kernel_bias's), added in fp32.
        y: the output, bfloat16 / float16 / float32 [M, N], row stride y.stride(0) and unit column
            stride; written and returned.
        scale_k: TENSOR_SCALE, FP8_BLOCK_SCALE or MX_SCALE (above).
        channel: fp8_channel's row x column scales (scale_k must be TENSOR_SCALE); a split-K
            partial is scaled before its store, so the reduction adds the bias only.
        imprecise_acc: Hopper's fp8 wgmma promotion interval (max_num_imprecise_acc), capped at the
            scale block (or BLOCK_K for per-tensor scales).
        config: the tile (fp8_decode_config's fields); None: hopper_config's on sm_90, else
            decode_config's for 132 SMs.
    Returns:
        y.
    Raises:
        ValueError: scale_k not in (0, 128, 32); channel with scale_k != 0; M > 16; a block-scaled config whose BLOCK_K is
            not 128 or whose BLOCK_N does not divide 128; an MX config whose BLOCK_K is not 32, 64 or
            128; (block and MX scales, whose K loop has no K mask) a BLOCK_K that does not divide K;
            with MX scales and no config, K not a positive multiple of 32.
    """
    check_scale_k(scale_k)
    if channel and scale_k != TENSOR_SCALE:
        raise ValueError(f"channel=True (fp8_channel's row and column scales) needs scale_k={TENSOR_SCALE}, got {scale_k!r}")
    M, K = x.shape
    N = w.shape[0]
    if M > 16:
        raise ValueError(f"M must be <= 16 for the decode kernel, got {M}")
    # the tile tile_config reports (hopper_config) is the tile launched
    cfg = config or hopper_config(M, N, K, y.device, scale_k=scale_k) or decode_config(M, N, K, scale_k)
    if scale_k == FP8_BLOCK_SCALE and (cfg.BLOCK_K != 128 or 128 % cfg.BLOCK_N):
        raise ValueError(f"block-scaled FP8 needs BLOCK_K == 128 (one scale per K step) and BLOCK_N dividing 128, "
                         f"got BLOCK_K={cfg.BLOCK_K} BLOCK_N={cfg.BLOCK_N}")
    if scale_k == MX_SCALE and cfg.BLOCK_K not in _MX_WORD:
        raise ValueError(f"MX FP8 needs BLOCK_K in (32, 64, 128), got BLOCK_K={cfg.BLOCK_K}")
    if scale_k and K % cfg.BLOCK_K:
        raise ValueError(f"block-scaled FP8 needs BLOCK_K dividing K (no K mask), got BLOCK_K={cfg.BLOCK_K} K={K}")
    if scale_k == MX_SCALE:
        sx, sw = (s.contiguous().view(_MX_WORD[cfg.BLOCK_K]) for s in (sx, sw))
    dot_fp8 = not interpreting()
    x, w = e4m3_operand(x, dot_fp8), e4m3_operand(w, dot_fp8)
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, y.device) if n_split > 1 else y
    s_strides = (*sx.stride(), *sw.stride()) if scale_k else (0, 0, 0, 0)
    launch(fp8_decode_gemm_kernel, (triton.cdiv(N, cfg.BLOCK_N), n_split),
        x, w, sx, sw, bias if bias is not None else y, y, ws,
        M, N, K, k_per, x.stride(0), w.stride(0), y.stride(0), *s_strides,
        HAS_BIAS=bias is not None, IMPRECISE_ACC=min(imprecise_acc, scale_k or cfg.BLOCK_K), SCALE_K=scale_k,
        BLOCK_N=cfg.BLOCK_N, BLOCK_M=16, BLOCK_K=cfg.BLOCK_K, SPLIT_K=n_split, DOT_FP8=dot_fp8,
        ROUND_BF16=not dot_fp8 and y.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(y.device),
        **({"CHANNEL": True} if channel else {}),  # fp8_tensor's launch (and compile key) as before
    )
    if n_split > 1:
        if scale_k or channel:  # every scale was applied in the K loop
            launch_splitk_reduce(ws, y, bias=bias, alpha_mode=ALPHA_NONE)
        else:
            launch_splitk_reduce(ws, y, bias=bias, alpha_mode=ALPHA_SCALES, s1=sx, s2=sw)
    return y
