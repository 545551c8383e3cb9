"""MXFP4 in Triton: activation quantization, the W4A4 GEMM and the W4A16 GEMM.

What MXFP4 stores (formats/mxfp4.py and formats/_mx.py are the spec and the oracle): e2m1 codes
packed two per byte along K (uint8 [rows, K/2], element 2i in the low nibble) and one E8M0 scale
byte per 32 elements (uint8 [rows, K/32]; byte b means 2^(b - 127)):

    e    = ceil(log2(div_rn(max(amax_block, FLOOR), 6)))     scale_rule="ceil" (default)
         = floor(log2(max(amax_block, FLOOR))) - 2           scale_rule="floor" (OCP MX v1.0 6.3)
    e    = clamp(e, -127, 127);  scale byte = e + 127
    code = e2m1(x * 2^-e)                                    (a power of two: exact, no division)
    x   ~= e2m1_value(code) * 2^e

Quantization (``_quantize_kernel``), one program per [BLOCK_M, BLOCK_K] tile of x:

    xb    = x tile as [BLOCK_M, BLOCK_K/32, 32] float32
    amax  = max(max|xb|, FLOOR)                                   # [BLOCK_M, BLOCK_K/32]
    e     = clamp(ceil_log2(div_rn(amax, 6)) or floor_log2(amax) - 2, -127, 127)
    codes = encode_e2m1(xb * exp2_int(-e))                        # exp2_int builds 2^-e from bits
    bytes = codes[..., 0::2] | codes[..., 1::2] << 4              # low nibble = even element

ceil_log2/floor_log2 read the fp32 exponent bits and exp2_int writes them, so the exponent is exact
on every backend (tl.exp2/tl.log2 may be approximate on GPU).

GEMM, W4A4 (``gemm``), two paths (kernels_triton._paths.gemm_path picks by device; ``path=``
forces one):

    native    nvfp4.fp4_dot_scaled_kernel with VEC_SIZE=32 and E8M0 (uint8) scales: the SM12x
              block-scaled MMA (mma.sync m16n8k64 kind::mxf4nvf4.block_scale.scale_vec::2X ue8m0)
              applies one scale per 32 elements inside the instruction. nvfp4.py walks the kernel;
              it is the same body, so the H200 and interpreter runs of this instance check the
              code that the NVFP4 instance compiles to on sm_120a.
    portable  decode in registers (_fp4_gemm.fp4_gemm_kernel with GROUP=32, E8M0 scales):

    for k0 in range(0, K, BLOCK_K):
        a = e2m1(A bytes) * 2^(A scale - 127)[:, k // 32]    # [BLOCK_M, BLOCK_K], exact in bf16
        w = e2m1(W bytes) * 2^(W scale - 127)[:, k // 32]    # [BLOCK_N, BLOCK_K]
        acc += tl.dot(a, w^T)                                # fp32 accumulation
    y = acc + bias

GEMM, W4A16 (``gemm_w4a16``, ``linear(..., a16=True)``): the activation tile is loaded as is
(bf16/fp16, any strides) instead of being decoded. bf16 activations dot directly with the bf16
decoded weights (exact products). fp16 activations: fp16 has 3 more mantissa bits than bf16, and the
decoded weights (up to 6 * 2^127) do not fit fp16's range, so neither dtype holds both operands.
On GPU each fp16 tile is split exactly into bf16 hi + lo (hi = bf16(x), lo = bf16(x - hi)) and
dotted twice into the same fp32 accumulator; in the interpreter both operands are fp32. Nothing is
rounded except the fp32 accumulation.

Constraints: K % 32 == 0; x bf16/fp16 [..., K], any leading dims and strides; weights with
linear-layout scales (formats.quantize(w, "mxfp4")). E8M0 byte 0xFF (NaN) marks a block with NaN/Inf
input (docs/formats.md) and decodes to NaN. At M <= 16 on sm_90, W4A4 and bf16 W4A16 take
_fp4_decode's swapped kernel; otherwise W4A16 takes the portable kernel on every device (gemm_path
says why).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E2M1_EMAX, E2M1_MAX, MX_BLOCK

from ._common import (
    abs_or_inf,
    ceil_log2,
    check_activation,
    check_bias,
    check_weight,
    dequantize_e2m1,
    dequantize_e8m0,
    encode_e2m1,
    exp2_int,
    floor_log2,
    interpreting,
    kernel_bias,
)
from ._e4m3_gemm import quant_config
from .hopper._fp4_decode import PLANE_DTYPES, check_quantize_planes, decode_applies, launch_fp4_decode, plane_layout, store_planes
from ._fp4_gemm import launch_fp4_gemm, portable_config
from ._paths import check_native_weight, default_device, device_capability, resolve_path, weight_scale_bytes
from .hopper._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from .nvfp4 import launch_fp4_dot_scaled, native_tile_config

FMT = "mxfp4"
VEC_SIZE = MX_BLOCK  # 32 elements share one E8M0 scale
SCALE_RULES = ("ceil", "floor")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_FLOOR = tl.constexpr(AMAX_FLOOR)
_E2M1_MAX = tl.constexpr(E2M1_MAX)  # 6.0
_E2M1_EMAX = tl.constexpr(E2M1_EMAX)  # 2: 6 = 1.5 * 2^2


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr,  # bf16/fp16 [M, K], any strides
    q_ptr, s_ptr,  # out: packed uint8 [M, K/2], E8M0 bytes uint8 [M, K/32]
    p_ptr,  # PLANE_K > 0, out instead of q and s: the decode GEMM's activation planes [M, K_PAD] (store_planes)
    # dimensions
    M, K, K_PAD,
    # strides
    stride_xm, stride_xk, stride_qm, stride_sm, stride_pm,
    # meta-parameters
    CEIL_RULE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
    PLANE_K: tl.constexpr = 0,  # 0: codes and scales; else the planes of the sm_90 decode GEMM's BLOCK_K
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_wait(USE_PDL)  # x is the previous kernel's output

    # ----- x tile [BLOCK_M, BLOCK_K] as float32 (exact for bf16/fp16)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)
    m_mask = offs_m < M
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                mask=mask, other=0.0).to(tl.float32)

    # ----- per-32 block exponent e: [BLOCK_M, BLOCK_K / 32]
    xb = x.reshape(BLOCK_M, BLOCK_K // 32, 32)
    amax = tl.max(abs_or_inf(xb), axis=2)  # +Inf marks a NaN/Inf in the block
    bad = amax > 3.4028234663852886e38
    amax = tl.maximum(amax, _FLOOR)
    if CEIL_RULE:
        e = ceil_log2(tl.math.div_rn(amax, _E2M1_MAX))
    else:
        e = floor_log2(amax) - _E2M1_EMAX
    e = tl.minimum(tl.maximum(e, -127), 127)

    # ----- element codes: e2m1(x * 2^-e); the power-of-two product is exact (or one correctly
    # rounded subnormal, like the oracle's float64 ldexp cast to float32)
    # (a bad block: NaN byte 0xFF, all codes 0; e2m1 has no NaN code)
    codes = encode_e2m1(xb * exp2_int(-e)[:, :, None])
    codes = tl.where(bad[:, :, None], 0, codes).to(tl.uint8).reshape(BLOCK_M, BLOCK_K)
    s_bytes = tl.where(bad, 0xFF, e + 127).to(tl.uint8)
    if PLANE_K:  # the decode linear: e2m1 * 2^e, exact in bf16 (_fp4_decode's docstring); NaN for a bad block
        v = dequantize_e2m1(codes).reshape(BLOCK_M, BLOCK_K // 32, 32) * dequantize_e8m0(s_bytes)[:, :, None]
        pdl_launch_dependents(USE_PDL)
        store_planes(p_ptr, v.reshape(BLOCK_M, BLOCK_K), offs_m, m_mask, pid_k * BLOCK_K, K, K_PAD, stride_pm,
                     BLOCK_M, BLOCK_K, PLANE_K)
        return

    # ----- pack two codes per byte, element 2j in the low nibble: [BLOCK_M, BLOCK_K / 2]
    even, odd = tl.split(codes.reshape(BLOCK_M, BLOCK_K // 2, 2))
    packed = even | (odd << 4)
    pdl_launch_dependents(USE_PDL)
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_kb[None, :], packed,
             mask=m_mask[:, None] & (offs_kb[None, :] < K // 2))
    offs_ks = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    tl.store(s_ptr + rows[:, None] * stride_sm + offs_ks[None, :], s_bytes,
             mask=m_mask[:, None] & (offs_ks[None, :] < K // 32))


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def _quantize_tiles(M: int, K: int, interp: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): whole small problems in the interpreter; on GPU the tiles of every
    activation quantizer (_e4m3_gemm.quant_config: one row 1024 wide per program at decode, 32 x 128
    above)."""
    if interp:
        return triton.next_power_of_2(min(max(M, 1), 256)), triton.next_power_of_2(min(K, 512))
    return quant_config(M, K, False, group=VEC_SIZE)


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    """Quantize activations to MXFP4 with the Triton kernel, bit for bit as
    ``formats.quantize(x, "mxfp4", role="activation", scale_rule=scale_rule)``.

    Args:
        x: bfloat16/float16 [..., K], K % 32 == 0, any leading dims and strides; NaN/Inf follow the non-finite rule (docs/formats.md).
        scale_rule: "ceil" (default) or "floor" (see the module docstring).
    Returns:
        QuantizedTensor(fmt="mxfp4", role="activation", data=uint8 [M, K/2], scale=uint8 E8M0
        [M, K/32], global_scale=None, shape=(M, K)), M = prod(x.shape[:-1]).
    Raises:
        ValueError: x not a bf16/fp16 tensor, K not a positive multiple of 32, unknown scale_rule.
    """
    check_activation(x, None, VEC_SIZE, FMT)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)  # a view when the strides allow; the kernel takes both strides
    M = x2.shape[0]
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((M, K // VEC_SIZE), dtype=torch.uint8, device=x.device)
    if M > 0:
        _launch_quantize(x2, scale_rule, data, scale, None, 0)
    return QuantizedTensor(FMT, "activation", data, scale, None, (1, VEC_SIZE), (M, K))


def quantize_planes(x2: torch.Tensor, planes: torch.Tensor, plane_k: int, *, scale_rule: str = "ceil") -> None:
    """The sm_90 decode linear's activation quantizer: x2 quantized as quantize_activation does (the
    same codes and scales), but written as the decode GEMM's bf16 planes (e2m1 * 2^e, exact; float32
    under the interpreter) instead of codes and scales: a launch less than quantize then
    _fp4_decode.act_planes_kernel.

    Args:
        x2: bfloat16/float16 [M, K] (any strides), K a positive multiple of 32.
        planes: out, _fp4_decode.plane_layout's [M, K_pad] tensor (K_pad = K rounded up to plane_k;
            bf16 / float32, K stride 1, on x2's device).
        plane_k: plane_layout's PLANE_K (the GEMM's BLOCK_K), a power of two >= 128.
        scale_rule: "ceil" or "floor", as quantize_activation.
    Raises:
        ValueError: as quantize_activation; x2 not 2-D; plane_k not a power of two >= 128; planes
            not that tensor (_fp4_decode.check_planes: 2-D, shape, dtype, K stride 1, device).
    """
    check_activation(x2, None, VEC_SIZE, FMT)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    check_quantize_planes(x2, planes, plane_k, 4 * VEC_SIZE, PLANE_DTYPES[FMT])
    if x2.shape[0] > 0:
        _launch_quantize(x2, scale_rule, planes, planes, planes, plane_k)


def _launch_quantize(x2, scale_rule, data, scale, planes, plane_k: int) -> None:
    """_quantize_kernel over x2 [M >= 1, K] into data and scale (plane_k 0) or planes."""
    M, K = x2.shape
    block_m, block_k = _quantize_tiles(M, K, interpreting())
    block_k = max(block_k, plane_k)  # whole plane tiles per program (both powers of two)
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    _quantize_kernel[grid](
        x2, data, scale, planes if plane_k else data, M, K, planes.shape[1] if plane_k else 0,
        x2.stride(0), x2.stride(1), data.stride(0), scale.stride(0), planes.stride(0) if plane_k else 0,
        CEIL_RULE=scale_rule == "ceil", BLOCK_M=block_m, BLOCK_K=block_k, PLANE_K=plane_k, **pdl_launch(x2.device),
    )


def tile_config(M: int, N: int, K: int, path=None):
    """The W4A4 GEMM's launch configuration for an [M, K] x [N, K]^T problem on this process's
    device and ``path`` (None: gemm_path's choice), as gemm uses it (the bench reports it)."""
    dev = default_device()
    if resolve_path(path, FMT, dev) == "native":
        return native_tile_config(M, N, K, dev)
    return portable_config(M, N, K, dev, decode_kernel=True, fmt=FMT)


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16, *, path: Optional[str] = None) -> torch.Tensor:
    """y = dequant(xq) . dequant(qweight)^T (+ bias) from MXFP4 operands (W4A4).

    Args:
        xq: MXFP4 activation [M, K] (data uint8 [M, K/2], scale uint8 E8M0 [M, K/32]).
        qweight: MXFP4 weight [N, K]; scales linear, or swizzled 128x4 on the native path.
        bias: optional float tensor [N] on the weight's device, added in fp32 in the epilogue.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
        path: None (gemm_path's choice for the weight's device), "native" or "portable".
    Returns:
        [M, N] tensor of out_dtype (fp32 accumulation).
    Raises:
        ValueError: wrong format/role/layout of either operand, K or device mismatch, bad bias
            shape or device, unsupported out_dtype, unknown path.
    """
    check_native_weight(qweight, FMT, path)
    if not isinstance(xq, QuantizedTensor) or xq.role != "activation" or xq.fmt != FMT:
        got = f"a {xq.fmt} {xq.role}" if isinstance(xq, QuantizedTensor) else type(xq).__name__
        raise ValueError(f"xq must be an {FMT} activation QuantizedTensor, got {got}")
    if xq.scale_layout != "linear":
        raise ValueError(f"xq.scale_layout must be 'linear', got {xq.scale_layout!r}")
    if xq.k != qweight.k:
        raise ValueError(f"xq has K={xq.k} but qweight has K={qweight.k}")
    if xq.device != qweight.device:
        raise ValueError(f"xq must be on the weight's device {qweight.device}, got {xq.device}")
    _check_out_dtype(out_dtype)
    N, K = qweight.shape
    check_bias(bias, N, qweight.device)
    bias = kernel_bias(bias)
    a, sa = xq.data.contiguous(), xq.scale.contiguous()
    # [native-call]
    if resolve_path(path, FMT, qweight.device) == "native":
        # nvfp4's kernel with one E8M0 (uint8) scale per 32 and no global scale
        sw, swizzled = weight_scale_bytes(qweight, FMT, VEC_SIZE)
        return launch_fp4_dot_scaled(a, sa, qweight.data.contiguous(), sw, M=xq.rows, N=N, K=K, vec_size=VEC_SIZE,
                                     scale_e4m3=False, w_swizzled=swizzled, bias=bias, out_dtype=out_dtype)
    # [/native-call]
    return launch_fp4_gemm(
        a, sa, qweight.data.contiguous(), qweight.scale.contiguous(),
        M=xq.rows, N=N, K=K, group=VEC_SIZE, scale_e4m3=False, bias=bias, out_dtype=out_dtype,
    )


def gemm_w4a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x2d . dequant(qweight)^T (+ bias) with unquantized activations (W4A16).

    Args:
        x2d: bfloat16/float16 [M, K] (any strides), on the weight's device.
        qweight: MXFP4 weight [N, K] with linear-layout scales.
        bias: optional float tensor [N].
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default x2d's dtype.
    Returns:
        [M, N] tensor of out_dtype. Products are exact (see the module docstring for fp16).
    Raises:
        ValueError: x2d not a 2-D bf16/fp16 tensor, K not a multiple of 32 or not the weight's K,
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
    return launch_fp4_gemm(
        x2d, None, qweight.data.contiguous(), qweight.scale.contiguous(),
        M=x2d.shape[0], N=N, K=K, group=VEC_SIZE, scale_e4m3=False, bias=bias, out_dtype=out_dtype,
        a16=True,
    )


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, scale_rule: str = "ceil", path: Optional[str] = None) -> torch.Tensor:
    """y = x . W^T (+ bias) with MXFP4 weights: W4A4 (activations quantized to MXFP4 by
    quantize_activation) or, with ``a16=True``, W4A16 (activations used as they are).

    Args:
        x: bfloat16/float16 [..., K] (any leading dims, any strides).
        qweight: MXFP4 weight QuantizedTensor [N, K], linear-layout scales, on x's device.
        bias: optional [N] float tensor.
        a16: keep the activations in bf16/fp16 (weight-only quantization).
        scale_rule: activation scale rule for W4A4, "ceil" or "floor" (ignored with a16).
        path: None (auto for x's device), "native" or "portable" (see gemm; W4A16 is portable).
    Returns:
        [..., N] tensor of x's dtype; an empty [..., N] when x has no rows.
    Raises:
        ValueError: x not bf16/fp16, K not a multiple of 32 or not the weight's K, x and weight on
            different devices, wrong weight format or layout, bad bias shape, unknown scale_rule,
            unknown path, path="native" with a16.
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
        y = _linear_decode(x.reshape(-1, x.shape[-1]), qweight, bias, scale_rule)
    else:
        y = gemm(quantize_activation(x, scale_rule=scale_rule), qweight, bias, out_dtype=x.dtype, path=path)
    return y.reshape(*x.shape[:-1], N)


def _linear_decode(x2, qweight, bias, scale_rule) -> torch.Tensor:
    """W4A4 at M <= 16 on sm_90 (linear has checked the operands): the quantizer writes the decode
    GEMM's planes (quantize_planes: quantize_activation's codes and scales, decoded) and
    _fp4_decode's GEMM dots them, a launch less than quantize -> act_planes_kernel -> GEMM."""
    M, K = x2.shape
    N = qweight.shape[0]
    plane_k, k_pad, dt = plane_layout(M, N, K, qweight.device, FMT)
    planes = torch.empty((M, k_pad), dtype=dt, device=x2.device)
    quantize_planes(x2, planes, plane_k, scale_rule=scale_rule)
    return launch_fp4_decode(None, None, qweight.data.contiguous(), qweight.scale.contiguous(), M=M, N=N, K=K,
                             group=VEC_SIZE, scale_e4m3=False, bias=kernel_bias(bias), out_dtype=x2.dtype,
                             planes=planes, plane_k=plane_k)
