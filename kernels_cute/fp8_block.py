"""Block FP8 (1x128 activations, 128x128 weights, fp32 scales) on SM120/SM121 through b12x's
serialized ``blockscaled.mm_block_fp8``.

**Strategy.** DeepGEMM-style, as formats/fp8_block.py specifies:

    xq = kernels_cute.quant quantizer                         e4m3 [M, K], fp32 sx [M, K/128]
    y  = mm_block_fp8(xq.data, sx, W.data, sw [N/128, K/128], plan=cap plan)
         (each 128-deep K step: e4m3 MMA, then acc += partial * sx * sw in fp32)
    y += bias                                                 (fp32 sum, one more rounding)

b12x has no 1x128 activation quantizer, so ours in CuTe DSL (kernels_cute/quant, bit-exact with the
oracle) is used; ``gemm(xq, prepared)`` takes one quantized elsewhere. The compact row-major fp32
scales are what ``mm_block_fp8`` takes, no swizzle. ``gemm.block_fp8_linear``
is deliberately *not* used: it requantizes the scales to UE8M0 and runs MXFP8 (different numbers).

**Split-K.** For some decode shapes b12x splits K and sums the slices with bf16 atomics, so the
output may differ from Triton's by more than one rounding and is not bit-reproducible (vllm#54996);
the SM12x sweep allows ||d||/||ref|| <= 3e-3 and cosine >= 0.99999 for that reason.

**Capability.** SM120/SM121 with b12x==1.5.1. **Shapes and limits.** K % 128 == 0 and N % 128 == 0
(b12x; the oracle allows a partial last weight block, b12x does not), any M. ``ue8m0`` passes through
to the activation quantizer.

**References.** formats/fp8_block.py, kernels_cute/quant/fp8_block.py,
b12x/gemm/blockscaled/api.py::mm_block_fp8.
"""

from __future__ import annotations

from typing import Optional

import torch

from formats import QuantizedTensor

from . import _common as C

FMT = "fp8_block"
B12X_GATE = "b12x.gemm.blockscaled"  # the b12x module whose is_supported() gates this entry point on the running GPU
B12X_GEMM = "mm_block_fp8"  # the b12x.gemm.blockscaled function the W4A4 / W8A8 GEMM calls (what route() reports)
K_MULTIPLE = 128
N_MULTIPLE = 128


def supported(M: int, N: int, K: int) -> tuple[bool, str]:
    return C.check_alignment(FMT, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


cap_for = C.same_cap  # b12x plans any row capacity here


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    return C.fixed_query(cap, N, K, out_dtype, recipe="block_fp8", call_kind="serialized", input_dtype="float8_e4m3fn",
                         alpha_mode="unit")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """Block-FP8 weight [N, K] -> e4m3 [N, K] + fp32 [N/128, K/128], both contiguous (any device).

    Raises ValueError for a malformed weight (formats.validate, values included; 128x128 blocks) or a16.
    """
    if a16:
        raise ValueError("fp8_block has no W8A16 variant here")
    C.check_qweight(qweight, FMT)
    new = C.CuteWeight(FMT, tuple(qweight.shape), qweight.data.contiguous(), qweight.scale.contiguous())
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, ue8m0: bool = False) -> QuantizedTensor:
    """1x128 block-FP8 activation quantization with our CuTe DSL kernels (kernels_cute/quant),
    bit-exact with the oracle: e4m3 [M, K] and fp32 [M, K/128] compact scales (b12x's layout)."""
    return C.quantize_cute(x, FMT, ue8m0=ue8m0)


def gemm(xq: QuantizedTensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = dequant(xq) . W^T (+ bias) on an already quantized activation.

    Args:
        xq: fp8_block activation [M, K] (e4m3 data, fp32 [M, K/128] scales), from any quantizer.
        prepared: this module's prepare_weight result. bias: optional float [N] on its device.
        out_dtype: bfloat16 (default) or float16.
    Returns:
        [M, N] of out_dtype from ``mm_block_fp8`` (+ bias).
    Raises:
        ValueError: a malformed xq (formats.validate), K or device mismatch, bad bias or out_dtype.
    """

    return _gemm(xq, prepared, bias, out_dtype, checked=True)


def _gemm(xq, prepared, bias, out_dtype, *, checked: bool) -> torch.Tensor:
    def mm(plan, out_dtype):
        b12x_gemm = getattr(C.blockscaled(), B12X_GEMM)
        return b12x_gemm(xq.data.contiguous(), xq.scale.contiguous(), prepared.data, prepared.scale,
                         plan=plan, out_dtype=out_dtype)

    return C.run_gemm(FMT, xq, prepared, bias, out_dtype, make_query, cap_for, mm, checked=checked)


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           ue8m0: bool = False, a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias), W8A8 at every M: our quantizer, then gemm().
    x bf16/fp16 [..., K] -> [..., N] of x's dtype."""
    if a16:
        raise ValueError("fp8_block has no W8A16 variant here")
    return _linear(x, prepared, bias, ue8m0, checked=True)


def linear_unchecked(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
                     ue8m0: bool = False, a16: bool = False) -> torch.Tensor:
    """:func:`linear` minus its argument checks (x, bias and the options, for a caller that made
    them at its own door: dispatch's bound call). The same kernels and output, bit for bit."""
    return _linear(x, prepared, bias, ue8m0, checked=False)


def _linear(x, prepared, bias, ue8m0, *, checked: bool) -> torch.Tensor:
    def rows(x2):
        xq = C.quantize_cute(x2, FMT, checked=checked, ue8m0=ue8m0)
        return _gemm(xq, prepared, bias, x.dtype, checked=checked)

    return C.run_linear(FMT, x, prepared, bias, rows, checked=checked)
