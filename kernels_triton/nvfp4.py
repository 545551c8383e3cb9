"""NVFP4 in Triton: the block-scaled FP4 GEMM as the SM12x tensor cores run it.

What NVFP4 stores (formats/nvfp4.py is the spec and the oracle): e2m1 codes packed two per byte
along K (uint8 [rows, K/2], element 2i in the low nibble), one e4m3 scale per 16 elements and one
fp32 global scale g per tensor:

    x[m, k] ~= e2m1(qx[m, k]) * e4m3(sx[m, k // 16]) / g_x

1. What the instruction computes. SM120/SM121 have a warp-level block-scaled MMA,

       mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3

   D[16x8] = sum over a 64-deep K slice of (A[m, k] * SA[m, k // 16]) * (B[k, n] * SB[n, k // 16]) + C:
   e2m1 operands, four e4m3 scales per row of A and per column of B ("scale_vec::4X"), exact
   products, fp32 accumulation. The scales are applied inside the instruction, so the K loop never
   decodes an element. Triton exposes it as

       acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)

   a: uint8 [BLOCK_M, BLOCK_K/2] (packed along K), b: uint8 [BLOCK_K/2, BLOCK_N], sa: [BLOCK_M,
   BLOCK_K/16], sb: [BLOCK_N, BLOCK_K/16] (one row per output column, not transposed), scales as
   float8e4nv. MXFP4 is the same instruction with one E8M0 (uint8) scale per 32, "scale_vec::2X";
   kernels_triton/mxfp4.py launches this very kernel with VEC_SIZE=32. The global scales are not
   part of the instruction: alpha = (1 / g_x) * (1 / g_w) multiplies the accumulator once, in the
   epilogue (two IEEE reciprocals, so g_x * g_w cannot overflow).

2. The scale layout it consumes. Each K step loads its scales as a register tile [rows, BLOCK_K/16],
   from either the linear layout [rows, K/16] or the swizzled 128x4 layout of formats.layout
   (cuBLAS / b12x: 512-byte tiles of 128 rows x 4 scales; ``scale_offsets``). The weight may come in
   either; activations come linear from quantize_activation. Why not swizzled only: the 128x4 tiles
   exist so that one bulk copy feeds a 128-row MMA tile's scales (tcgen05, CUTLASS SM120). Triton's
   mma.sync lowering distributes the scales over the threads from registers anyway, so the layout
   only changes the global load pattern (linear: BLOCK_K/16 contiguous bytes per row; swizzled: one
   4-byte word per row and 4 scales) and a decode tile of 16 rows would read a 128-row tile's
   padding. The kernel reads both, so a checkpoint in the b12x layout needs no conversion.

3. The kernel (``fp4_dot_scaled_kernel``), one program per [BLOCK_M, BLOCK_N] output tile:

       acc = 0                                                   fp32 [BLOCK_M, BLOCK_N]
       for k0 in range(0, K, BLOCK_K):
           a, sa = A bytes [BLOCK_M, BLOCK_K/2], A scales [BLOCK_M, BLOCK_K/16]
           w, sw = W bytes [BLOCK_N, BLOCK_K/2], W scales [BLOCK_N, BLOCK_K/16]
           acc   = dot_scaled(a, sa, w^T, sw, acc)
       y = acc * (1 / g_x) * (1 / g_w) + bias

4. The wrapper (``gemm``): check the operands, allocate y, pick the tile, launch.

Where it runs (kernels_triton._paths.gemm_path): native on SM120/SM121; on other GPUs the portable
path decodes each tile in registers to exact bf16 and runs a plain tl.dot (_fp4_gemm; Hopper has
no block-scaled MMA, and Triton 3.6 cannot compile dot_scaled with e4m3 scales on sm_90); under the
CPU interpreter the portable path too (its dot_scaled decodes e4m3 scales as E8M0). ``path=``
forces one. W4A16 (``a16=True``) always takes the portable kernel: bf16 x decoded weight (see
gemm_path's reason). At M <= 16 on sm_90 the portable path is _fp4_decode's swapped kernel (the
weight as wgmma's register operand), for W4A4 and bf16 W4A16. Split-K, the decode pre-pass and the
tile tables are performance machinery: _twopass, _fp4_gemm and _tiles.

Constraints: K % 16 == 0 (the K tail of a tile is masked; BLOCK_K >= 64, triton#11776); x bf16/fp16
[..., K], any leading dims and strides.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import NVFP4_BLOCK

from ._common import TileConfig, check_activation, check_bias, check_weight, interpreting, kernel_bias, scale_offsets
from ._e4m3_gemm import grouped_tile
from ._fp4_gemm import fp4_gemm_config, launch_fp4_gemm, portable_config
from .hopper._fp4_decode import decode_applies, launch_fp4_decode, plane_layout
from ._nvfp4_quant import quantize_activation, quantize_planes
from ._paths import check_native_weight, default_device, device_capability, resolve_path, sm_count, weight_scale_bytes
from .hopper._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._tiles import sm12x_config
from .hopper._twopass import (
    ALPHA_GLOBAL_RECIP,
    ALPHA_NONE,
    epilogue,
    launch_splitk_reduce,
    splitk_plan,
    splitk_workspace,
    store_splitk_partial,
)

__all__ = ["fp4_dot_scaled_kernel", "gemm", "gemm_w4a16", "linear", "quantize_activation", "tile_config"]

FMT = "nvfp4"
VEC_SIZE = NVFP4_BLOCK  # 16 elements share one e4m3 scale
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
# [native-kernel]
@triton.jit
def fp4_dot_scaled_kernel(
    # pointers
    a_ptr, a_scale_ptr,  # activation: packed e2m1 uint8 [M, K/2], scale bytes [M, K/VEC_SIZE] (linear)
    w_ptr, w_scale_ptr,  # weight: packed e2m1 uint8 [N, K/2], scale bytes (linear or swizzled 128x4)
    gx_ptr, gw_ptr,  # nvfp4 global scales, float32 [1] each (ALPHA_MODE == ALPHA_GLOBAL_RECIP)
    bias_ptr, c_ptr,  # bias [N], output [M, N]
    ws_ptr,  # SPLIT: fp32 workspace [split, M, N]; _twopass sums it and runs the epilogue
    # dimensions
    M, N, K, K_PER,  # K_PER: K elements per program (K unless split-K), a multiple of BLOCK_K
    # strides (the K strides are 1)
    stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
    # meta-parameters
    VEC_SIZE: tl.constexpr,  # elements per scale: 16 (nvfp4) or 32 (mxfp4)
    SCALE_E4M3: tl.constexpr,  # scale bytes are e4m3 (nvfp4: ue4m3 in the MMA) or E8M0 (mxfp4)
    W_SWIZZLED: tl.constexpr,  # weight scales in the swizzled 128x4 layout
    ALPHA_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    n_scales = K // VEC_SIZE

    # ----- K loop: acc [BLOCK_M, BLOCK_N] fp32 += (A . SA) [BLOCK_M, BLOCK_K] . (W . SW)^T
    k_lo = tl.program_id(1) * K_PER
    pdl_wait(USE_PDL)  # the quantized activation
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER, K), BLOCK_K):
        # packed bytes, two e2m1 codes each, low nibble first: [rows, BLOCK_K // 2]
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kb_ok = offs_kb < K // 2
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + offs_kb[None, :],
                    mask=m_ok[:, None] & kb_ok[None, :], other=0)
        w = tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_kb[None, :],
                    mask=n_ok[:, None] & kb_ok[None, :], other=0)
        # block scales, one per VEC_SIZE elements: [rows, BLOCK_K // VEC_SIZE] (masked: 0 x 0 = 0)
        offs_ks = k0 // VEC_SIZE + tl.arange(0, BLOCK_K // VEC_SIZE)
        ks_ok = offs_ks < n_scales
        sa = tl.load(a_scale_ptr + scale_offsets(offs_m, offs_ks, n_scales, stride_asm, False),
                     mask=m_ok[:, None] & ks_ok[None, :], other=0)
        sw = tl.load(w_scale_ptr + scale_offsets(offs_n, offs_ks, n_scales, stride_wsn, W_SWIZZLED),
                     mask=n_ok[:, None] & ks_ok[None, :], other=0)
        if SCALE_E4M3:
            sa = sa.to(tl.float8e4nv, bitcast=True)
            sw = sw.to(tl.float8e4nv, bitcast=True)
        # one block-scaled MMA per 64-deep slice; the scales never leave the instruction
        acc = tl.dot_scaled(a, sa, "e2m1", w.T, sw, "e2m1", acc)

    pdl_launch_dependents(USE_PDL)
    if SPLIT:  # a partial sum of this K range; splitk_reduce_kernel adds them, then the epilogue
        store_splitk_partial(ws_ptr, acc, tl.program_id(1), offs_m, offs_n, M, N, m_ok[:, None] & n_ok[None, :])
        return

    # ----- epilogue: global scales (nvfp4), bias, cast, masked store
    y = epilogue(acc, offs_n, n_ok, gx_ptr, gw_ptr, bias_ptr, ALPHA_MODE, HAS_BIAS, ROUND_BF16)
    c_ptrs = c_ptr + rows_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
# [/native-kernel]


# ---------------------------------------------------------------------------------------------
# Launch (shared with mxfp4): allocate, pick the tile, launch
# ---------------------------------------------------------------------------------------------
def native_tile_config(M: int, N: int, K: int, device) -> TileConfig:
    """The native kernel's tile: the SM12x table (kernels_triton._tiles) on a GPU, whole small
    problems under the interpreter (each program costs milliseconds there)."""
    if interpreting():
        return fp4_gemm_config(M, N, K, True)
    return sm12x_config("e2m1", M, N, K, sm_count(device))


# [native-launch]
def launch_fp4_dot_scaled(a, a_scale, w, w_scale, *, M, N, K, vec_size, scale_e4m3, w_swizzled, bias,
                          out_dtype, gx=None, gw=None, config: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] = dot_scaled GEMM of packed e2m1 operands (uint8 views of data and scale bytes;
    the format modules have checked them). gx, gw: float32 [1] device tensors (nvfp4) or None."""
    y = torch.empty((M, N), dtype=out_dtype, device=w.device)
    if M == 0 or N == 0:
        return y
    cfg = config or native_tile_config(M, N, K, w.device)
    n_split, k_per = splitk_plan(K, cfg)
    ws = splitk_workspace(n_split, M, N, w.device) if n_split > 1 else y
    alpha = ALPHA_GLOBAL_RECIP if gx is not None else ALPHA_NONE
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), n_split)
    fp4_dot_scaled_kernel[grid](
        a, a_scale, w, w_scale,
        gx if gx is not None else w_scale, gw if gw is not None else w_scale,
        bias if bias is not None else y, y, ws,
        M, N, K, k_per,
        a.stride(0), a_scale.stride(0), w.stride(0), 0 if w_swizzled else w_scale.stride(0), y.stride(0),
        VEC_SIZE=vec_size, SCALE_E4M3=scale_e4m3, W_SWIZZLED=w_swizzled,
        ALPHA_MODE=alpha, HAS_BIAS=bias is not None, ROUND_BF16=interpreting() and out_dtype == torch.bfloat16,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        SPLIT=n_split > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(w.device),
    )
    if n_split > 1:
        launch_splitk_reduce(ws, y, bias=bias, alpha_mode=alpha, s1=gx, s2=gw)
    return y
