"""MXFP8 on SM120/SM121: W8A8 through b12x's packed MXFP8 GEMM with prequantized activations
(``blockscaled.pack_weight(w, e8m0)`` -> ``MXFP8LinearWeight``; ``blockscaled.mm((values, scales), w)``),
and W8A16 (``a16=True``, the "mxfp8_w8a16" variant: bf16 activations) through b12x's
``blockscaled.w8a16`` on the same packed weight.

**Strategy.**

    xq  = kernels_cute.quant MXFP8 quantizer              e4m3 [M, K], E8M0 bytes written straight
                                                          into the flat 128x4-swizzled layout
    y   = mm((xq.data, sfa), W_packed, plan=cap plan)     block-scaled e4m3 MMA, fp32 accumulation
    y  += bias                                            (fp32 sum, one more rounding)

``gemm(xq, prepared)`` takes an activation quantized elsewhere (formats.quantize, the Triton
quantizer: linear scales, swizzled there with ``formats.swizzle_128x4``).

**Strategy, W8A16.** Activations stay bf16 (formats: ``reference_linear(..., a16=True)``):

    W_packed = pack_weight(W.data, W.scale)                 (the same MXFP8LinearWeight as W8A8)
    y = w8a16(x_bf16, W_packed.weight.values, W_packed.weight.scale_mma, plan=A16 cap plan)
        (the weight's e4m3 codes times their E8M0 scales dequantized in the kernel, bf16 MMA,
         fp32 accumulation; no activation scaling)
    y += bias

The A16 plan is a ``BlockscaledQuery(recipe="mxfp8", activation_mode="a16", num_tokens=cap,
expected_m=None)``, served for any M <= cap (b12x's run-time check is ``M <= num_tokens``). b12x's
packed BF16 route reads bf16 only (``_query_bf16_from_call`` refuses fp16) and writes bf16.

**Why prequantized, not b12x's bf16 path.** b12x's bf16 route quantizes inside b12x (CuTe
``mxfp8_rows``, scale ``pow2_ceil_ue8m0(amax * (1/448))``). Through b12x's own torch twin
(``pow2_ceil_ue8m0_torch``) that rule gives the oracle's scale byte for every positive bf16 and fp16
amax (exhaustive check in tests/kernels_cute/test_contract.py), but an all-zero block gets byte 0
there and the amax floor's byte (19) in the oracle, so its codes are not the oracle's; and that route
needs a different plan type (the bf16 precision contract, ``activation_mode='quantized'`` to avoid
A16 at M <= 8). Our CuTe DSL quantizer (kernels_cute/quant/mxfp8.py) is bit-exact with the oracle,
zero blocks included, and is fed as a prequantized pair: the packed fixed plan has no A16 branch,
so it is W8A8 at every M.

**Capability.** SM120/SM121 with b12x==1.5.1 (``gemm.mxfp8_linear.is_supported()``; W8A16:
``blockscaled.is_supported()``). **Shapes and limits.** K % 128 == 0 (b12x pads weights with K % 32
to 128, but then wants padded activations; we do not pad) and N % 8 == 0; W8A16: bf16 in and out.
``pack_weight`` needs CUDA tensors.

**References.** formats/mxfp8.py, kernels_cute/quant/mxfp8.py, b12x/gemm/blockscaled/_linear.py::
pack_mxfp8_linear_weight / mxfp8_linear; b12x/gemm/blockscaled/_a16.py::w8a16.
"""

from __future__ import annotations

from typing import Optional

import torch

from formats import QuantizedTensor

from . import _common as C

FMT = "mxfp8"
B12X_GATE = "b12x.gemm.mxfp8_linear"  # the b12x module whose is_supported() gates this entry point on the running GPU
B12X_GEMM = "mm"  # the b12x.gemm.blockscaled function the W4A4 / W8A8 GEMM calls (what route() reports)
A16_GEMM = "w8a16"  # the b12x.gemm.blockscaled function the W8A16 GEMM calls
A16_GATE = "b12x.gemm.blockscaled"  # mxfp8_w8a16: b12x's A16 route
A16_NAME = "mxfp8_w8a16"
A16_DTYPE = torch.bfloat16  # b12x's A16 kernels read and write bf16 only
K_MULTIPLE = 128
N_MULTIPLE = 8


