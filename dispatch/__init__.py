"""dispatch: picks the implementation (cute, triton, reference) per device, format and shape.

Public API (see docs/dispatch.md):

    quantize_weight(w, fmt, **opts)             oracle quantization of a weight [N, K]
    linear(x, qweight, bias=None, *, impl=None) y = x . W^T (+ bias), implementation per policy
    explain(fmt, M, N, K, device=None)          which implementation auto picks, and why
    use_impl("triton")                          context manager overriding B12X_IMPL
    QuantLinear, quantize_model, save_quantized, load_quantized
    DeviceInfo, KNOWN_DEVICES, current_device
"""

# Import kernels_triton first: with no GPU it sets TRITON_INTERPRET=1, which Triton must see before
# anything else imports it (transformers does, and a triton imported without the variable makes
# every interpreted kernel fail with "Cannot call @triton.jit'd outside of the scope of a kernel").
import kernels_triton  # noqa: F401,I001

from .api import explain, library_versions, linear, quantize_weight
from .devices import CPU, KNOWN_DEVICES, DeviceInfo, current_device
from .policy import (
    ENV_VAR,
    IMPLS,
    VARIANTS,
    Choice,
    ImplementationUnavailable,
    InvalidImplementation,
    choose,
    use_impl,
)
from .quant_linear import QuantLinear, load_quantized, quantize_model, read_quantized, save_quantized

__all__ = [
    "CPU",
    "ENV_VAR",
    "IMPLS",
    "KNOWN_DEVICES",
    "VARIANTS",
    "Choice",
    "DeviceInfo",
    "ImplementationUnavailable",
    "InvalidImplementation",
    "QuantLinear",
    "choose",
    "current_device",
    "explain",
    "library_versions",
    "linear",
    "load_quantized",
    "quantize_model",
    "quantize_weight",
    "read_quantized",
    "save_quantized",
    "use_impl",
]
