"""MXFP4 (W4A4) on SM120/SM121 through b12x's serialized ``blockscaled.mm_mxfp4``.

**Strategy.** y = x . W^T with both operands MXFP4 (formats/mxfp4.py):

    xq  = kernels_cute.quant (or kernels_triton) quantizer   codes uint8 [M, K/2], E8M0 bytes [M, K/32]
    sfa = formats.swizzle_128x4(xq.scale)               flat 128x4-swizzled scale bytes
    y   = mm_mxfp4(xq.data, sfa, W.data, W.scale_swz, plan=cap plan)   fp32 accumulation, no alpha
    y  += bias                                          (fp32 sum, one more rounding)

b12x ships no MXFP4 activation quantizer, so ours in CuTe DSL (kernels_cute/quant; or the Triton one
with ``quantizer="triton"``, both bit-exact with the oracle) is used.

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

**References.** formats/mxfp4.py, kernels_triton/mxfp4.py, b12x/gemm/blockscaled/api.py::mm_mxfp4,
b12x/_lib/dense_gemm.py::_select_fp4_tile_k.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from formats import QuantizedTensor, swizzle_128x4

from . import _common as C

FMT = "mxfp4"
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
    return C.blockscaled().FixedBlockscaledQuery(
        recipe=FMT, call_kind="serialized", max_rows=cap, in_features=K, padded_in_features=K,
        out_features=N, input_dtype="uint8", output_dtype=out_dtype, expected_m=None, alpha_mode="unit")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """MXFP4 weight [N, K] -> codes uint8 [N, K/2] + flat swizzled E8M0 bytes (any device).

    Raises ValueError for a wrong format/layout, or ``a16=True`` (see A16_UNSUPPORTED)."""
    if a16:
        raise ValueError(f"kernels_cute.mxfp4: {A16_UNSUPPORTED}")
    C.check_qweight(qweight, FMT)
    new = C.CuteWeight(FMT, tuple(qweight.shape), qweight.data.contiguous(), swizzle_128x4(qweight.scale))
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil", quantizer: str = C.DEFAULT_QUANTIZER) -> QuantizedTensor:
    """MXFP4 activation quantization, bit-exact with the oracle, scales in the swizzled layout
    (uint8 E8M0 flat, scale_layout="swizzled_128x4").
    ``quantizer``: "cute" (default: our CuTe DSL kernels, kernels_cute/quant) or "triton"
    (kernels_triton); bit for bit the same result. The CuTe kernel writes the swizzled layout directly.
    """
    if C.check_quantizer(quantizer) == "cute":
        from .quant import quantize_activation_cute

        return quantize_activation_cute(x, FMT, scale_rule=scale_rule, swizzled=True)
    from kernels_triton import mxfp4 as tri

    xq = tri.quantize_activation(x, scale_rule=scale_rule)
    return replace(xq, scale=swizzle_128x4(xq.scale), scale_layout="swizzled_128x4")


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           scale_rule: str = "ceil", a16: bool = False, quantizer: str = C.DEFAULT_QUANTIZER) -> torch.Tensor:
    """y = x . W^T (+ bias), W4A4 at every M. x bf16/fp16 [..., K] -> [..., N] of x's dtype."""
    if a16:
        raise ValueError(f"kernels_cute.mxfp4: {A16_UNSUPPORTED}")
    N, K = prepared.shape
    x2 = C.flatten_activation(x, K, FMT)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty((*x.shape[:-1], N))
    plan, _ = C.plan_for_call(FMT, M, N, K, x.dtype, x.device, make_query, cap_for)
    xq = quantize_activation(x2, scale_rule=scale_rule, quantizer=quantizer)
    y = C.blockscaled().mm_mxfp4(xq.data, xq.scale, prepared.data, prepared.scale, plan=plan, out_dtype=x.dtype)
    return C.add_bias(y, bias, N).reshape(*x.shape[:-1], N)
