"""MXFP8 (W8A8) on SM120/SM121 through b12x's packed MXFP8 GEMM with prequantized activations
(``blockscaled.pack_weight(w, e8m0)`` -> ``MXFP8LinearWeight``; ``blockscaled.mm((values, scales), w)``).

**Strategy.**

    xq  = kernels_cute.quant MXFP8 quantizer              e4m3 [M, K], E8M0 bytes written straight
                                                          into the flat 128x4-swizzled layout
    y   = mm((xq.data, sfa), W_packed, plan=cap plan)     block-scaled e4m3 MMA, fp32 accumulation
    y  += bias                                            (fp32 sum, one more rounding)

``gemm(xq, prepared)`` takes an activation quantized elsewhere (formats.quantize, the Triton
quantizer: linear scales, swizzled there with ``formats.swizzle_128x4``).

**Why prequantized, not b12x's bf16 path.** b12x's bf16 route quantizes inside b12x (CuTe
``mxfp8_rows``, scale ``pow2_ceil_ue8m0(amax * (1/448))``). Through b12x's own torch twin
(``pow2_ceil_ue8m0_torch``) that rule gives the oracle's scale byte for every positive bf16 and fp16
amax (exhaustive check in tests/kernels_cute/test_contract.py), but an all-zero block gets byte 0
there and the amax floor's byte (19) in the oracle, so its codes are not the oracle's; and that route
needs a different plan type (the bf16 precision contract, ``activation_mode='quantized'`` to avoid
A16 at M <= 8). Our CuTe DSL quantizer (kernels_cute/quant/mxfp8.py) is bit-exact with the oracle,
zero blocks included, and is fed as a prequantized pair: the packed fixed plan has no A16 branch,
so it is W8A8 at every M.

**Capability.** SM120/SM121 with b12x==1.5.1 (``gemm.mxfp8_linear.is_supported()``). **Shapes and
limits.** K % 128 == 0 (b12x pads weights with K % 32 to 128, but then wants padded activations; we
do not pad) and N % 8 == 0. ``pack_weight`` needs CUDA tensors.

**References.** formats/mxfp8.py, kernels_cute/quant/mxfp8.py, b12x/gemm/blockscaled/_linear.py::
pack_mxfp8_linear_weight / mxfp8_linear.
"""

from __future__ import annotations

from typing import Optional

import torch

from formats import QuantizedTensor

from . import _common as C

FMT = "mxfp8"
B12X_GATE = "b12x.gemm.mxfp8_linear"  # the b12x module whose is_supported() gates this entry point on the running GPU
B12X_GEMM = "mm"  # the b12x.gemm.blockscaled function the W4A4 / W8A8 GEMM calls (what route() reports)
K_MULTIPLE = 128
N_MULTIPLE = 8


def supported(M: int, N: int, K: int) -> tuple[bool, str]:
    return C.check_alignment(FMT, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


cap_for = C.same_cap  # b12x plans any row capacity here


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    return C.fixed_query(cap, N, K, out_dtype, recipe=FMT, call_kind="packed", input_dtype="float8_e4m3fn",
                         source_scale_form="swizzled")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """MXFP8 weight [N, K] (CUDA) -> b12x MXFP8LinearWeight (b12x swizzles the E8M0 scales).

    Takes linear or swizzled_128x4 scales (unswizzled here: pack_weight wants the [N, K/32] matrix).
    Raises ValueError for a malformed weight (formats.validate, values included), a CPU weight
    (b12x's pack_weight checks for CUDA), or a16.
    """
    if a16:
        raise ValueError("mxfp8 W8A16 is not exposed here (the formats define it as W8A8)")
    C.check_qweight(qweight, FMT)
    if qweight.device.type != "cuda":
        raise ValueError("kernels_cute.mxfp8.prepare_weight needs a CUDA weight (b12x pack_weight)")
    data = qweight.data.contiguous()
    scale = C.linear_scale(qweight).contiguous()
    new = C.CuteWeight(FMT, tuple(qweight.shape), data, scale, packed=C.blockscaled().pack_weight(data, scale))
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
        prepared: this module's prepare_weight result. bias: optional float [N] on its device.
        out_dtype: bfloat16 (default) or float16.
    Returns:
        [M, N] of out_dtype from the packed prequantized ``mm`` (+ bias).
    Raises:
        ValueError: a malformed xq (formats.validate), K or device mismatch, bad bias or out_dtype.
    """

    return _gemm(xq, prepared, bias, out_dtype, checked=True)


def _gemm(xq, prepared, bias, out_dtype, *, checked: bool) -> torch.Tensor:
    def mm(plan, out_dtype):
        return getattr(C.blockscaled(), B12X_GEMM)((xq.data.contiguous(), C.swizzled_scale(xq)), prepared.packed,
                                  plan=plan, out_dtype=out_dtype)

    return C.run_gemm(FMT, xq, prepared, bias, out_dtype, make_query, cap_for, mm, checked=checked)


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           scale_rule: str = "ceil", a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias), W8A8 at every M: our quantizer, then gemm().
    x bf16/fp16 [..., K] -> [..., N] of x's dtype."""
    if a16:
        raise ValueError("mxfp8 W8A16 is not exposed here")
    return _linear(x, prepared, bias, scale_rule, checked=True)


def linear_unchecked(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
                     scale_rule: str = "ceil", a16: bool = False) -> torch.Tensor:
    """:func:`linear` minus its argument checks (x, bias and the options, for a caller that made
    them at its own door: dispatch's bound call). The same kernels and output, bit for bit."""
    return _linear(x, prepared, bias, scale_rule, checked=False)


def _linear(x, prepared, bias, scale_rule, *, checked: bool) -> torch.Tensor:
    def rows(x2):
        xq = C.quantize_cute(x2, FMT, checked=checked, scale_rule=scale_rule, swizzled=True)
        return _gemm(xq, prepared, bias, x.dtype, checked=checked)

    return C.run_linear(FMT, x, prepared, bias, rows, checked=checked)
