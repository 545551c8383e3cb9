"""MXFP4 on Hopper (sm_90): the production kernels, as an implementation of their own.

The readable MXFP4 kernels are kernels_triton.mxfp4 (the lesson: quantizer, portable and native
GEMMs, on every device). Here, with the same arithmetic (every product exact, fp32 accumulation;
only the order of the fp32 additions differs):

    M <= 16    the swapped-wgmma decode GEMM (hopper._fp4_decode): the weight dequantized in
               registers as wgmma's A operand, nibble planes, bf16 operands (E8M0 scales exceed
               fp16), split-K; for W4A4 the quantizer below writes the activation planes the GEMM
               dots (``quantize_planes``), for bf16 W4A16 act_planes_kernel lays out x
    M <= 128   the fused dequantize-in-registers kernel with split-K (hopper._fp4_gemm)
    M > 128    the pre-pass (each operand dequantized once into bf16) and a bf16 GEMM

and every kernel of the chain launches with PDL (hopper._pdl). ``route`` (hopper._fp4_route)
decides which, once; ``linear``, ``gemm`` and ``gemm_w4a16`` execute exactly that route.

The quantizer is the lesson's (kernels_triton.mxfp4 walks it: E8M0 exponent by bit arithmetic,
e2m1 codes, two per byte), with PDL, the GPU tiles of every activation quantizer, and the variant
that writes the decode GEMM's planes (PLANE_K > 0) instead of codes and scales.

Constraints: sm_90 only (``supported``); K % 32 == 0; weights with linear-layout scales; x
bf16/fp16 [..., K], any leading dims and strides.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, E2M1_EMAX, E2M1_MAX, MX_BLOCK

from .._codecs import (abs_or_inf, ceil_log2, dequantize_e2m1, dequantize_e8m0, encode_e2m1, exp2_int,
                       floor_log2)
from .._common import (check_activation, check_bias, check_gemm_operands, check_out_dtype, check_weight, interpreting,
                       kernel_bias, launch)
from ..tuning import quant_config
from ._route import Route
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ._fp4_decode import PLANE_DTYPES, check_quantize_planes, launch_fp4_decode, plane_layout, store_planes
from ._fp4_gemm import launch_fp4_gemm
from ._fp4_route import device_plan, plan, supported

__all__ = ["gemm", "gemm_w4a16", "linear", "quantize_activation", "quantize_planes", "route", "supported"]

FMT = "mxfp4"
VEC_SIZE = MX_BLOCK  # 32 elements share one E8M0 scale
SCALE_RULES = ("ceil", "floor")
_QUANTIZER = ("_quantize_kernel",)

_FLOOR = tl.constexpr(AMAX_FLOOR)
_E2M1_MAX = tl.constexpr(E2M1_MAX)  # 6.0
_E2M1_EMAX = tl.constexpr(E2M1_EMAX)  # 2: 6 = 1.5 * 2^2


# ---------------------------------------------------------------------------------------------
# The quantizer
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
# The quantizer's host code
# ---------------------------------------------------------------------------------------------
def _quantize_tiles(M: int, K: int, interp: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): whole small problems in the interpreter; on GPU the tiles of every
    activation quantizer (tuning.quant_config: one row 1024 wide per program at decode, 32 x 128
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
    hopper._fp4_decode.act_planes_kernel.

    Args:
        x2: bfloat16/float16 [M, K] (any strides), K a positive multiple of 32.
        planes: out, hopper._fp4_decode.plane_layout's [M, K_pad] tensor (K_pad = K rounded up to plane_k;
            bf16 / float32, K stride 1, on x2's device).
        plane_k: plane_layout's PLANE_K (the GEMM's BLOCK_K), a power of two >= 128.
        scale_rule: "ceil" or "floor", as quantize_activation.
    Raises:
        ValueError: as quantize_activation; x2 not 2-D; plane_k not a power of two >= 128; planes
            not that tensor (hopper._fp4_decode.check_planes: 2-D, shape, dtype, K stride 1, device).
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
    launch(
        _quantize_kernel, grid, x2, data, scale, planes if plane_k else data, M, K, planes.shape[1] if plane_k else 0,
        x2.stride(0), x2.stride(1), data.stride(0), scale.stride(0), planes.stride(0) if plane_k else 0,
        CEIL_RULE=scale_rule == "ceil", BLOCK_M=block_m, BLOCK_K=block_k, PLANE_K=plane_k, **pdl_launch(x2.device),
    )


# ---------------------------------------------------------------------------------------------
# The route and the wrappers
# ---------------------------------------------------------------------------------------------
def route(M: int, N: int, K: int, *, capability, sm_count: int, a16: bool = False,
          x_dtype: torch.dtype = torch.bfloat16) -> Route:
    """The kernels ``linear`` launches for x [M, K] (``x_dtype``) and a weight [N, K] on a device of
    ``capability`` with ``sm_count`` SMs, their tile and why (hopper._fp4_route has the rules).

    Args:
        M, N, K: the problem (M = prod(x.shape[:-1])).
        capability: (9, x); sm_count: the device's SMs (split-K targets).
        a16: W4A16 (x used as it is). x_dtype: torch.bfloat16 or torch.float16.
    Returns:
        Route(impl="hopper", kernels, tile, split_k, why).
    Raises:
        ValueError: capability not sm_90, a negative dimension, sm_count < 1, another x_dtype.
    """
    return plan(FMT, M, N, K, capability=capability, sm_count=sm_count, a16=a16, x_dtype=x_dtype,
                quantizer=_QUANTIZER).route


def _device_plan(M, N, K, device, *, a16, x_dtype, quantizer):
    return device_plan(FMT, M, N, K, device, a16=a16, x_dtype=x_dtype, quantizer=quantizer)


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = dequant(xq) . dequant(qweight)^T (+ bias) from MXFP4 operands (W4A4) on sm_90.

    Args:
        xq: MXFP4 activation [M, K] (data uint8 [M, K/2], scale uint8 E8M0 [M, K/32]).
        qweight: MXFP4 weight [N, K], linear-layout scales, on an sm_90 device.
        bias: optional float tensor [N] (any float dtype) on the weight's device.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
    Returns:
        [M, N] tensor of out_dtype (fp32 accumulation of exact products).
    Raises:
        ValueError: wrong format/role/layout of either operand, K or device mismatch, a device that
            is not sm_90, bad bias, unsupported out_dtype.
    """
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    p = _device_plan(M, N, K, qweight.device, a16=False, x_dtype=torch.bfloat16, quantizer=())
    if p.kind == "none":
        return torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    launcher = launch_fp4_decode if p.kind == "decode" else launch_fp4_gemm
    return launcher(xq.data.contiguous(), xq.scale.contiguous(), qweight.data.contiguous(), qweight.scale.contiguous(),
                    M=M, N=N, K=K, group=VEC_SIZE, scale_e4m3=False, bias=kernel_bias(bias), out_dtype=out_dtype,
                    config=p.config)


