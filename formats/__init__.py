"""formats: the six quantization formats as code, and the pure-PyTorch oracle.

Shared by kernels_triton and kernels_cute (and nothing here imports them). Public API:

    quantize(x, fmt, role=..., **opts) -> QuantizedTensor
    dequantize(q, dtype=torch.float32) -> Tensor
    reference_linear(x, qweight, bias=None, ...) -> Tensor   (float64, rounded once)
    reference_moe(x, w13, w2, topk_ids, topk_weights, ...)   (one MoE layer's experts, float64; formats.moe)
    swizzle_128x4 / unswizzle_128x4                            (cuBLAS / b12x scale layout)
    validate.check_weight / check_activation / ...             (operand checks every kernel uses)

See docs/formats.md for the bit layouts, scale rules and worked examples.
"""

from . import codecs, constants, layout, validate
from .base import FormatSpec, QuantizedTensor
from .layout import swizzle_128x4, swizzled_offset, swizzled_size, unswizzle_128x4
from .moe import MOE_ACTIVATIONS, experts_from_stacked, moe_activation, reference_moe
from .oracle import FORMATS, dequantize, format_module, quantize, reference_linear, spec

FORMAT_NAMES = tuple(FORMATS)

__all__ = [
    "FORMATS",
    "FORMAT_NAMES",
    "FormatSpec",
    "MOE_ACTIVATIONS",
    "QuantizedTensor",
    "codecs",
    "constants",
    "dequantize",
    "experts_from_stacked",
    "format_module",
    "layout",
    "moe_activation",
    "quantize",
    "reference_linear",
    "reference_moe",
    "spec",
    "swizzle_128x4",
    "swizzled_offset",
    "swizzled_size",
    "unswizzle_128x4",
    "validate",
]
