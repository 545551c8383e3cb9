"""Per-tensor FP8 (W8A8) on SM120/SM121 through b12x's tensor-scaled FP8 GEMM
(``blockscaled.pack_weight(w, scale)`` -> ``TensorFP8LinearWeight``, run by ``blockscaled.mm``).

**Strategy.**

    xq = kernels_cute.quant quantizer (linear)                e4m3 [M, K], fp32 sx (0-d, on device)
    y  = mm(xq.data, W_packed(output_scale = sx * sw), plan=cap plan)
         (plain e4m3 MMA, fp32 accumulation, y = acc * output_scale in the epilogue)
    y += bias                                                 (fp32 sum, one more rounding)

b12x's tensor-FP8 weight carries one *combined* dequantization scale (it was designed for a static
input scale). With a dynamic activation scale that scale changes every call, so ``linear`` builds
a per-call copy of the frozen ``TensorFP8LinearWeight`` dataclass whose ``output_scale`` is the
device tensor ``sx * sw`` (no host synchronization, nothing shared is mutated; the kernel reads
``output_scale`` as its ``alpha`` tensor at run time). The rounding order differs from Triton's
``(acc * sx) * sw`` by at most an fp32 ulp before the output rounding.

b12x has no per-tensor FP8 activation quantizer (dynamic amax); ours in CuTe DSL (kernels_cute/quant,
bit-exact with the oracle) is used. ``gemm(xq, prepared)`` takes an activation quantized elsewhere
(e.g. by the Triton quantizer, composed in dispatch). On <= 64-SM parts (GB10) b12x runs M <= 8 on
its block-FP8 kernel with unit scales; the numbers are the same W8A8 GEMM.

**Capability.** SM120/SM121 with b12x==1.5.1 (``gemm.tensor_fp8_linear.is_supported()``, which also
needs the SM120 MXF8 warp MMA in nvidia-cutlass-dsl). **Shapes and limits.** K % 128 == 0 (b12x pads
K to 128 in the weight only; we do not pad activations) and N % 8 == 0. ``pack_weight`` needs CUDA
tensors, so ``prepare_weight`` does too.

**References.** formats/fp8_tensor.py, kernels_cute/quant/fp8_tensor.py,
b12x/gemm/blockscaled/_linear.py::pack_tensor_fp8_linear_weight / tensor_fp8_linear.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from formats import QuantizedTensor

from . import _common as C

FMT = "fp8_tensor"
B12X_GATE = "b12x.gemm.tensor_fp8_linear"  # the b12x module whose is_supported() gates this entry point on the running GPU
B12X_GEMM = "mm"  # the b12x.gemm.blockscaled function the W4A4 / W8A8 GEMM calls (what route() reports)
K_MULTIPLE = 128
N_MULTIPLE = 8


def supported(M: int, N: int, K: int) -> tuple[bool, str]:
    return C.check_alignment(FMT, M, N, K, k_multiple=K_MULTIPLE, n_multiple=N_MULTIPLE)


cap_for = C.same_cap  # b12x plans any row capacity here


def make_query(cap: int, N: int, K: int, out_dtype: str = "bfloat16"):
    return C.fixed_query(cap, N, K, out_dtype, recipe="tensor_fp8", call_kind="packed", input_dtype="float8_e4m3fn")


def prepare_weight(qweight: QuantizedTensor, *, into: Optional[C.CuteWeight] = None, a16: bool = False) -> C.CuteWeight:
    """Per-tensor FP8 weight [N, K] (CUDA) -> b12x TensorFP8LinearWeight (borrows the e4m3 codes).

    Raises ValueError for a malformed weight (formats.validate, values included), a CPU weight
    (b12x's pack_weight checks for CUDA), or a16.
    """
    if a16:
        raise ValueError("fp8_tensor has no W8A16 variant here")
    C.check_qweight(qweight, FMT)
    if qweight.device.type != "cuda":
        raise ValueError("kernels_cute.fp8_tensor.prepare_weight needs a CUDA weight (b12x pack_weight)")
    data = qweight.data.contiguous()
    sw = qweight.scale.reshape(1).to(torch.float32).contiguous()
    packed = C.blockscaled().pack_weight(data, sw.clone())
    new = C.CuteWeight(FMT, tuple(qweight.shape), data, sw, packed=packed)
    return new if into is None else C.copy_into(into, new)


def quantize_activation(x: torch.Tensor, *, scale=None) -> QuantizedTensor:
    """Per-tensor FP8 activation quantization with our CuTe DSL kernels (kernels_cute/quant),
    bit-exact with the oracle: e4m3 [M, K] and a 0-d fp32 scale on the device."""
    return C.quantize_cute(x, FMT, scale=scale)


def gemm(xq: QuantizedTensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = dequant(xq) . W^T (+ bias) on an already quantized activation.

    Args:
        xq: fp8_tensor activation [M, K] (e4m3 data, one fp32 scale sx on the device), from any
            quantizer (ours, formats.quantize, the Triton one).
        prepared: this module's prepare_weight result. bias: optional float [N] on its device.
        out_dtype: bfloat16 (default) or float16.
    Returns:
        [M, N] of out_dtype: mm(xq.data, W with output_scale = sx * sw) (+ bias).
    Raises:
        ValueError: a malformed xq (formats.validate), K or device mismatch, bad bias or out_dtype.
    """

    return _gemm(xq, prepared, bias, out_dtype, checked=True)


def _gemm(xq, prepared, bias, out_dtype, *, checked: bool) -> torch.Tensor:
    def mm(plan, out_dtype):
        # a per-call copy of the frozen packed weight whose combined scale is the device tensor sx * sw
        weight = replace(prepared.packed, output_scale=(xq.scale.reshape(1).float() * prepared.scale).contiguous())
        return getattr(C.blockscaled(), B12X_GEMM)(xq.data.contiguous(), weight, plan=plan, out_dtype=out_dtype)

    return C.run_gemm(FMT, xq, prepared, bias, out_dtype, make_query, cap_for, mm, checked=checked)


def linear(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
           scale=None, a16: bool = False) -> torch.Tensor:
    """y = x . W^T (+ bias), W8A8 at every M: our quantizer, then gemm().
    x bf16/fp16 [..., K] -> [..., N] of x's dtype. ``scale``: static input scale (None = dynamic)."""
    if a16:
        raise ValueError("fp8_tensor has no W8A16 variant here")
    return _linear(x, prepared, bias, scale, checked=True)


def linear_unchecked(x: torch.Tensor, prepared: C.CuteWeight, bias: Optional[torch.Tensor] = None, *,
                     scale=None, a16: bool = False) -> torch.Tensor:
    """:func:`linear` minus its argument checks (x, bias and the options, for a caller that made
    them at its own door: dispatch's bound call). The same kernels and output, bit for bit."""
    return _linear(x, prepared, bias, scale, checked=False)


def _linear(x, prepared, bias, scale, *, checked: bool) -> torch.Tensor:
    def rows(x2):
        xq = C.quantize_cute(x2, FMT, checked=checked, scale=scale)
        return _gemm(xq, prepared, bias, x.dtype, checked=checked)

    return C.run_linear(FMT, x, prepared, bias, rows, checked=checked)