# [/native-launch]


# ---------------------------------------------------------------------------------------------
# The wrappers: check, allocate, launch
# ---------------------------------------------------------------------------------------------
def tile_config(M: int, N: int, K: int, path=None):
    """The W4A4 GEMM's launch configuration for an [M, K] x [N, K]^T problem on this process's
    device and ``path`` (None: gemm_path's choice), as gemm uses it (the bench reports it)."""
    dev = default_device()
    if resolve_path(path, FMT, dev) == "native":
        return native_tile_config(M, N, K, dev)
    return portable_config(M, N, K, dev, decode_kernel=True, fmt=FMT)


def _check_activation_q(xq, qweight) -> None:
    if not isinstance(xq, QuantizedTensor) or xq.role != "activation" or xq.fmt != FMT:
        got = f"a {xq.fmt} {xq.role}" if isinstance(xq, QuantizedTensor) else type(xq).__name__
        raise ValueError(f"xq must be an {FMT} activation QuantizedTensor, got {got}")
    if xq.scale_layout != "linear":
        raise ValueError(f"xq.scale_layout must be 'linear', got {xq.scale_layout!r}")
    if xq.k != qweight.k:
        raise ValueError(f"xq has K={xq.k} but qweight has K={qweight.k}")
    if xq.device != qweight.device:
        raise ValueError(f"xq must be on the weight's device {qweight.device}, got {xq.device}")


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None) -> torch.Tensor:
    """y = dequant(xq) . dequant(qweight)^T (+ bias) from NVFP4 operands (W4A4).

    Args:
        xq: NVFP4 activation [M, K] (data uint8 [M, K/2], scale e4m3 [M, K/16], global_scale).
        qweight: NVFP4 weight [N, K]; scales linear, or swizzled 128x4 on the native path.
        bias: optional float tensor [N] on the weight's device, added in fp32 in the epilogue.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
        path: None (gemm_path's choice for the weight's device), "native" or "portable".
    Returns:
        [M, N] tensor of out_dtype (fp32 accumulation, alpha = (1/g_x)(1/g_w) applied once).
    Raises:
        ValueError: wrong format/role/layout of either operand, K or device mismatch, bad bias
            shape or device, unsupported out_dtype, unknown path, or path="native" where it would
            be wrong (the interpreter) or does not compile (sm_90 with Triton < 3.7).
    """
    check_native_weight(qweight, FMT, path)
    _check_activation_q(xq, qweight)
    _check_out_dtype(out_dtype)
    N, K = qweight.shape
    check_bias(bias, N, qweight.device)
    bias = kernel_bias(bias)
    gx = xq.global_scale.reshape(1).to(torch.float32)
    gw = qweight.global_scale.reshape(1).to(torch.float32)
    a, sa = xq.data.contiguous(), xq.scale.contiguous().view(torch.uint8)
    if resolve_path(path, FMT, qweight.device) == "native":
        sw, swizzled = weight_scale_bytes(qweight, FMT, VEC_SIZE)
        return launch_fp4_dot_scaled(a, sa, qweight.data.contiguous(), sw, M=xq.rows, N=N, K=K, vec_size=VEC_SIZE,
                                     scale_e4m3=True, w_swizzled=swizzled, bias=bias, out_dtype=out_dtype,
                                     gx=gx, gw=gw)
    return launch_fp4_gemm(a, sa, qweight.data.contiguous(), qweight.scale.contiguous().view(torch.uint8),
                           M=xq.rows, N=N, K=K, group=VEC_SIZE, scale_e4m3=True, bias=bias,
                           out_dtype=out_dtype, gx=gx, gw=gw)


