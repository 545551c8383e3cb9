"""NVFP4 (W4A4) on SM120/SM121 through b12x's serialized ``blockscaled.mm_nvfp4``.

**Strategy.** y = x . W^T with both operands NVFP4 (formats/nvfp4.py):

    xq = kernels_cute.quant (default) or kernels_triton quantizer:  codes uint8 [M, K/2], e4m3 [M, K/16], g_x
    sfa = xq.scale, flat 128x4-swizzled (the CuTe quantizer writes it so; Triton's is swizzled after)
    y  = mm_nvfp4(xq.data, sfa, W.data, W.scale_swz, alpha, plan=cap plan)   fp32 accumulation
         alpha = (1 / g_x) * (1 / g_w)                        (float32 [1], on the device)
    y += bias                                                 (fp32 sum, one more rounding)

**Why our quantizer, not b12x's.** b12x's activation quantizers compute the block scale as
``e4m3(amax * (1/6) * g)`` (the Triton ``_quantize`` of packed ``mm`` and the CuTe
``quantization.nvfp4``, which also needs M % 128 and K % 128); the oracle and kernels_triton compute
``e4m3(div_rn(amax, 6) * g)``. ``1/6`` is inexact in fp32, so the two can land on different sides of
an e4m3 rounding boundary and give different codes. The Triton quantizer is bit-exact with the
oracle (tests/kernels_triton), and so is ours in CuTe DSL (kernels_cute/quant, any M): the CuTe path
uses ours (``quantizer="triton"`` for the Triton one) and then swizzles the scales.

**Capability.** SM120/SM121 with b12x==1.5.1 (``blockscaled.is_supported()``).

**Shapes and limits.** K % 128 == 0 and N % 8 == 0 (b12x's ``_validate_fixed_query`` for serialized
NVFP4); any M >= 0. x bf16/fp16 [..., K]; the output has x's dtype.

**Notes.** The serialized route has no A16 branch: it computes W4A4 at every M, including M <= 8
where b12x's packed ``mm`` with ``activation_mode='auto'`` would silently run W4A16.

**References.** formats/nvfp4.py (spec, oracle); kernels_triton/nvfp4.py (numerics source of truth);
b12x/gemm/blockscaled/api.py::mm_nvfp4.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

import torch

from formats import QuantizedTensor, swizzle_128x4

from . import _common as C

FMT = "nvfp4"
K_MULTIPLE = 128
N_MULTIPLE = 8
VEC_SIZE = 16


def supported(M: int, N: int, K: int) -> tuple[bool, str]:
    """Shape support of the serialized NVFP4 GEMM (device gating is kernels_cute.supported's)."""
    return C.check_alignment(FMT, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


def cap_for(cap: int, K: int) -> int:
    return cap


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    """The b12x declaration of an M <= cap call (the same one compile checks use)."""
    return C.blockscaled().FixedBlockscaledQuery(
        recipe=FMT, call_kind="serialized", max_rows=cap, in_features=K, padded_in_features=K,
        out_features=N, input_dtype="uint8", output_dtype=out_dtype, expected_m=None, alpha_mode="tensor")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """NVFP4 weight [N, K] -> codes uint8 [N, K/2] (as stored) + flat swizzled e4m3 scales + g_w [1].

    Runs on any device (pure torch). ``into``: a weight prepared before with the same shape; its
    storage is overwritten and it is returned (CUDA graphs that captured it stay valid).
    Raises ValueError for a wrong format/layout, or ``a16`` (W4A16 is an MXFP4 variant only).
    """
    if a16:
        raise ValueError("nvfp4 has no W4A16 variant here (only mxfp4_w4a16)")
    C.check_qweight(qweight, FMT)
    new = C.CuteWeight(FMT, tuple(qweight.shape), qweight.data.contiguous(), swizzle_128x4(qweight.scale),
                       qweight.global_scale.reshape(1).to(torch.float32).contiguous())
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, global_scale: Union[None, float, torch.Tensor] = None,
                        quantizer: str = C.DEFAULT_QUANTIZER) -> QuantizedTensor:
    """NVFP4 activation quantization, bit-exact with the oracle, scales in the swizzled layout:
    QuantizedTensor(data uint8 [M, K/2], scale float8_e4m3fn flat swizzled, global_scale f32 0-d,
    scale_layout="swizzled_128x4").
    ``quantizer``: "cute" (default: our CuTe DSL kernels, kernels_cute/quant) or "triton"
    (kernels_triton); bit for bit the same result. The CuTe kernel writes the swizzled layout directly.
    """
    if C.check_quantizer(quantizer) == "cute":
        from .quant import quantize_activation_cute

        return quantize_activation_cute(x, FMT, global_scale=global_scale, swizzled=True)
    from kernels_triton import nvfp4 as tri

    xq = tri.quantize_activation(x, global_scale=global_scale)
    return replace(xq, scale=swizzle_128x4(xq.scale), scale_layout="swizzled_128x4")


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           global_scale: Union[None, float, torch.Tensor] = None, a16: bool = False,
           quantizer: str = C.DEFAULT_QUANTIZER) -> torch.Tensor:
    """y = x . W^T (+ bias), W4A4 at every M. x bf16/fp16 [..., K] -> [..., N] of x's dtype."""
    if a16:
        raise ValueError("nvfp4 has no W4A16 variant here (only mxfp4_w4a16)")
    N, K = prepared.shape
    x2 = C.flatten_activation(x, K, FMT)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty((*x.shape[:-1], N))
    plan, _ = C.plan_for_call(FMT, M, N, K, x.dtype, x.device, make_query, cap_for)
    xq = quantize_activation(x2, global_scale=global_scale, quantizer=quantizer)
    alpha = (torch.reciprocal(xq.global_scale.reshape(1).float()) * torch.reciprocal(prepared.global_scale))
    y = C.blockscaled().mm_nvfp4(xq.data, xq.scale, prepared.data, prepared.scale, alpha,
                                  plan=plan, out_dtype=x.dtype)
    return C.add_bias(y, bias, N).reshape(*x.shape[:-1], N)
