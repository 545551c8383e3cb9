"""dispatch: picks the implementation (cute, hopper, triton, reference) per device, format and shape.

Public API (see docs/dispatch.md):

    quantize_weight(w, fmt, **opts)             oracle quantization of a weight [N, K]
    linear(x, qweight, bias=None, *, impl=None) y = x . W^T (+ bias), backend per registry.choose
    explain(fmt, M, N, K, device=None)          which backend auto picks, every reason, and its route
    route(fmt, M, N, K, device=None)            the Route that call takes: kernels, tile, split-K, why
    use_impl("triton")                          context manager overriding B12X_IMPL
    registry.get(impl, variant), choose(...)    the backends with vLLM's four verbs
    BoundLinear                                 one weight bound to the registry (what linear,
                                                QuantLinear and the vLLM op call)
    fused_moe, BoundMoE, MoEProblem, explain_moe MoE layers through their own table (dispatch.moe)
    QuantLinear, quantize_model, save_quantized, load_quantized
    DeviceInfo, KNOWN_DEVICES, current_device

docs/architecture.md shows the packages, the registry and where a call flows.
"""

# Import kernels_triton first: with no GPU it sets TRITON_INTERPRET=1, which Triton must see before
# anything else imports it (transformers does, and a triton imported without the variable makes
# every interpreted kernel fail with "Cannot call @triton.jit'd outside of the scope of a kernel").
import kernels_triton  # noqa: F401,I001

from . import registry
from .api import explain, linear, quantize_weight, route
from .bound import BoundLinear
from .moe import BoundMoE, MoEProblem, explain_moe, fused_moe
from .contract import VARIANTS, Backend, ImplementationUnavailable, InvalidImplementation, NoBackend, Problem, Unsupported
from .describe import library_versions
from .devices import CPU, KNOWN_DEVICES, DeviceInfo, current_device
from .policy import ENV_VAR, REQUESTS, use_impl
from .registry import Choice, choose
from .quant_linear import QuantLinear, load_quantized, quantize_model, read_quantized, save_quantized

__all__ = [
    "Backend",
    "BoundLinear",
    "BoundMoE",
    "MoEProblem",
    "CPU",
    "ENV_VAR",
    "KNOWN_DEVICES",
    "NoBackend",
    "Problem",
    "VARIANTS",
    "Choice",
    "DeviceInfo",
    "ImplementationUnavailable",
    "InvalidImplementation",
    "QuantLinear",
    "REQUESTS",
    "Unsupported",
    "choose",
    "current_device",
    "explain",
    "explain_moe",
    "fused_moe",
    "library_versions",
    "linear",
    "load_quantized",
    "quantize_model",
    "quantize_weight",
    "read_quantized",
    "registry",
    "route",
    "save_quantized",
    "use_impl",
]


def __getattr__(name: str):
    # One release: dispatch.IMPLS meant what may be requested, "auto" included (now REQUESTS); the
    # implementations alone are dispatch.registry.IMPLS. docs/dispatch.md lists the moved names.
    if name == "IMPLS":
        import warnings

        warnings.warn("dispatch.IMPLS is now dispatch.REQUESTS (the implementations alone are "
                      "dispatch.registry.IMPLS)", DeprecationWarning, stacklevel=2)
        return REQUESTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