def gemm_w4a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x2d . dequant(qweight)^T (+ bias) with unquantized activations (W4A16), the portable
    kernel on every device (bf16 x decoded weight; gemm_path(fmt, cap, a16=True) says why).

    Args:
        x2d: bfloat16/float16 [M, K] (any strides), on the weight's device.
        qweight: NVFP4 weight [N, K] with linear-layout scales.
        bias: optional float tensor [N].
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default x2d's dtype.
    Returns:
        [M, N] tensor of out_dtype: fp32 sums of exact products, times 1/g_w once in the epilogue
        (fp16 x: split into two bf16 halves, see _fp4_gemm). On sm_90 at M <= 16 (bf16 x, the
        decode kernel's scale fold) the products are summed 2^8 smaller: below ~2^-141 (x near
        1e-38) they underflow to 0 where unfolded they were fp32 subnormals (_fp4_decode.fp4_planes).
    Raises:
        ValueError: x2d not a 2-D bf16/fp16 tensor, K not a multiple of 16 or not the weight's K,
            device mismatch, wrong weight format or layout, bad bias, unsupported out_dtype.
    """
    check_weight(qweight, FMT)
    check_activation(x2d, qweight.k, VEC_SIZE, FMT, device=qweight.device)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    out_dtype = out_dtype or x2d.dtype
    _check_out_dtype(out_dtype)
    N, K = qweight.shape
    check_bias(bias, N, qweight.device)
    bias = kernel_bias(bias)
    one = torch.ones(1, dtype=torch.float32, device=qweight.device)  # alpha = (1/1) * (1/g_w)
    return launch_fp4_gemm(
        x2d, None, qweight.data.contiguous(), qweight.scale.contiguous().view(torch.uint8),
        M=x2d.shape[0], N=N, K=K, group=VEC_SIZE, scale_e4m3=True, bias=bias, out_dtype=out_dtype,
        gx=one, gw=qweight.global_scale.reshape(1).to(torch.float32), a16=True,
    )


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, global_scale: Union[None, float, torch.Tensor] = None,
           path: Optional[str] = None) -> torch.Tensor:
    """y = x . W^T (+ bias) with NVFP4 weights: W4A4 (x quantized to NVFP4) or, with a16=True,
    W4A16 (x used as it is).

    Args:
        x: bfloat16/float16 [..., K] (any leading dims, any strides).
        qweight: NVFP4 weight QuantizedTensor [N, K] on x's device (linear scales; swizzled 128x4
            too with path="native").
        bias: optional [N] float tensor.
        a16: keep the activations in bf16/fp16 (weight-only quantization; the portable kernel).
        global_scale: static activation global scale (see quantize_activation); None = dynamic.
            Ignored with a16.
        path: None (auto for x's device), "native" or "portable" (see gemm).
    Returns:
        [..., N] tensor of x's dtype; an empty [..., N] when x has no rows.
    Raises:
        ValueError: x not bf16/fp16, K not a multiple of 16 or not the weight's K, x and weight on
            different devices, wrong weight format or layout, bad bias shape, bad global_scale,
            unknown path, path="native" with a16 or where it would be wrong.
    """
    check_native_weight(qweight, FMT, path)
    check_activation(x, qweight.k, VEC_SIZE, FMT, device=qweight.device)
    N = qweight.shape[0]
    check_bias(bias, N, qweight.device)
    if a16:
        resolve_path(path, FMT, qweight.device, a16=True)  # rejects path="native"
        y = gemm_w4a16(x.reshape(-1, x.shape[-1]), qweight, bias, out_dtype=x.dtype)
    elif (decode_applies(x.numel() // x.shape[-1], device_capability(qweight.device), False, x.dtype)
          and resolve_path(path, FMT, qweight.device) == "portable"):
        y = _linear_decode(x.reshape(-1, x.shape[-1]), qweight, bias, global_scale)
    else:
        y = gemm(quantize_activation(x, global_scale=global_scale), qweight, bias, out_dtype=x.dtype, path=path)
    return y.reshape(*x.shape[:-1], N)


def _linear_decode(x2, qweight, bias, global_scale) -> torch.Tensor:
    """W4A4 at M <= 16 on sm_90: the quantizer writes the decode GEMM's activation planes
    (quantize_planes: the codes, scales and g of quantize_activation, decoded) and
    _fp4_decode's GEMM dots them, a launch less than quantize -> act_planes_kernel -> GEMM."""
    M, K = x2.shape
    N = qweight.shape[0]
    plane_k, k_pad, dt = plane_layout(M, N, K, qweight.device, FMT)
    planes = torch.empty((M, k_pad), dtype=dt, device=x2.device)
    gx = quantize_planes(x2, planes, plane_k, global_scale=global_scale)
    return launch_fp4_decode(None, None, qweight.data.contiguous(), qweight.scale.contiguous().view(torch.uint8),
                             M=M, N=N, K=K, group=VEC_SIZE, scale_e4m3=True, bias=kernel_bias(bias),
                             out_dtype=x2.dtype, gx=gx, gw=qweight.global_scale.reshape(1).to(torch.float32),
                             planes=planes, plane_k=plane_k)
