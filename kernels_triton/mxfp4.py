"""MXFP4 in Triton, the lesson: the activation quantizer, the portable GEMM, the native SM12x GEMM,
the route, the launchers and the public functions, in that order.

What MXFP4 stores (formats/mxfp4.py and formats/_mx.py are the spec and the oracle): e2m1 codes
packed two per byte along K (uint8 [rows, K/2], element 2i in the low nibble) and one E8M0 scale
byte per 32 elements (uint8 [rows, K/32]; byte b means 2^(b - 127)):

    e    = ceil(log2(div_rn(max(amax_block, FLOOR), 6)))     scale_rule="ceil" (default)
         = floor(log2(max(amax_block, FLOOR))) - 2           scale_rule="floor" (OCP MX v1.0 6.3)
    e    = clamp(e, -127, 127);  scale byte = e + 127
    code = e2m1(x * 2^-e)                                    (a power of two: exact, no division)

1. The quantizer (``_quantize_kernel``; tile math: ``mxfp4_quantize_tile``), bit for bit as the
   oracle. ceil_log2/floor_log2 read the fp32 exponent bits and exp2_int writes them, so the
   exponent is exact on every backend (tl.exp2/tl.log2 may be approximate on GPU). A block with
   NaN/Inf input gets the E8M0 NaN byte 0xFF.

2. The portable GEMM (``_portable_gemm_kernel``; tile math: ``mxfp4_dequantize_tile``): dequantize
   each operand tile in registers, then a plain tl.dot. An E8M0 scale is a power of two, so
   e2m1 * scale keeps e2m1's 2 significant bits: exact in bf16 (the GPU's dot dtype; fp32 under the
   interpreter, whose bf16 tl.dot is wrong):

       for k0 in range(0, K, BLOCK_K):
           a = e2m1(A bytes) * 2^(A scale - 127)[:, k // 32]         [BLOCK_M, BLOCK_K]
           w = e2m1(W bytes) * 2^(W scale - 127)[:, k // 32]         [BLOCK_N, BLOCK_K]
           acc += tl.dot(a, w^T)                                     fp32 [BLOCK_M, BLOCK_N]
       y = acc + bias

   W4A16 (``gemm_w4a16``, ``linear(a16=True)``): bf16 x dots with the bf16 dequantized weight; fp16
   x has 3 more mantissa bits than bf16 and the weights (up to 6 * 2^127) overflow fp16, so on GPU
   each fp16 tile is split exactly into bf16 hi + lo and dotted twice.

3. The native SM12x GEMM (``_native_gemm_kernel``): tl.dot_scaled on the codes with one E8M0 scale
   per 32 elements lowers to mma.sync m16n8k64 kind::mxf4nvf4.block_scale.scale_vec::2X ... ue8m0,
   which applies the scales inside the instruction. The weight scales may be linear or swizzled
   128x4 (``scale_offsets``). The interpreter's dot_scaled is right for E8M0 scales, so the CPU
   tests run this kernel too.

Where each GEMM runs (_common.gemm_path): native on SM120/SM121 with a Triton that lowers it; the
portable kernel elsewhere and under the interpreter; W4A16 always portable. Tiles: ``tile=`` /
``quant_tile=`` (kernels_triton.tuning), else ``tile_config`` / ``default_quant_tile``.
Constraints: K % 32 == 0; x bf16/fp16 [..., K], any leading dims and strides.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E2M1_EMAX, E2M1_MAX, MX_BLOCK

from ._codecs import (abs_or_inf, ceil_log2, dequantize_e2m1, dequantize_e8m0, encode_e2m1, exp2_int, floor_log2,
                      grouped_tile, scale_offsets)
from ._common import (Route, TileConfig, check_activation, check_gemm_operands,
                      check_linear, check_out_dtype, check_sizes, default_quant_tile, device_capability, epilogue,
                      flatten_rows, interpreter_config, interpreting, kernel_bias, launch, route_path,
                      weight_scale_bytes)

FMT = "mxfp4"
VEC_SIZE = MX_BLOCK  # 32 elements share one E8M0 scale
SCALE_RULES = ("ceil", "floor")

_FLOOR = tl.constexpr(AMAX_FLOOR)
_E2M1_MAX = tl.constexpr(E2M1_MAX)  # 6.0
_E2M1_EMAX = tl.constexpr(E2M1_EMAX)  # 2: 6 = 1.5 * 2^2


# == 1. The activation quantizer ==================================================================
@triton.jit
def mxfp4_quantize_tile(x, CEIL_RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x fp32 [BLOCK_M, BLOCK_K] -> (e2m1 codes uint8 [BLOCK_M, BLOCK_K], one per element; E8M0 scale
    bytes uint8 [BLOCK_M, BLOCK_K / 32], 0xFF for a block with NaN/Inf)."""
    # per-32 block exponent e: [BLOCK_M, BLOCK_K / 32]
    xb = x.reshape(BLOCK_M, BLOCK_K // 32, 32)
    amax = tl.max(abs_or_inf(xb), axis=2)  # +Inf marks a NaN/Inf in the block
    bad = amax > 3.4028234663852886e38
    amax = tl.maximum(amax, _FLOOR)
    if CEIL_RULE:
        e = ceil_log2(tl.math.div_rn(amax, _E2M1_MAX))
    else:
        e = floor_log2(amax) - _E2M1_EMAX
    e = tl.minimum(tl.maximum(e, -127), 127)
    # element codes e2m1(x * 2^-e): the power-of-two product is exact (or one correctly rounded
    # subnormal, like the oracle's float64 ldexp cast to float32); a bad block gets the NaN byte
    # 0xFF and codes 0 (e2m1 has no NaN code)
    codes = encode_e2m1(xb * exp2_int(-e)[:, :, None])
    codes = tl.where(bad[:, :, None], 0, codes).to(tl.uint8).reshape(BLOCK_M, BLOCK_K)
    return codes, tl.where(bad, 0xFF, e + 127).to(tl.uint8)


@triton.jit
def _quantize_kernel(
    x_ptr,  # bf16/fp16 [M, K], any strides
    q_ptr, s_ptr,  # out: packed uint8 [M, K/2], E8M0 bytes uint8 [M, K/32]
    M, K,
    stride_xm, stride_xk, stride_qm, stride_sm,
    CEIL_RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)

    # ----- x tile [BLOCK_M, BLOCK_K] as float32 (exact for bf16/fp16), quantized
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)
    m_mask = offs_m < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
    codes, s_bytes = mxfp4_quantize_tile(x, CEIL_RULE, BLOCK_M, BLOCK_K)

    # ----- two codes per byte, element 2j in the low nibble (split pairs the columns 2j, 2j + 1);
    # store bytes [BLOCK_M, BLOCK_K / 2] and scale bytes [BLOCK_M, BLOCK_K / 32]
    even, odd = tl.split(codes.reshape(BLOCK_M, BLOCK_K // 2, 2))
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_kb[None, :], even | (odd << 4),
             mask=m_mask[:, None] & (offs_kb[None, :] < K // 2))
    offs_ks = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    tl.store(s_ptr + rows[:, None] * stride_sm + offs_ks[None, :], s_bytes,
             mask=m_mask[:, None] & (offs_ks[None, :] < K // 32))


# == 2. The portable GEMM: dequantize in registers, then tl.dot ===================================
@triton.jit
def mxfp4_dequantize_tile(data_ptr, scale_ptr, offs_r, r_mask, k0, K, stride_dr, stride_sr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``offs_r`` x K [k0, k0 + BLOCK_K) of a packed MXFP4 matrix, block scales applied, as
    float32 [BLOCK_R, BLOCK_K]; out-of-range rows and K columns read as 0, E8M0 0xFF as NaN."""
    rows = offs_r.to(tl.int64)
    # packed bytes [BLOCK_R, BLOCK_K // 2]: byte j holds elements 2j (low nibble) and 2j + 1 (high)
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(data_ptr + rows[:, None] * stride_dr + offs_kb[None, :],
                mask=r_mask[:, None] & (offs_kb[None, :] < K // 2), other=0)
    # join stacks along a new last axis: [BLOCK_R, BLOCK_K // 2, 2], so the row-major reshape puts
    # the low nibble of byte j at column 2j and the high one at 2j + 1, the storage order
    v = tl.join(dequantize_e2m1(b & 0xF), dequantize_e2m1(b >> 4)).reshape(BLOCK_R, BLOCK_K)
    # scales [BLOCK_R, BLOCK_K // 32]; a masked scale reads 0 (2^-127) and multiplies a masked 0
    offs_ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(scale_ptr + rows[:, None] * stride_sr + offs_ks[None, :],
                mask=r_mask[:, None] & (offs_ks[None, :] < K // 32), other=0)
    # each scale over its 32 elements: [BLOCK_R, BLOCK_K / 32, 32] * [.., .., 1]
    return (v.reshape(BLOCK_R, BLOCK_K // 32, 32) * dequantize_e8m0(s)[:, :, None]).reshape(BLOCK_R, BLOCK_K)


@triton.jit
def _portable_gemm_kernel(
    a_ptr, a_scale_ptr,  # activation: packed uint8 [M, K/2] + E8M0 bytes [M, K/32], or (A16) x [M, K]
    w_ptr, w_scale_ptr,  # weight: packed uint8 [N, K/2] + E8M0 bytes [N, K/32]
    bias_ptr, c_ptr,  # bias [N] (any float dtype), output [M, N]
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_wn, stride_wsn, stride_cm,
    A16: tl.constexpr,  # the activation is unquantized bf16/fp16 (W4A16)
    SPLIT_A16: tl.constexpr,  # A16 with fp16 x on GPU: dot the exact bf16 hi and lo halves
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # bf16 on GPU, fp32 under the interpreter
    ROUND_BF16: tl.constexpr,  # interpreter + bf16 output: round to nearest even before the cast
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N

    # ----- K loop: acc [BLOCK_M, BLOCK_N] fp32 += A tile [BLOCK_M, BLOCK_K] . W tile^T [BLOCK_K, BLOCK_N]
    # (the A tile first: its temporaries are dead before the wider W tile is dequantized)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A16:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak,
                        mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
            if SPLIT_A16:  # fp16 x = hi + lo, both exact in bf16
                x32 = x.to(tl.float32)
                a = x32.to(tl.bfloat16)
                a_lo = (x32 - a.to(tl.float32)).to(tl.bfloat16)  # exact: <= 3 significant bits
            else:  # bf16 x on GPU: already the dot dtype; interpreter: widened to fp32 (exact)
                a = x.to(tl.float32).to(DOT_DTYPE)
        else:
            a = mxfp4_dequantize_tile(a_ptr, a_scale_ptr, offs_m, m_mask, k0, K, stride_am, stride_asm, BLOCK_M,
                                      BLOCK_K).to(DOT_DTYPE)
        w = mxfp4_dequantize_tile(w_ptr, w_scale_ptr, offs_n, n_mask, k0, K, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
        w_t = tl.trans(w.to(DOT_DTYPE))
        acc = tl.dot(a, w_t, acc)
        if SPLIT_A16:
            acc = tl.dot(a_lo, w_t, acc)

    # ----- epilogue: bias, cast, masked store (every scale was applied in the K loop)
    y = epilogue(acc, offs_n, n_mask, bias_ptr, bias_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# == 3. The native SM12x GEMM: tl.dot_scaled, the block-scaled MMA ================================
@triton.jit
def _native_gemm_kernel(
    a_ptr, a_scale_ptr,  # activation: packed e2m1 uint8 [M, K/2], E8M0 bytes [M, K/32] (linear)
    w_ptr, w_scale_ptr,  # weight: packed e2m1 uint8 [N, K/2], E8M0 bytes (linear or swizzled 128x4)
    bias_ptr, c_ptr,  # bias [N], output [M, N]
    M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,  # the K strides are 1
    W_SWIZZLED: tl.constexpr,  # weight scales in the swizzled 128x4 layout
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    n_scales = K // 32

    # ----- K loop: acc [BLOCK_M, BLOCK_N] fp32 += (A . SA) [BLOCK_M, BLOCK_K] . (W . SW)^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # packed bytes, two e2m1 codes each, low nibble first: [rows, BLOCK_K // 2]
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kb_ok = offs_kb < K // 2
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_kb[None, :], mask=m_ok[:, None] & kb_ok[None, :], other=0)
        w = tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_kb[None, :], mask=n_ok[:, None] & kb_ok[None, :], other=0)
        # E8M0 block scales, one per 32 elements: [rows, BLOCK_K // 32] (masked: 0 x 0 = 0)
        offs_ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        ks_ok = offs_ks < n_scales
        sa = tl.load(a_scale_ptr + scale_offsets(offs_m, offs_ks, n_scales, stride_asm, False),
                     mask=m_ok[:, None] & ks_ok[None, :], other=0)
        sw = tl.load(w_scale_ptr + scale_offsets(offs_n, offs_ks, n_scales, stride_wsn, W_SWIZZLED),
                     mask=n_ok[:, None] & ks_ok[None, :], other=0)
        # one block-scaled MMA per 64-deep slice; the scales never leave the instruction
        acc = tl.dot_scaled(a, sa, "e2m1", w.T, sw, "e2m1", acc)

    # ----- epilogue: bias, cast, masked store
    y = epilogue(acc, offs_n, n_ok, bias_ptr, bias_ptr, bias_ptr, TENSOR_SCALES=False, GLOBAL_SCALES=False,
                 HAS_BIAS=HAS_BIAS, ROUND_BF16=ROUND_BF16)
    tl.store(c_ptr + rows_m[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# == 4. The route: which kernels, which tile, why =================================================
def tile_config(M: int, N: int, K: int, path=None, capability=None, *, a16: bool = False) -> TileConfig:
    """The GEMM's tile without ``tile=``, for ``path`` on a device of ``capability`` (None: the
    interpreter): as large as the problem there (BLOCK_K >= 64, triton#11776); on a GPU 64 x 64,
    BLOCK_K 128 natively and 64 portably (its dequantized fp32 tiles live in registers)."""
    path = route_path(path, FMT, capability, a16=a16)[0]
    if capability is None:
        return interpreter_config(M, N, K, min_block_k=64)
    return TileConfig(64, 64, 128 if path == "native" else 64)


def _plan(M: int, N: int, K: int, capability, *, a16: bool = False, path: Optional[str] = None,
          tile: Optional[TileConfig] = None) -> tuple[Route, str, TileConfig]:
    """(the route, its GEMM path, its tile): the one place a call's kernels are decided."""
    check_sizes(M, N, K)
    path, why = route_path(path, FMT, capability, a16=a16)
    tile = tile or tile_config(M, N, K, path, capability, a16=a16)
    quant = () if a16 or M == 0 else ("_quantize_kernel",)
    if M == 0 or N == 0:
        return Route("triton", quant, why=f"{FMT}: an empty output, no GEMM to launch"), path, tile
    return Route("triton", quant + (f"_{path}_gemm_kernel",), str(tile), 1, why), path, tile


def route(M: int, N: int, K: int, *, capability=None, sm_count: int = 1, a16: bool = False,
          path: Optional[str] = None, tile: Optional[TileConfig] = None, scale_rule: str = "ceil") -> Route:
    """The Route ``linear`` launches for x [M, K] (M = prod(x.shape[:-1])) and a weight [N, K] on a
    device of ``capability`` ((major, minor); None: the interpreter), with ``linear``'s options
    (scale_rule and sm_count do not change it). Pure: no GPU needed. ValueError: a negative
    dimension, or a path route_path refuses."""
    return _plan(M, N, K, capability, a16=a16, path=path, tile=tile)[0]


# == 5. The launchers (operands checked by the caller) ============================================
def _quantize(x2: torch.Tensor, scale_rule: str, quant_tile) -> QuantizedTensor:
    """quantize_activation on x2 [M, K]: one quantize kernel."""
    M, K = x2.shape
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=x2.device)
    scale = torch.empty((M, K // VEC_SIZE), dtype=torch.uint8, device=x2.device)
    if M > 0:
        block_m, block_k = quant_tile or default_quant_tile(M, K, VEC_SIZE)
        launch(_quantize_kernel, (triton.cdiv(M, block_m), triton.cdiv(K, block_k)),
               x2, data, scale, M, K, x2.stride(0), x2.stride(1), data.stride(0), scale.stride(0),
               CEIL_RULE=scale_rule == "ceil", BLOCK_M=block_m, BLOCK_K=block_k)
    return QuantizedTensor(FMT, "activation", data, scale, None, (1, VEC_SIZE), (M, K))


def _launch_gemm(path: str, tile: TileConfig, a, qweight, bias, out_dtype) -> torch.Tensor:
    """y [M, N] = the GEMM of ``path`` with ``tile``. a: the activation, an MXFP4 QuantizedTensor
    (W4A4) or the bf16/fp16 x [M, K] itself (W4A16: the portable kernel)."""
    a16 = not isinstance(a, QuantizedTensor)
    M, (N, K) = a.shape[0], qweight.shape
    y = torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    if M == 0 or N == 0:
        return y
    sa = None
    if not a16:
        a, sa = a.data.contiguous(), a.scale.contiguous()
    bias = kernel_bias(bias)
    grid = (triton.cdiv(M, tile.BLOCK_M) * triton.cdiv(N, tile.BLOCK_N),)
    common = dict(HAS_BIAS=bias is not None, ROUND_BF16=interpreting() and out_dtype == torch.bfloat16,
                  BLOCK_M=tile.BLOCK_M, BLOCK_N=tile.BLOCK_N, BLOCK_K=tile.BLOCK_K, GROUP_M=tile.GROUP_M,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    bias_arg = bias if bias is not None else y  # an unused pointer still needs a tensor
    # [native-call]
    if path == "native":
        sw, swizzled = weight_scale_bytes(qweight, FMT, VEC_SIZE)
        launch(_native_gemm_kernel, grid, a, sa, qweight.data.contiguous(), sw, bias_arg, y, M, N, K,
               a.stride(0), sa.stride(0), qweight.data.stride(0), 0 if swizzled else sw.stride(0), y.stride(0),
               W_SWIZZLED=swizzled, **common)
        return y
    # [/native-call]
    w = qweight.data.contiguous()
    sw = qweight.scale.contiguous()
    split = bool(a16 and a.dtype == torch.float16 and not interpreting())
    launch(_portable_gemm_kernel, grid, a, sw if a16 else sa, w, sw, bias_arg, y, M, N, K,
           a.stride(0), a.stride(1) if a16 else 1, 0 if a16 else sa.stride(0), w.stride(0), sw.stride(0), y.stride(0),
           A16=a16, SPLIT_A16=split, DOT_DTYPE=tl.float32 if interpreting() else tl.bfloat16, **common)
    return y


# == 6. The public functions: check, then launch ==================================================
def _check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil",
                        quant_tile: Optional[tuple[int, int]] = None) -> QuantizedTensor:
    """x bf16/fp16 [..., K] (K % 32 == 0, any strides; NaN/Inf: docs/formats.md's non-finite rule)
    -> QuantizedTensor(mxfp4 activation, data uint8 [M, K/2], scale uint8 E8M0 [M, K/32]), bit for
    bit ``formats.quantize(x, "mxfp4", role="activation", scale_rule=scale_rule)``. scale_rule:
    "ceil" or "floor" (module docstring); quant_tile: (BLOCK_M, BLOCK_K) of a program. ValueError:
    x not bf16/fp16, K not a positive multiple of 32, an unknown scale_rule."""
    check_activation(x, None, VEC_SIZE, FMT)
    _check_scale_rule(scale_rule)
    return _quantize(flatten_rows(x), scale_rule, quant_tile)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None,
         tile: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] of out_dtype (bf16, fp16, fp32) = dequant(xq) . dequant(qweight)^T (+ bias [N], any
    float dtype, added in fp32), fp32 accumulation. xq: MXFP4 activation [M, K]; qweight: MXFP4
    weight [N, K] (linear scales; swizzled 128x4 too with path="native"). path: None (gemm_path's)
    or forced; tile: the GEMM's tile. ValueError: a wrong operand (format, role, layout, K,
    device), bias or out_dtype, or a path route_path refuses."""
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT, path)
    _, path, tile = _plan(M, N, K, device_capability(qweight.device), path=path, tile=tile)
    return _launch_gemm(path, tile, xq, qweight, bias, out_dtype)


def gemm_w4a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None, *, tile: Optional[TileConfig] = None) -> torch.Tensor:
    """W4A16: y [M, N] of out_dtype (default x2d's) = x2d . dequant(qweight)^T (+ bias), the portable
    kernel on every device (gemm_path(fmt, cap, a16=True) says why), exact products, fp32 sums.
    x2d: bf16/fp16 [M, K] (any strides); qweight: MXFP4 [N, K], linear scales. ValueError: x2d not
    2-D bf16/fp16, a wrong K, device, weight, bias or out_dtype."""
    check_linear(x2d, qweight, bias, FMT, VEC_SIZE)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    out_dtype = out_dtype or x2d.dtype
    check_out_dtype(out_dtype)
    _, path, tile = _plan(x2d.shape[0], *qweight.shape, device_capability(qweight.device), a16=True, tile=tile)
    return _launch_gemm(path, tile, x2d, qweight, bias, out_dtype)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, scale_rule: str = "ceil", path: Optional[str] = None,
           tile: Optional[TileConfig] = None, quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """y [..., N] of x's dtype = x . W^T (+ bias [N]): W4A4 (x quantized with ``scale_rule``), or
    W4A16 with a16=True (x as it is); exactly the kernels of ``route``. x: bf16/fp16 [..., K], any
    strides; qweight: MXFP4 [N, K] on x's device. path, tile, quant_tile: as gemm and
    quantize_activation. ValueError naming the argument: x (dtype, K, device), the weight (format,
    layout), bias, scale_rule, or a path route_path refuses."""
    check_linear(x, qweight, bias, FMT, VEC_SIZE, path)
    if not a16:
        _check_scale_rule(scale_rule)
    return linear_unchecked(x, qweight, bias, a16=a16, scale_rule=scale_rule, path=path, tile=tile,
                            quant_tile=quant_tile)


def linear_unchecked(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
                     a16: bool = False, scale_rule: str = "ceil", path: Optional[str] = None,
                     tile: Optional[TileConfig] = None, quant_tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``linear`` without its argument checks, for a caller that made them (dispatch's bound call):
    the same arguments and result; wrong arguments fail inside the kernels or give wrong numbers."""
    N, K = qweight.shape
    x2 = flatten_rows(x)
    _, path, tile = _plan(x2.shape[0], N, K, device_capability(qweight.device), a16=a16, path=path, tile=tile)
    a = x2 if a16 else _quantize(x2, scale_rule, quant_tile)
    return _launch_gemm(path, tile, a, qweight, bias, x.dtype).reshape(*x.shape[:-1], N)
