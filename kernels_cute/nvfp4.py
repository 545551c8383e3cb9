"""NVFP4 on SM120/SM121: W4A4 through b12x's serialized ``blockscaled.mm_nvfp4``, and W4A16
(``a16=True``) through b12x's packed A16 GEMM (``pack_weight(..., recipe="nvfp4")`` + ``mm(x_bf16, w,
required_mode="a16")``).

**Strategy, W4A4.** y = x . W^T with both operands NVFP4 (formats/nvfp4.py):

    xq = kernels_cute.quant quantizer:  codes uint8 [M, K/2], e4m3 scales written straight into the
                                        flat 128x4-swizzled layout (sfa), g_x float32
    y  = mm_nvfp4(xq.data, sfa, W.data, W.scale_swz, alpha, plan=cap plan)   fp32 accumulation
         alpha = (1 / g_x) * W.inv_global_scale              (float32 [1], on the device, no sync;
                                                              1 / g_w is cached at prepare)
    y += bias                                                 (fp32 sum, one more rounding)

``gemm(xq, prepared)`` takes an activation quantized elsewhere (formats.quantize, the Triton
quantizer: linear scales, swizzled there with ``formats.swizzle_128x4``).

**Strategy, W4A16.** Activations stay bf16 (formats: ``reference_linear(..., a16=True)``):

    W_packed = pack_weight(W.data, W.scale_swz, recipe="nvfp4", global_scale=g_w,
                           global_scale_kind="reciprocal")    (w = e2m1 * e4m3 / g_w; borrowed tensors)
    y = mm(x_bf16, W_packed, plan=A16 cap plan, required_mode="a16")   dequantized in the kernel
    y += bias

The A16 plan is a ``BlockscaledQuery(activation_mode="a16", num_tokens=cap, expected_m=None)``,
served for any M <= cap like the W4A4 plans (b12x's run-time check is ``M <= num_tokens``).
b12x's A16 kernel reads bf16 only (its ``_query_bf16_from_call`` refuses fp16) and writes bf16.

**Why our quantizer, not b12x's.** b12x's activation quantizers compute the block scale as
``e4m3(amax * (1/6) * g)`` (the Triton ``_quantize`` of packed ``mm`` and the CuTe
``quantization.nvfp4``, which also needs M % 128 and K % 128); the oracle computes
``e4m3(div_rn(amax, 6) * g)``. ``1/6`` is inexact in fp32, so the two can land on different sides of
an e4m3 rounding boundary and give different codes. Ours in CuTe DSL (kernels_cute/quant, any M) is
bit-exact with the oracle.

**Capability.** SM120/SM121 with b12x==1.5.1 (``blockscaled.is_supported()``).

**Shapes and limits.** K % 128 == 0 and N % 8 == 0 (b12x's ``_validate_fixed_query`` for serialized
NVFP4; the same is required of the A16 route here, as b12x states it for packed NVFP4 calls); any
M >= 0. W4A4: x bf16/fp16 [..., K], output of x's dtype. W4A16: x bf16 only, bf16 output;
``prepare_weight(a16=True)`` needs a CUDA weight (b12x's pack_weight checks for it).

**Notes.** The serialized route has no A16 branch: it computes W4A4 at every M, including M <= 8
where b12x's packed ``mm`` with ``activation_mode='auto'`` would silently run W4A16. The A16 route
is W4A16 only when asked for (``a16=True``, the "nvfp4_w4a16" variant).

**References.** formats/nvfp4.py (spec, oracle); kernels_cute/quant/nvfp4.py;
b12x/gemm/blockscaled/api.py::mm_nvfp4, _a16.py::pack_nvfp4_weight, _linear.py::blockscaled_mm.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from formats import QuantizedTensor

from . import _common as C

FMT = "nvfp4"
B12X_GATE = "b12x.gemm.blockscaled"  # the b12x module whose is_supported() gates this entry point on the running GPU
B12X_GEMM = "mm_nvfp4"  # the b12x.gemm.blockscaled function the W4A4 / W8A8 GEMM calls (what route() reports)
A16_GEMM = "mm"  # the b12x.gemm.blockscaled function the W4A16 GEMM calls
A16_GATE = "b12x.gemm.blockscaled"  # nvfp4_w4a16: b12x's A16 route
K_MULTIPLE = 128
N_MULTIPLE = 8
VEC_SIZE = 16


A16_DTYPE = torch.bfloat16  # b12x's A16 kernel reads and writes bf16 only


def supported(M: int, N: int, K: int, *, a16: bool = False, dtype: Optional[torch.dtype] = None) -> tuple[bool, str]:
    """Shape (and, for a16, activation dtype) support; device gating is kernels_cute.supported's."""
    name = "nvfp4_w4a16" if a16 else FMT
    if a16 and dtype is not None and dtype != A16_DTYPE:
        return False, f"{name}: b12x's A16 kernel takes bfloat16 activations only, got {dtype}"
    return C.check_alignment(name, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


cap_for = C.same_cap  # b12x plans any row capacity here


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    """The b12x declaration of a W4A4 M <= cap call (the same one compile checks use)."""
    return C.fixed_query(cap, N, K, out_dtype, recipe=FMT, call_kind="serialized", input_dtype="uint8",
                         alpha_mode="tensor")


def make_query_a16(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    """The b12x declaration of a W4A16 M <= cap call (bf16 in and out; ``out_dtype`` must be bf16)."""
    if out_dtype != "bfloat16":
        raise ValueError(f"nvfp4_w4a16: b12x's A16 kernel writes bfloat16 only, got {out_dtype}")
    return C.blockscaled().BlockscaledQuery(
        recipe=FMT, num_tokens=cap, in_features=K, padded_in_features=K, out_features=N,
        activation_mode="a16", global_scale_kind="reciprocal", expected_m=None)


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """NVFP4 weight [N, K] -> codes uint8 [N, K/2] (as stored) + flat swizzled e4m3 scales + g_w [1]
    + 1/g_w [1] (cached for the per-call alpha); with ``a16`` also b12x's NVFP4LinearWeight.

    W4A4: any device (pure torch). ``a16=True``: a CUDA weight (b12x's pack_weight). ``into``: a
    weight prepared before with the same shape and route; its storage is overwritten and it is
    returned (CUDA graphs that captured it stay valid).
    Raises ValueError for a malformed weight (formats.validate, values included: g_w finite, > 0),
    or a16 with a CPU weight.
    """
    C.check_qweight(qweight, FMT)
    g = qweight.global_scale.reshape(1).contiguous()
    new = C.CuteWeight(FMT, tuple(qweight.shape), qweight.data.contiguous(), C.swizzled_scale(qweight), g,
                       torch.reciprocal(g), a16=a16)
    if a16:
        if qweight.device.type != "cuda":
            raise ValueError("kernels_cute.nvfp4.prepare_weight(a16=True) needs a CUDA weight (b12x pack_weight)")
        packed = C.blockscaled().pack_weight(new.data, new.scale, recipe=FMT, global_scale=new.global_scale,
                                             global_scale_kind="reciprocal")
        new = C.CuteWeight(FMT, new.shape, new.data, new.scale, new.global_scale, new.inv_global_scale,
                           packed=packed, a16=True)
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, global_scale: Union[None, float, torch.Tensor] = None) -> QuantizedTensor:
    """NVFP4 activation quantization with our CuTe DSL kernel (kernels_cute/quant), bit-exact with
    the oracle: QuantizedTensor(data uint8 [M, K/2], scale float8_e4m3fn flat swizzled, global_scale
    f32 0-d, scale_layout="swizzled_128x4"); the kernel writes the swizzled layout directly."""
    return C.quantize_cute(x, FMT, global_scale=global_scale, swizzled=True)


def gemm(xq: QuantizedTensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = dequant(xq) . W^T (+ bias), W4A4, on an already quantized activation.

    Args:
        xq: nvfp4 activation [M, K] (codes, e4m3 scales linear or swizzled_128x4, g_x), from any
            quantizer; linear scales are swizzled here.
        prepared: this module's prepare_weight result (W4A4). bias: optional float [N] on its device.
        out_dtype: bfloat16 (default) or float16.
    Returns:
        [M, N] of out_dtype from ``mm_nvfp4`` with alpha = (1/g_x) * (1/g_w) (+ bias).
    Raises:
        ValueError: a malformed xq (formats.validate), K or device mismatch, bad bias or out_dtype,
            an A16-prepared weight.
    """
    if prepared.a16:
        raise ValueError("gemm() takes a W4A4 weight; this one was prepared with a16=True (use linear(a16=True))")
    return _gemm(xq, prepared, bias, out_dtype, checked=True)


def _gemm(xq, prepared, bias, out_dtype, *, checked: bool) -> torch.Tensor:
    def mm(plan, out_dtype):
        alpha = torch.reciprocal(xq.global_scale.reshape(1)) * prepared.inv_global_scale
        b12x_gemm = getattr(C.blockscaled(), B12X_GEMM)
        return b12x_gemm(xq.data.contiguous(), C.swizzled_scale(xq), prepared.data, prepared.scale,
                         alpha, plan=plan, out_dtype=out_dtype)

    return C.run_gemm(FMT, xq, prepared, bias, out_dtype, make_query, cap_for, mm, checked=checked)


def _linear_a16(x2: torch.Tensor, prepared: C.CuteWeight) -> torch.Tensor:
    """b12x's A16 GEMM on bf16 [M, K] (M >= 1): contiguous, 16-byte aligned, as the plan declares."""
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    N, K = prepared.shape
    plan, _ = C.plan_for_call("nvfp4_w4a16", x2.shape[0], N, K, x2.dtype, x2.device, make_query_a16, cap_for)
    return getattr(C.blockscaled(), A16_GEMM)(x2, prepared.packed, plan=plan, required_mode="a16")


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           global_scale: Union[None, float, torch.Tensor] = None, a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias). W4A4 at every M (our quantizer, then gemm()); with ``a16=True`` W4A16
    (x bf16 only; the weight must be prepared with a16=True). x [..., K] -> [..., N] of x's dtype.

    Raises ValueError for a malformed x or bias (formats.validate), a16 not matching the prepared
    weight, fp16 x with a16, or ``global_scale`` with a16 (W4A16 does not quantize activations).
    """
    if a16 != prepared.a16:
        raise ValueError(f"a16={a16} but the weight was prepared with a16={prepared.a16}; prepare it with "
                         f"kernels_cute.nvfp4.prepare_weight(q, a16={a16})")
    if a16 and global_scale is not None:
        raise ValueError("global_scale is an activation option of W4A4; nvfp4_w4a16 keeps x in bf16")
    if a16 and isinstance(x, torch.Tensor) and x.dtype == torch.float16:  # the A16 kernel reads bf16 only
        raise ValueError(f"nvfp4_w4a16: x must be bfloat16 (b12x's A16 kernel), got {x.dtype}")
    return _linear(x, prepared, bias, global_scale, checked=True)


def linear_unchecked(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
                     global_scale: Union[None, float, torch.Tensor] = None, a16: bool = False) -> torch.Tensor:
    """:func:`linear` minus its argument checks (x, bias and the options, for a caller that made
    them at its own door: dispatch's bound call). The same kernels and output, bit for bit."""
    return _linear(x, prepared, bias, global_scale, checked=False)


def _linear(x, prepared, bias, global_scale, *, checked: bool) -> torch.Tensor:
    def rows(x2):
        if prepared.a16:
            return C.add_bias(_linear_a16(x2, prepared), bias)
        xq = C.quantize_cute(x2, FMT, checked=checked, global_scale=global_scale, swizzled=True)
        return _gemm(xq, prepared, bias, x.dtype, checked=checked)

    return C.run_linear(FMT, x, prepared, bias, rows, checked=checked)