def supported(M: int, N: int, K: int, *, a16: bool = False, dtype: Optional[torch.dtype] = None) -> tuple[bool, str]:
    """Shape (and, for a16, activation dtype) support; device gating is kernels_cute.supported's."""
    name = A16_NAME if a16 else FMT
    if a16 and dtype is not None and dtype != A16_DTYPE:
        return False, f"{name}: b12x's A16 kernel takes bfloat16 activations only, got {dtype}"
    return C.check_alignment(name, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


cap_for = C.same_cap  # b12x plans any row capacity here


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    return C.fixed_query(cap, N, K, out_dtype, recipe=FMT, call_kind="packed", input_dtype="float8_e4m3fn",
                         source_scale_form="swizzled")


def make_query_a16(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    """The b12x declaration of a W8A16 M <= cap call (bf16 in and out; ``out_dtype`` must be bf16)."""
    if out_dtype != "bfloat16":
        raise ValueError(f"{A16_NAME}: b12x's A16 kernel writes bfloat16 only, got {out_dtype}")
    return C.blockscaled().BlockscaledQuery(
        recipe=FMT, num_tokens=cap, in_features=K, padded_in_features=K, out_features=N,
        activation_mode="a16", expected_m=None)


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """MXFP8 weight [N, K] (CUDA) -> b12x MXFP8LinearWeight (b12x swizzles the E8M0 scales), for
    W8A8 or, with ``a16``, W8A16 (the same packed weight; ``a16`` records the route).

    Takes linear or swizzled_128x4 scales (unswizzled here: pack_weight wants the [N, K/32] matrix).
    ``into``: a weight prepared before with the same shape and route; its storage is overwritten
    and it is returned (CUDA graphs that captured it stay valid).
    Raises ValueError for a malformed weight (formats.validate, values included) or a CPU weight
    (b12x's pack_weight checks for CUDA).
    """
    C.check_qweight(qweight, FMT)
    if qweight.device.type != "cuda":
        raise ValueError("kernels_cute.mxfp8.prepare_weight needs a CUDA weight (b12x pack_weight)")
    data = qweight.data.contiguous()
    scale = C.linear_scale(qweight).contiguous()
    new = C.CuteWeight(FMT, tuple(qweight.shape), data, scale, packed=C.blockscaled().pack_weight(data, scale),
                       a16=a16)
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    """MXFP8 activation quantization with our CuTe DSL kernel (kernels_cute/quant/mxfp8.py),
    bit-exact with the oracle: e4m3 [M, K], E8M0 bytes flat in the 128x4 swizzled layout
    (scale_layout="swizzled_128x4", what the GEMM reads)."""
    return C.quantize_cute(x, FMT, scale_rule=scale_rule, swizzled=True)


def gemm(xq: QuantizedTensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = dequant(xq) . W^T (+ bias) on an already quantized activation.

    Args:
        xq: mxfp8 activation [M, K] (e4m3 data, E8M0 bytes linear [M, K/32] or swizzled_128x4),
            from any quantizer; linear scales are swizzled here.
        prepared: this module's prepare_weight result (W8A8). bias: optional float [N] on its device.
        out_dtype: bfloat16 (default) or float16.
    Returns:
        [M, N] of out_dtype from the packed prequantized ``mm`` (+ bias).
    Raises:
        ValueError: a malformed xq (formats.validate), K or device mismatch, bad bias or out_dtype,
            an A16-prepared weight.
    """
    if prepared.a16:
        raise ValueError("gemm() takes a W8A8 weight; this one was prepared with a16=True (use linear(a16=True))")

    return _gemm(xq, prepared, bias, out_dtype, checked=True)


def _gemm(xq, prepared, bias, out_dtype, *, checked: bool) -> torch.Tensor:
    def mm(plan, out_dtype):
        return getattr(C.blockscaled(), B12X_GEMM)((xq.data.contiguous(), C.swizzled_scale(xq)), prepared.packed,
                                  plan=plan, out_dtype=out_dtype)

    return C.run_gemm(FMT, xq, prepared, bias, out_dtype, make_query, cap_for, mm, checked=checked)


def _linear_a16(x2: torch.Tensor, prepared: C.CuteWeight) -> torch.Tensor:
    """b12x's W8A16 GEMM on bf16 [M, K] (M >= 1): contiguous, 16-byte aligned, as the plan declares."""
    if x2.dtype != A16_DTYPE:
        raise ValueError(f"{A16_NAME}: x must be bfloat16 (b12x's A16 kernel), got {x2.dtype}")
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    N, K = prepared.shape
    plan, _ = C.plan_for_call(A16_NAME, x2.shape[0], N, K, x2.dtype, x2.device, make_query_a16, cap_for)
    rows = prepared.packed.weight  # b12x's MXFP8Rows: e4m3 values and the MMA view of the E8M0 scales
    return getattr(C.blockscaled(), A16_GEMM)(x2, rows.values, rows.scale_mma, plan=plan)


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           scale_rule: str = "ceil", a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias). W8A8 at every M (our quantizer, then gemm()); with ``a16=True`` W8A16
    (x bf16 only; the weight must be prepared with a16=True). x [..., K] -> [..., N] of x's dtype.

    Raises ValueError for a malformed x or bias (formats.validate), a16 not matching the prepared
    weight, fp16 x with a16, or a ``scale_rule`` other than the default with a16 (W8A16 quantizes
    no activation).
    """
    if a16 != prepared.a16:
        raise ValueError(f"a16={a16} but the weight was prepared with a16={prepared.a16}; prepare it with "
                         f"kernels_cute.mxfp8.prepare_weight(q, a16={a16})")
    if a16 and scale_rule != "ceil":
        raise ValueError(f"scale_rule is an activation option of W8A8; {A16_NAME} keeps x in bf16")
    return _linear(x, prepared, bias, scale_rule, a16, checked=True)


def linear_unchecked(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
                     scale_rule: str = "ceil", a16: bool = False) -> torch.Tensor:
    """:func:`linear` minus its argument checks (x, bias and the options, for a caller that made
    them at its own door: dispatch's bound call). The same kernels and output, bit for bit."""
    return _linear(x, prepared, bias, scale_rule, a16, checked=False)


def _linear(x, prepared, bias, scale_rule, a16, *, checked: bool) -> torch.Tensor:
    def rows(x2):
        if a16:
            return C.add_bias(_linear_a16(x2, prepared), bias)
        xq = C.quantize_cute(x2, FMT, checked=checked, scale_rule=scale_rule, swizzled=True)
        return _gemm(xq, prepared, bias, x.dtype, checked=checked)

    return C.run_linear(FMT, x, prepared, bias, rows, checked=checked)
