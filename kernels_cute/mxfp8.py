"""MXFP8 (W8A8) on SM120/SM121 through b12x's packed MXFP8 GEMM with prequantized activations
(``blockscaled.pack_weight(w, e8m0)`` -> ``MXFP8LinearWeight``; ``blockscaled.mm((values, scales), w)``).

**Strategy.**

    xq  = kernels_triton.mxfp8.quantize_activation(x)    e4m3 [M, K], E8M0 bytes [M, K/32]
    sfa = formats.swizzle_128x4(xq.scale)                flat 128x4-swizzled bytes
    y   = mm((xq.data, sfa), W_packed, plan=cap plan)     block-scaled e4m3 MMA, fp32 accumulation
    y  += bias                                            (fp32 sum, one more rounding)

**Why prequantized, not b12x's bf16 path.** b12x's bf16 route quantizes inside b12x (CuTe
``mxfp8_rows``, scale ``pow2_ceil_ue8m0(amax * (1/448))``). Through b12x's own torch twin
(``pow2_ceil_ue8m0_torch``) that rule gives the oracle's scale byte for every positive bf16 and fp16
amax (exhaustive check in tests/kernels_cute/test_contract.py), but an all-zero block gets byte 0
there and the amax floor's byte (19) in the oracle, so the quantized activations are not bit-exact
with kernels_triton; and that route needs a different plan type (the bf16 precision contract,
``activation_mode='quantized'`` to avoid A16 at M <= 8). We feed the Triton codes (bit-exact with the
oracle) as a prequantized pair instead: the packed fixed plan has no A16 branch, so it is W8A8 at
every M. Switching to b12x's quantizer is possible once the zero-block byte is accepted as
equivalent (same dequantized values) and it has been checked on SM12x.

**Capability.** SM120/SM121 with b12x==1.5.1 (``gemm.mxfp8_linear.is_supported()``). **Shapes and
limits.** K % 128 == 0 (b12x pads weights with K % 32 to 128, but then wants padded activations; we
do not pad) and N % 8 == 0. ``pack_weight`` needs CUDA tensors.

**References.** formats/mxfp8.py, kernels_triton/mxfp8.py, b12x/gemm/blockscaled/_linear.py::
pack_mxfp8_linear_weight / mxfp8_linear.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from formats import QuantizedTensor, swizzle_128x4

from . import _common as C

FMT = "mxfp8"
K_MULTIPLE = 128
N_MULTIPLE = 8


def supported(M: int, N: int, K: int) -> tuple[bool, str]:
    return C.check_alignment(FMT, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


def cap_for(cap: int, K: int) -> int:
    return cap


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    return C.blockscaled().FixedBlockscaledQuery(
        recipe=FMT, call_kind="packed", max_rows=cap, in_features=K, padded_in_features=K,
        out_features=N, input_dtype="float8_e4m3fn", output_dtype=out_dtype, expected_m=None,
        source_scale_form="swizzled")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """MXFP8 weight [N, K] (CUDA) -> b12x MXFP8LinearWeight (b12x swizzles the E8M0 scales).

    Raises ValueError for a wrong format, a CPU weight (b12x's pack_weight checks for CUDA), or a16.
    """
    if a16:
        raise ValueError("mxfp8 W8A16 is not exposed here (the formats define it as W8A8)")
    C.check_qweight(qweight, FMT)
    if qweight.device.type != "cuda":
        raise ValueError("kernels_cute.mxfp8.prepare_weight needs a CUDA weight (b12x pack_weight)")
    data = qweight.data.contiguous()
    scale = qweight.scale.contiguous().view(torch.uint8)
    new = C.CuteWeight(FMT, tuple(qweight.shape), data, scale, packed=C.blockscaled().pack_weight(data, scale))
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    """kernels_triton.mxfp8.quantize_activation (bit-exact with the oracle), scales then swizzled
    (uint8 E8M0 flat, scale_layout="swizzled_128x4")."""
    from kernels_triton import mxfp8 as tri

    xq = tri.quantize_activation(x, scale_rule=scale_rule)
    return replace(xq, scale=swizzle_128x4(xq.scale), scale_layout="swizzled_128x4")


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           scale_rule: str = "ceil", a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias), W8A8 at every M. x bf16/fp16 [..., K] -> [..., N] of x's dtype."""
    if a16:
        raise ValueError("mxfp8 W8A16 is not exposed here")
    N, K = prepared.shape
    x2 = C.flatten_activation(x, K, FMT)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty((*x.shape[:-1], N))
    plan, _ = C.plan_for_call(FMT, M, N, K, x.dtype, x.device, make_query, cap_for)
    xq = quantize_activation(x2, scale_rule=scale_rule)
    y = C.blockscaled().mm((xq.data.contiguous(), xq.scale.view(torch.uint8)), prepared.packed,
                           plan=plan, out_dtype=x.dtype)
    return C.add_bias(y, bias, N).reshape(*x.shape[:-1], N)
