"""NVFP4 on Hopper (sm_90): the production kernels, as an implementation of their own.

The readable NVFP4 kernels are kernels_triton.nvfp4 (the lesson: quantizer, portable and native
GEMMs, on every device). Hopper has no block-scaled MMA, and at decode sizes the lesson's portable
kernel leaves most of the H200 idle, so this module launches other kernels, with the same
arithmetic (every product exact, fp32 accumulation; only the order of the fp32 additions differs):

    M <= 16    the swapped-wgmma decode GEMM (hopper._fp4_decode): the weight dequantized in
               registers as wgmma's A operand, nibble planes, fp16 operands (value * 2^-14) for
               W4A4, the bf16 W4A16 scale fold, split-K; for W4A4 the quantizer writes the
               activation planes the GEMM dots (hopper._nvfp4_quant.quantize_planes)
    M <= 128   the fused dequantize-in-registers kernel with split-K (hopper._fp4_gemm)
    M > 128    the pre-pass (each operand dequantized once into bf16) and a bf16 GEMM

and every kernel of the chain launches with PDL (hopper._pdl). ``route`` (hopper._fp4_route)
decides which, once; ``linear``, ``gemm`` and ``gemm_w4a16`` execute exactly that route.

Constraints: sm_90 only (``supported``); K % 16 == 0; weights with linear-layout scales; x
bf16/fp16 [..., K], any leading dims and strides.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import triton

from formats import QuantizedTensor
from formats.constants import NVFP4_BLOCK

from .._common import check_activation, check_bias, check_gemm_operands, check_out_dtype, check_weight, kernel_bias
from ..tuning import int_specialization
from ._route import Route
from ._fp4_decode import launch_fp4_decode, plane_layout
from ._fp4_gemm import launch_fp4_gemm
from ._fp4_route import device_plan, plan, supported
from ._nvfp4_quant import amax_partials, quantize_activation, quantize_planes

__all__ = ["gemm", "gemm_w4a16", "linear", "quantize_activation", "route", "supported"]

FMT = "nvfp4"
VEC_SIZE = NVFP4_BLOCK  # 16 elements share one e4m3 scale
_QUANTIZER = {True: ("_amax_partial_kernel", "_quantize_kernel"), False: ("_quantize_kernel",)}


def route(M: int, N: int, K: int, *, capability, sm_count: int, a16: bool = False,
          x_dtype: torch.dtype = torch.bfloat16, dynamic_scale: bool = True) -> Route:
    """The kernels ``linear`` launches for x [M, K] (``x_dtype``) and a weight [N, K] on a device of
    ``capability`` with ``sm_count`` SMs, their tile and why (hopper._fp4_route has the rules).

    Args:
        M, N, K: the problem (M = prod(x.shape[:-1])).
        capability: (9, x); sm_count: the device's SMs (split-K targets).
        a16: W4A16 (x used as it is). x_dtype: torch.bfloat16 or torch.float16.
        dynamic_scale: W4A4 with the dynamic global scale (an amax kernel first); False for a
            static global_scale.
    Returns:
        Route(impl="hopper", kernels, tile, split_k, why).
    Raises:
        ValueError: capability not sm_90, a negative dimension, sm_count < 1, another x_dtype.
    """
    p = plan(FMT, M, N, K, capability=capability, sm_count=sm_count, a16=a16, x_dtype=x_dtype,
             quantizer=_QUANTIZER[bool(dynamic_scale)])
    r = p.route
    if "_amax_partial_kernel" in r.kernels:  # the quantize kernel's M-derived ints (one compile per class)
        n = amax_partials(M, K, p.config.BLOCK_K if p.kind == "decode_planes" else 0, False)
        r = dataclasses.replace(r, options=r.options + (
            ("num_partials", int_specialization(n)), ("BLOCK_P", max(16, triton.next_power_of_2(n)))))
    return r


def _device_plan(M, N, K, device, *, a16, x_dtype, quantizer):
    return device_plan(FMT, M, N, K, device, a16=a16, x_dtype=x_dtype, quantizer=quantizer)


def _weight_operands(qweight):
    return (qweight.data.contiguous(), qweight.scale.contiguous().view(torch.uint8),
            qweight.global_scale.reshape(1).to(torch.float32))


def gemm(xq: QuantizedTensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = dequant(xq) . dequant(qweight)^T (+ bias) from NVFP4 operands (W4A4) on sm_90.

    Args:
        xq: NVFP4 activation [M, K] (data uint8 [M, K/2], scale e4m3 [M, K/16], global_scale).
        qweight: NVFP4 weight [N, K], linear-layout scales, on an sm_90 device.
        bias: optional float tensor [N] (any float dtype) on the weight's device.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
    Returns:
        [M, N] tensor of out_dtype (fp32 accumulation of exact products, alpha = (1/g_x)(1/g_w)).
    Raises:
        ValueError: wrong format/role/layout of either operand, K or device mismatch, a device that
            is not sm_90, bad bias, unsupported out_dtype.
    """
    M, N, K = check_gemm_operands(xq, qweight, bias, out_dtype, FMT)
    p = _device_plan(M, N, K, qweight.device, a16=False, x_dtype=torch.bfloat16, quantizer=())
    w, sw, gw = _weight_operands(qweight)
    a, sa = xq.data.contiguous(), xq.scale.contiguous().view(torch.uint8)
    gx = xq.global_scale.reshape(1).to(torch.float32)
    common = dict(M=M, N=N, K=K, group=VEC_SIZE, scale_e4m3=True, bias=kernel_bias(bias), out_dtype=out_dtype,
                  gx=gx, gw=gw, config=p.config)
    if p.kind == "decode":
        return launch_fp4_decode(a, sa, w, sw, **common)
    if p.kind == "none":
        return torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    return launch_fp4_gemm(a, sa, w, sw, **common)


