"""MXFP4 (W4A4) on SM120/SM121 through b12x's serialized ``blockscaled.mm_mxfp4``.

**Strategy.** y = x . W^T with both operands MXFP4 (formats/mxfp4.py):

    xq  = kernels_cute.quant quantizer   codes uint8 [M, K/2], E8M0 bytes written straight into the
                                         flat 128x4-swizzled layout (sfa)
    y   = mm_mxfp4(xq.data, sfa, W.data, W.scale_swz, plan=cap plan)   fp32 accumulation, no alpha
    y  += bias                                          (fp32 sum, one more rounding)

b12x ships no MXFP4 activation quantizer, so ours in CuTe DSL (kernels_cute/quant, bit-exact with the
oracle) is used. ``gemm(xq, prepared)`` takes an activation quantized elsewhere (linear scales are
swizzled there with ``formats.swizzle_128x4``).

**The tile_k=256 bug, routed around.** b12x 1.5.1's ``_select_fp4_tile_k`` (written for NVFP4)
also picks tile_k=256 for MXFP4 when the planned M is <= 128 and K >= 4096, and that lowering fails
to compile ("Expected source and destination tensors to have the same rank, but got 3 and 4", the
scale-factor ``cute.copy`` in dense_gemm.py). b12x plans tiles from the plan's row capacity
(``max_rows``, with ``expected_m=None``), so for K >= 4096 we never plan a capacity below
``TILE_K256_MAX_M + 1`` = 129: every M <= 129 runs on the capacity-129 plan, which lowers to
tile_k=128 (64x128 tiles) and compiles. Calls with M <= 129 still pass b12x's run-time check
(M <= max_rows); nothing is padded. tests/kernels_cute/test_compile_sm12x.py pins both halves: our
plans compile, and b12x's own default plan for such a cell still fails with that message (so we
notice when b12x fixes it and the workaround can go).

**W4A16.** b12x 1.5.1 has no A16 (bf16-activation) kernel for MXFP4 weights (its ``w4a16`` is
NVFP4-only, ``w8a16`` MXFP8-only), so the ``mxfp4_w4a16`` variant is not supported here; the
dispatcher routes it to Triton.

**Capability.** SM120/SM121 with b12x==1.5.1. **Shapes and limits.** K % 256 == 0, N % 8 == 0, any M.

**References.** formats/mxfp4.py, kernels_cute/quant/mxfp4.py, b12x/gemm/blockscaled/api.py::mm_mxfp4,
b12x/_lib/dense_gemm.py::_select_fp4_tile_k.
"""

from __future__ import annotations

from typing import Optional

import torch

from formats import QuantizedTensor

from . import _common as C

FMT = "mxfp4"
B12X_GATE = "b12x.gemm.blockscaled"  # the b12x module whose is_supported() gates this entry point on the running GPU
B12X_GEMM = "mm_mxfp4"  # the b12x.gemm.blockscaled function the W4A4 / W8A8 GEMM calls (what route() reports)
K_MULTIPLE = 256
N_MULTIPLE = 8
VEC_SIZE = 32
TILE_K256_MAX_M = 128  # b12x picks tile_k=256 for a planned M <= this ...
TILE_K256_MIN_K = 4096  # ... when K >= this (and K % 256 == 0)
A16_UNSUPPORTED = ("b12x 1.5.1 has no W4A16 kernel for MXFP4 weights (w4a16 is NVFP4-only, w8a16 "
                   "MXFP8-only); mxfp4_w4a16 runs on Triton")


def supported(M: int, N: int, K: int, *, a16: bool = False) -> tuple[bool, str]:
    if a16:
        return False, f"mxfp4_w4a16: {A16_UNSUPPORTED}"
    ok, why = C.check_alignment(FMT, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)
    if ok and K >= TILE_K256_MIN_K and M <= TILE_K256_MAX_M + 1:
        why += (f"; planned at capacity {TILE_K256_MAX_M + 1} to avoid b12x 1.5.1's MXFP4 tile_k=256 "
                "compile bug")
    return ok, why


def cap_for(cap: int, K: int) -> int:
    """The row capacity to plan for ``cap`` rows: at least 129 when K >= 4096 (see the docstring)."""
    if K >= TILE_K256_MIN_K and cap <= TILE_K256_MAX_M:
        return TILE_K256_MAX_M + 1
    return cap


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    """The b12x declaration of an M <= cap call. Callers pass ``cap_for(cap, K)`` as ``cap``."""
    return C.fixed_query(cap, N, K, out_dtype, recipe=FMT, call_kind="serialized", input_dtype="uint8",
                         alpha_mode="unit")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """MXFP4 weight [N, K] (linear or swizzled scales) -> codes uint8 [N, K/2] + flat swizzled E8M0
    bytes (any device).

    Raises ValueError for a malformed weight (formats.validate, values included) or ``a16=True``
    (see A16_UNSUPPORTED)."""
    if a16:
        raise ValueError(f"kernels_cute.mxfp4: {A16_UNSUPPORTED}")
    C.check_qweight(qweight, FMT)
    new = C.CuteWeight(FMT, tuple(qweight.shape), qweight.data.contiguous(), C.swizzled_scale(qweight))
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    """MXFP4 activation quantization with our CuTe DSL kernel (kernels_cute/quant), bit-exact with
    the oracle; the E8M0 bytes are written in the swizzled layout (scale_layout="swizzled_128x4")."""
    return C.quantize_cute(x, FMT, scale_rule=scale_rule, swizzled=True)


def gemm(xq: QuantizedTensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = dequant(xq) . W^T (+ bias) on an already quantized activation.

    Args:
        xq: mxfp4 activation [M, K] (codes uint8 [M, K/2], E8M0 bytes linear or swizzled_128x4),
            from any quantizer; linear scales are swizzled here.
        prepared: this module's prepare_weight result. bias: optional float [N] on its device.
        out_dtype: bfloat16 (default) or float16.
    Returns:
        [M, N] of out_dtype from ``mm_mxfp4`` (+ bias).
    Raises:
        ValueError: a malformed xq (formats.validate), K or device mismatch, bad bias or out_dtype.
    """

    return _gemm(xq, prepared, bias, out_dtype, checked=True)


def _gemm(xq, prepared, bias, out_dtype, *, checked: bool) -> torch.Tensor:
    def mm(plan, out_dtype):
        b12x_gemm = getattr(C.blockscaled(), B12X_GEMM)
        return b12x_gemm(xq.data.contiguous(), C.swizzled_scale(xq), prepared.data, prepared.scale,
                         plan=plan, out_dtype=out_dtype)

    return C.run_gemm(FMT, xq, prepared, bias, out_dtype, make_query, cap_for, mm, checked=checked)


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           scale_rule: str = "ceil", a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias), W4A4 at every M: our quantizer, then gemm().
    x bf16/fp16 [..., K] -> [..., N] of x's dtype."""
    if a16:
        raise ValueError(f"kernels_cute.mxfp4: {A16_UNSUPPORTED}")
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
