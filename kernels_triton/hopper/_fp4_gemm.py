"""The sm_90 FP4 GEMMs above the decode sizes (M > 16), shared by hopper.nvfp4 and hopper.mxfp4
(W4A4 and W4A16): the fused kernel (dequantize in registers, then a plain tl.dot, with split-K and PDL)
for M <= PREPASS_MIN_M, and above it the pre-pass (each operand dequantized once into bf16) and a
bf16 GEMM. The readable form of the fused kernel is the lessons' portable GEMM
(kernels_triton.nvfp4 / mxfp4); this one adds split-K, PDL and the sm_90 tile table.

Both formats store e2m1 codes packed two per byte along K (uint8 [rows, K/2], element 2i in the low
nibble) with one scale per GROUP elements along K (nvfp4: GROUP = 16, e4m3 scale bytes; mxfp4:
GROUP = 32, E8M0 bytes). The kernel computes

    acc[m, n] = sum_k  (e2m1(a[m, k]) * scale_a[m, k // GROUP]) * (e2m1(w[n, k]) * scale_w[n, k // GROUP])
    y[m, n]   = acc[m, n] * alpha + bias[n]          (alpha = 1 / (g_x * g_w) for nvfp4, else 1)

K loop of one [BLOCK_M, BLOCK_N] output tile (``fp4_gemm_kernel``):

    acc = zeros([BLOCK_M, BLOCK_N], fp32)
    for k0 in range(0, K, BLOCK_K):
        a = dequantize_e2m1_tile(A bytes [BLOCK_M, BLOCK_K/2], A scales [BLOCK_M, BLOCK_K/GROUP])  # [BLOCK_M, BLOCK_K]
        w = dequantize_e2m1_tile(W bytes [BLOCK_N, BLOCK_K/2], W scales [BLOCK_N, BLOCK_K/GROUP])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a.to(DOT), w.to(DOT).T, acc)                                              # fp32 accumulation
    y = acc * alpha + bias

The scales are applied to the dequantized elements *before* the dot, so one tl.dot per K tile covers
all the K/GROUP blocks inside it. This is exact in bf16 (the GPU's DOT dtype): an e2m1 value has
2 significant bits and an e4m3 scale 4, so their product has at most 6 (bf16 keeps 8), and an E8M0
scale is a power of two that only moves the exponent (bf16 has fp32's exponent range). The products
of two such bf16 values are exact in the fp32 accumulator, so the only rounding is the fp32
accumulation itself. Under TRITON_INTERPRET=1 tl.dot on bf16 is garbage, so DOT is fp32 there
(also exact: the dequantized values are fp32 numbers).

W4A16 (``A16=True``): A is the bf16/fp16 activation itself, loaded [BLOCK_M, BLOCK_K] with any
strides. bf16 dots as is. fp16 is not exactly representable in bf16 (11 vs 8 significant bits), and
the dequantized weights may not fit fp16's range (E8M0 scales reach 2^+-127), so on GPU an fp16 tile
is split exactly into two bf16 tiles, a = hi + lo with hi = bf16(a) and lo = bf16(a - hi) (lo has at
most 3 significant bits), and the kernel issues two bf16 dots into the same accumulator
(``SPLIT_A16``). That costs a second tensor-core dot but loses nothing.

Constraints: K % GROUP == 0 (the wrappers check it); BLOCK_K is a power of two >= 2 * GROUP;
BLOCK_K need not divide K (the K tail is masked: masked bytes dequantize to 0). Row strides of the
packed data and scales may be arbitrary, the K stride of packed data and scales must be 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._codecs import (dequantize_e2m1, dequantize_e4m3, dequantize_e4m3_finite, dequantize_e8m0, global_alpha,
                       round_to_bf16_rne)
from .._common import interpreting, launch
from ._route import TileConfig
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._twopass import (
    ALPHA_GLOBAL_RECIP,
    ALPHA_NONE,
    store_splitk_partial,
    launch_bf16_gemm,
    launch_splitk_reduce,
    scratch_dtype,
    split_k_for,
    splitk_plan,
    splitk_workspace,
)


# ---------------------------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------------------------
def _pow2_clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(v, 1))))


def fp4_gemm_config(M: int, N: int, K: int, interp: bool) -> TileConfig:
    """Tile sizes of the fused FP4 GEMM on sm_90 (M <= 16 there only for fp16 W4A16: the decode
    kernel takes the rest, hopper._fp4_decode_tile).

    Interpreter: a (program x K-iteration) costs milliseconds of Python and numpy, so take tiles as
    large as the problem, up to 256 x 256 x 512 (one big program is an order of magnitude faster
    there than many small ones; docs/results.md).
    GPU, by M (docs/perf_notes.md has the measurements behind each row):
      M <= 16   16 x 128 x 128 with split-K (4 at N = 8192: 256 programs), so that more programs
                share the weight stream and the dequantization arithmetic.
      M <= 64   64 x 64 x 128, split-K likewise.
      M <= 128  64 x 128 x 64 fused (split-K 2 when N is narrow).
      M > 128   pre-pass: dequantize each operand once into bf16, then a bf16 GEMM (_twopass).
    BLOCK_K = 64..128 keeps the in-register dequantization (fp32 [BLOCK, BLOCK_K] tiles) inside the
    register budget.
    """
    if interp:
        return TileConfig(
            BLOCK_M=_pow2_clamp(M, 16, 256),
            BLOCK_N=_pow2_clamp(N, 16, 256),
            BLOCK_K=_pow2_clamp(K, 64, 512),
            GROUP_M=8,
            num_warps=4,
            num_stages=1,
        )
    if M > PREPASS_MIN_M:
        return TileConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, PREPASS=True)
    if M <= 16:
        # 16 x 128 with split 4 beat 16 x 64 / split 8 and 16 x 32 (docs/perf_notes.md)
        return TileConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3,
                          SPLIT_K=split_k_for(M, N, K, 16, 128, 128, target=256))
    if M <= 64:
        bm, bn, bk = 64, 64, 128
    else:
        bm, bn, bk = 64, 128, 64
    return TileConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=4,
                      num_stages=3, SPLIT_K=split_k_for(M, N, K, bm, bn, bk))


PREPASS_MIN_M = 128  # above this M the dequantizing pre-pass + bf16 GEMM beats the fused kernel


def dot_dtype(interp: bool):
    """The tl.dot operand dtype: bf16 on GPU (exact for dequantized FP4 values), fp32 in the interpreter."""
    return tl.float32 if interp else tl.bfloat16


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def dequantize_e2m1_tile(data_ptr, scale_ptr, offs_r, r_mask, k0, K, stride_dr, stride_sr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                      SCALE_E4M3: tl.constexpr, NAN_SCALES: tl.constexpr = True):
    """Dequantize rows ``offs_r`` x K-columns [k0, k0 + BLOCK_K) of a packed e2m1 matrix, with block
    scales applied, to float32 [BLOCK_R, BLOCK_K]. Out-of-range rows and K columns read as 0.
    NAN_SCALES: e4m3 scale code 0x7F dequantizes to NaN (False only for load-checked weight scales)."""
    rows = offs_r.to(tl.int64)
    # Packed bytes [BLOCK_R, BLOCK_K // 2]: byte j holds elements 2j (low nibble) and 2j + 1 (high).
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b_mask = r_mask[:, None] & (offs_kb[None, :] < K // 2)
    b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_kb[None, :], mask=b_mask, other=0)
    lo = dequantize_e2m1(b & 0xF)  # elements 2j
    hi = dequantize_e2m1(b >> 4)  # elements 2j + 1
    # join stacks along a new last axis: [BLOCK_R, BLOCK_K // 2, 2], so the row-major reshape puts
    # lo[j] at column 2j and hi[j] at column 2j + 1, the storage order.
    v = tl.join(lo, hi).reshape(BLOCK_R, BLOCK_K)
    # Scale bytes [BLOCK_R, BLOCK_K // GROUP]; a masked scale reads 0 and multiplies a masked 0.
    offs_ks = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s_mask = r_mask[:, None] & (offs_ks[None, :] < K // GROUP)
    s = tl.load(scale_ptr + rows[:, None] * stride_sr + offs_ks[None, :], mask=s_mask, other=0)
    if SCALE_E4M3 and NAN_SCALES:
        sv = dequantize_e4m3(s)
    elif SCALE_E4M3:
        sv = dequantize_e4m3_finite(s)
    else:
        sv = dequantize_e8m0(s)
    # Broadcast each scale over its GROUP elements: [BLOCK_R, BLOCK_K / GROUP, GROUP] * [.., .., 1].
    v = v.reshape(BLOCK_R, BLOCK_K // GROUP, GROUP) * sv[:, :, None]
    return v.reshape(BLOCK_R, BLOCK_K)


# ---------------------------------------------------------------------------------------------
# The GEMM kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def fp4_gemm_kernel(
    # pointers
    a_ptr, a_scale_ptr,  # activation: packed uint8 [M, K/2] + scales [M, K/GROUP], or (A16) x [M, K]
    w_ptr, w_scale_ptr,  # weight: packed uint8 [N, K/2] + scales [N, K/GROUP]
    gx_ptr, gw_ptr,  # nvfp4 global scales (float32, one element each); unused otherwise
    bias_ptr, c_ptr,  # bias [N] (any float dtype), output [M, N]
    ws_ptr,  # SPLIT_K > 1: fp32 workspace [SPLIT_K, M, N] (the epilogue then runs in _twopass)
    # dimensions
    M, N, K, K_PER,  # K_PER: K elements per split, a multiple of BLOCK_K (K when SPLIT_K == 1)
    # strides (K strides of packed data and scales are 1)
    stride_am, stride_ak, stride_asm,
    stride_wn, stride_wsn,
    stride_cm,
    # meta-parameters
    GROUP: tl.constexpr,  # elements per scale along K: 16 (nvfp4) or 32 (mxfp4)
    SCALE_E4M3: tl.constexpr,  # scale bytes are e4m3 (nvfp4) rather than E8M0 (mxfp4)
    HAS_GLOBAL: tl.constexpr,  # apply alpha = 1 / (g_x * g_w) in the epilogue (nvfp4)
    A16: tl.constexpr,  # activation is unquantized bf16/fp16 (W4A16)
    SPLIT_A16: tl.constexpr,  # A16 with fp16 x on GPU: dot hi and lo bf16 halves (exact)
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # bf16 on GPU, fp32 under the interpreter
    ROUND_BF16: tl.constexpr,  # interpreter + bf16 output: round to nearest even before the cast
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    # ----- program -> output tile, grouped along M so neighbouring programs share W tiles in L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N

    # ----- main loop over this program's K range [k_lo, k_hi) (all of K unless split-K):
    # acc [BLOCK_M, BLOCK_N] fp32 += A tile [BLOCK_M, BLOCK_K] . W tile^T [BLOCK_K, BLOCK_N]
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pdl_wait(USE_PDL)  # the quantized activation
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # W tile, scales applied: [BLOCK_N, BLOCK_K] -> transposed to [BLOCK_K, BLOCK_N]
        w = dequantize_e2m1_tile(w_ptr, w_scale_ptr, offs_n, n_mask, k0, K, stride_wn, stride_wsn,
                              BLOCK_N, BLOCK_K, GROUP, SCALE_E4M3, not A16)  # W4A16: at its register limit
        w_t = tl.trans(w.to(DOT_DTYPE))
        if A16:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = m_mask[:, None] & (offs_k[None, :] < K)
            x_ptrs = (a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
                      + offs_k.to(tl.int64)[None, :] * stride_ak)
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if SPLIT_A16:
                x32 = x.to(tl.float32)
                x_hi = x32.to(tl.bfloat16)
                x_lo = (x32 - x_hi.to(tl.float32)).to(tl.bfloat16)  # exact: <= 3 significant bits
                acc = tl.dot(x_hi, w_t, acc)
                acc = tl.dot(x_lo, w_t, acc)
            else:
                # bf16 x on GPU: already the DOT dtype; interpreter: widen to fp32 (exact)
                acc = tl.dot(x.to(tl.float32).to(DOT_DTYPE), w_t, acc)
        else:
            a = dequantize_e2m1_tile(a_ptr, a_scale_ptr, offs_m, m_mask, k0, K, stride_am, stride_asm,
                                  BLOCK_M, BLOCK_K, GROUP, SCALE_E4M3)
            acc = tl.dot(a.to(DOT_DTYPE), w_t, acc)
    pdl_launch_dependents(USE_PDL)

    if SPLIT_K > 1:
        # partial sum of this K range; splitk_reduce_kernel adds the slices and runs the epilogue
        store_splitk_partial(ws_ptr, acc, pid_k, offs_m, offs_n, M, N, m_mask[:, None] & n_mask[None, :])
        return

    # ----- epilogue: global scales (nvfp4), bias, cast, masked store
    if HAS_GLOBAL:
        # alpha = 1 / (g_x * g_w), computed here from the device tensors (no host sync, so the call
        # can be captured in a CUDA graph); as two reciprocals so that g_x * g_w cannot overflow
        # (their product underflows only when amax_x * amax_w < ~1e-31).
        gx = tl.load(gx_ptr)
        gw = tl.load(gw_ptr)
        acc = acc * global_alpha(gx, gw)  # NaN for a global scale that is not finite and > 0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if ROUND_BF16:
        acc = round_to_bf16_rne(acc)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------
# Pre-pass for large M: dequantize a packed operand once into a scratch matrix (scales applied)
# ---------------------------------------------------------------------------------------------
@triton.jit
def fp4_dequantize_kernel(
    data_ptr, scale_ptr, out_ptr,  # packed uint8 [R, K/2], scale bytes [R, K/GROUP] -> out [R, K]
    R, K,
    stride_dr, stride_sr, stride_or,
    GROUP: tl.constexpr, SCALE_E4M3: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[rows, k-tile] = e2m1(codes) * scale, the same dequantize_e2m1_tile the fused GEMM runs, so
    the pre-pass GEMM sees the same (exact) operand values."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    r_mask = offs_r < R
    v = dequantize_e2m1_tile(data_ptr, scale_ptr, offs_r, r_mask, k0, K, stride_dr, stride_sr,
                          BLOCK_R, BLOCK_K, GROUP, SCALE_E4M3)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = out_ptr + offs_r.to(tl.int64)[:, None] * stride_or + offs_k[None, :]
    tl.store(ptrs, v.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & (offs_k[None, :] < K))


def dequantize_fp4(data, scale, K: int, group: int, scale_e4m3: bool) -> torch.Tensor:
    """Dequantized [R, K] matrix (scratch_dtype(): bf16 on GPU, exact) of a packed operand."""
    R = data.shape[0]
    out = torch.empty((R, K), dtype=scratch_dtype(), device=data.device)
    if R:
        br, bk = (min(64, triton.next_power_of_2(R)), min(512, max(64, triton.next_power_of_2(K)))) \
            if interpreting() else (32, 128)
        launch(fp4_dequantize_kernel, (triton.cdiv(R, br), triton.cdiv(K, bk)),
               data, scale, out, R, K, data.stride(0), scale.stride(0), out.stride(0),
               GROUP=group, SCALE_E4M3=scale_e4m3, BLOCK_R=br, BLOCK_K=bk, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# Host launcher (hopper.nvfp4 / hopper.mxfp4 check the arguments and choose the tile: their route)
# ---------------------------------------------------------------------------------------------
def gemm_kernels(cfg: TileConfig, a16: bool, a_dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    """The kernels launch_fp4_gemm launches with tile ``cfg`` (in order): the pre-pass's dequantize
    kernels and the bf16 GEMM, or the fused kernel and, with split-K, the ordered reduction."""
    if cfg.PREPASS and not (a16 and a_dtype == torch.float16):
        return ("fp4_dequantize_kernel",) * (1 if a16 else 2) + ("bf16_gemm_kernel",)
    return ("fp4_gemm_kernel",) + (("splitk_reduce_kernel",) if cfg.SPLIT_K > 1 else ())


def launch_fp4_gemm(a, a_scale, w, w_scale, *, M, N, K, group, scale_e4m3, bias, out_dtype, config: TileConfig,
                    gx=None, gw=None, a16=False) -> torch.Tensor:
    """Allocate the [M, N] output and launch the GEMM of tile ``config`` (gemm_kernels names them).

    a: packed uint8 [M, K/2] with scales a_scale [M, K/group] (row stride free, K stride 1), or,
    with a16, the bf16/fp16 activation [M, K] (any strides; a_scale ignored). w, w_scale: the
    weight's packed bytes [N, K/2] and scale bytes [N, K/group] (uint8 views). gx, gw: float32
    one-element device tensors (nvfp4), or None. config: fp4_gemm_config's tile (the route's);
    with PREPASS the pre-pass and the bf16 GEMM, except for fp16 W4A16, which keeps the fused
    kernel (exact hi/lo halves; the route gives it the fused tile of M <= PREPASS_MIN_M).
    """
    out = torch.empty((M, N), dtype=out_dtype, device=w.device)
    if M == 0 or N == 0:
        return out
    interp = interpreting()
    cfg = config
    split = bool(a16 and a.dtype == torch.float16 and not interp)
    has_global = gx is not None
    if cfg.PREPASS and not split:
        # Large M: dequantize each operand once (bf16 scratch), then one plain GEMM; alpha and bias
        # in its epilogue. W4A16 with bf16 x uses x itself (fp16 x keeps the fused hi/lo path).
        wd = dequantize_fp4(w, w_scale, K, group, scale_e4m3)
        ad = a.to(wd.dtype) if a16 else dequantize_fp4(a, a_scale, K, group, scale_e4m3)
        return launch_bf16_gemm(ad, wd, out, bias=bias, alpha_mode=ALPHA_GLOBAL_RECIP if has_global else ALPHA_NONE,
                                s1=gx, s2=gw, config=cfg)
    if a16:
        stride_am, stride_ak, stride_asm, a_scale = a.stride(0), a.stride(1), 0, w_scale
    else:
        stride_am, stride_ak, stride_asm = a.stride(0), 1, a_scale.stride(0)
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, w.device) if n_split > 1 else out
    # Unused pointer arguments still need a tensor; the weight's bytes stand in for them.
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), n_split)
    launch(
        fp4_gemm_kernel, grid,
        a, a_scale, w, w_scale,
        gx if has_global else w_scale, gw if has_global else w_scale,
        bias if bias is not None else out, out, ws,
        M, N, K, k_per,
        stride_am, stride_ak, stride_asm,
        w.stride(0), w_scale.stride(0),
        out.stride(0),
        GROUP=group, SCALE_E4M3=scale_e4m3, HAS_GLOBAL=has_global, A16=a16, SPLIT_A16=split,
        HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype(interp),
        ROUND_BF16=interp and out_dtype == torch.bfloat16,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        SPLIT_K=n_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(w.device),
    )
    if n_split > 1:
        launch_splitk_reduce(ws, out, bias=bias, alpha_mode=ALPHA_GLOBAL_RECIP if has_global else ALPHA_NONE, s1=gx, s2=gw)
    return out