def gemm_w4a16(x2d: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x2d . dequant(qweight)^T (+ bias) with unquantized activations (W4A16) on sm_90.

    Args:
        x2d: bfloat16/float16 [M, K] (any strides), on the weight's device.
        qweight: NVFP4 weight [N, K] with linear-layout scales.
        bias: optional float tensor [N].
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default x2d's dtype.
    Returns:
        [M, N] tensor of out_dtype: fp32 sums of exact products, times 1/g_w once. At M <= 16 with
        bf16 x (the decode GEMM's scale fold, hopper._fp4_decode.fp4_planes) the products are summed
        2^8 smaller: below ~2^-141 (x near 1e-38) they underflow to 0 where unfolded they were fp32
        subnormals.
    Raises:
        ValueError: x2d not a 2-D bf16/fp16 tensor, K not a multiple of 16 or not the weight's K,
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
    w, sw, gw = _weight_operands(qweight)
    one = torch.ones(1, dtype=torch.float32, device=qweight.device)  # alpha = (1/1) * (1/g_w)
    common = dict(M=M, N=N, K=K, group=VEC_SIZE, scale_e4m3=True, bias=kernel_bias(bias), out_dtype=out_dtype,
                  gx=one, gw=gw, a16=True, config=p.config)
    if p.kind == "decode":
        return launch_fp4_decode(x2d, None, w, sw, **common)
    if p.kind == "none":
        return torch.empty((M, N), dtype=out_dtype, device=qweight.device)
    return launch_fp4_gemm(x2d, None, w, sw, **common)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           a16: bool = False, global_scale: Union[None, float, torch.Tensor] = None) -> torch.Tensor:
    """y = x . W^T (+ bias) with NVFP4 weights on sm_90: W4A4 (x quantized to NVFP4) or, with
    a16=True, W4A16 (x used as it is); the kernels of ``route`` for this call, exactly.

    Args:
        x: bfloat16/float16 [..., K] (any leading dims, any strides).
        qweight: NVFP4 weight QuantizedTensor [N, K] (linear scales) on x's device, an sm_90 GPU.
        bias: optional [N] float tensor (any float dtype).
        a16: keep the activations in bf16/fp16 (weight-only quantization).
        global_scale: static activation global scale (see quantize_activation); None = dynamic.
            Ignored with a16.
    Returns:
        [..., N] tensor of x's dtype; an empty [..., N] when x has no rows.
    Raises:
        ValueError: x not bf16/fp16, K not a multiple of 16 or not the weight's K, x and weight on
            different devices, a device that is not sm_90, wrong weight format or layout, bad bias
            shape, bad global_scale.
    """
    check_weight(qweight, FMT)
    check_activation(x, qweight.k, VEC_SIZE, FMT, device=qweight.device)
    N, K = qweight.shape
    check_bias(bias, N, qweight.device)
    x2 = x.reshape(-1, K)
    if a16:
        return gemm_w4a16(x2, qweight, bias, out_dtype=x.dtype).reshape(*x.shape[:-1], N)
    M = x2.shape[0]
    p = _device_plan(M, N, K, qweight.device, a16=False, x_dtype=x.dtype,
                     quantizer=_QUANTIZER[global_scale is None])
    if p.kind == "decode_planes":
        y = _linear_decode(x2, qweight, bias, global_scale, p.config)
    elif p.kind == "none":
        if M:
            quantize_activation(x2, global_scale=global_scale)
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        xq = quantize_activation(x2, global_scale=global_scale)
        w, sw, gw = _weight_operands(qweight)
        y = launch_fp4_gemm(xq.data, xq.scale.view(torch.uint8), w, sw, M=M, N=N, K=K, group=VEC_SIZE,
                            scale_e4m3=True, bias=kernel_bias(bias), out_dtype=x.dtype,
                            gx=xq.global_scale.reshape(1), gw=gw, config=p.config)
    return y.reshape(*x.shape[:-1], N)


def _linear_decode(x2, qweight, bias, global_scale, config=None) -> torch.Tensor:
    """W4A4 at M <= 16 (the route's "decode_planes"; linear has checked the operands): the quantizer
    writes the decode GEMM's activation planes (quantize_planes: the codes, scales and g of
    quantize_activation, dequantized) and hopper._fp4_decode's GEMM dots them. config: the route's
    tile (None: decode_config's for the device; under the interpreter its plain-op form runs)."""
    M, K = x2.shape
    N = qweight.shape[0]
    plane_k, k_pad, dt = plane_layout(M, N, K, qweight.device, FMT, config=config)
    planes = torch.empty((M, k_pad), dtype=dt, device=x2.device)
    gx = quantize_planes(x2, planes, plane_k, global_scale=global_scale)
    w, sw, gw = _weight_operands(qweight)
    return launch_fp4_decode(None, None, w, sw, M=M, N=N, K=K, group=VEC_SIZE, scale_e4m3=True,
                             bias=kernel_bias(bias), out_dtype=x2.dtype, gx=gx, gw=gw, config=config,
                             planes=planes, plane_k=plane_k)