def gemm_w4a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x2d . dequant(qweight)^T (+ bias) with unquantized activations (W4A16) on sm_90.

    Args:
        x2d: bfloat16/float16 [M, K] (any strides), on the weight's device.
        qweight: MXFP4 weight [N, K] with linear-layout scales.
        bias: optional float tensor [N].
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default x2d's dtype.
    Returns:
        [M, N] tensor of out_dtype; exact products, fp32 accumulation (fp16 x: exact hi/lo bf16
        halves, hopper._fp4_gemm).
    Raises:
        ValueError: x2d not a 2-D bf16/fp16 tensor, K not a multiple of 32 or not the weight's K,
            device mismatch or not sm_90, wrong weight format or layout, bad bias, bad out_dtype.
    """
    check_weight(qweight, FMT)
    check_activation(x2d, qweight.k, VEC_SIZE, FMT, device=qweight.device)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    out_dtype = out_dtype or x2d.dtype
    check_out_dtype(out_dtype)
    N, K = qweight.shape
    check_bias(bias, N, qweight.device)
    M = x2d.shape[0]
    p = _device_plan(M, N, K, qweight.device, a16=True, x_dtype=x2d.dtype, quantizer=())
    if p.kind == "none":
        return torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    launcher = launch_fp4_decode if p.kind == "decode" else launch_fp4_gemm
    return launcher(x2d, None, qweight.data.contiguous(), qweight.scale.contiguous(), M=M, N=N, K=K, group=VEC_SIZE,
                    scale_e4m3=False, bias=kernel_bias(bias), out_dtype=out_dtype, a16=True, config=p.config)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, scale_rule: str = "ceil") -> torch.Tensor:
    """y = x . W^T (+ bias) with MXFP4 weights on sm_90: W4A4 (x quantized to MXFP4) or, with
    a16=True, W4A16 (x used as it is); the kernels of ``route`` for this call, exactly.

    Args:
        x: bfloat16/float16 [..., K] (any leading dims, any strides).
        qweight: MXFP4 weight QuantizedTensor [N, K] (linear scales) on x's device, an sm_90 GPU.
        bias: optional [N] float tensor (any float dtype).
        a16: keep the activations in bf16/fp16 (weight-only quantization).
        scale_rule: activation scale rule for W4A4, "ceil" or "floor" (ignored with a16).
    Returns:
        [..., N] tensor of x's dtype; an empty [..., N] when x has no rows.
    Raises:
        ValueError: x not bf16/fp16, K not a multiple of 32 or not the weight's K, x and weight on
            different devices, a device that is not sm_90, wrong weight format or layout, bad bias
            shape, unknown scale_rule.
    """
    check_weight(qweight, FMT)
    check_activation(x, qweight.k, VEC_SIZE, FMT, device=qweight.device)
    N, K = qweight.shape
    check_bias(bias, N, qweight.device)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    x2 = x.reshape(-1, K)
    if a16:
        return gemm_w4a16(x2, qweight, bias, out_dtype=x.dtype).reshape(*x.shape[:-1], N)
    M = x2.shape[0]
    p = _device_plan(M, N, K, qweight.device, a16=False, x_dtype=x.dtype, quantizer=_QUANTIZER)
    if p.kind == "decode_planes":
        y = _linear_decode(x2, qweight, bias, scale_rule, p.config)
    elif p.kind == "none":
        if M:
            quantize_activation(x2, scale_rule=scale_rule)
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        xq = quantize_activation(x2, scale_rule=scale_rule)
        y = launch_fp4_gemm(xq.data, xq.scale, qweight.data.contiguous(), qweight.scale.contiguous(), M=M, N=N, K=K,
                            group=VEC_SIZE, scale_e4m3=False, bias=kernel_bias(bias), out_dtype=x.dtype,
                            config=p.config)
    return y.reshape(*x.shape[:-1], N)


def _linear_decode(x2, qweight, bias, scale_rule, config=None) -> torch.Tensor:
    """W4A4 at M <= 16 (the route's "decode_planes"; linear has checked the operands): the quantizer
    writes the decode GEMM's activation planes (quantize_planes: quantize_activation's codes and
    scales, dequantized) and hopper._fp4_decode's GEMM dots them. config: the route's tile (None:
    decode_config's for the device; under the interpreter its plain-op form runs)."""
    M, K = x2.shape
    N = qweight.shape[0]
    plane_k, k_pad, dt = plane_layout(M, N, K, qweight.device, FMT, config=config)
    planes = torch.empty((M, k_pad), dtype=dt, device=x2.device)
    quantize_planes(x2, planes, plane_k, scale_rule=scale_rule)
    return launch_fp4_decode(None, None, qweight.data.contiguous(), qweight.scale.contiguous(), M=M, N=N, K=K,
                             group=VEC_SIZE, scale_e4m3=False, bias=kernel_bias(bias), out_dtype=x2.dtype,
                             config=config, planes=planes, plane_k=plane_k)
