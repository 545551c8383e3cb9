"""The public entry points: quantize_weight, linear and explain.

    qw = quantize_weight(w, "nvfp4")          # w [N, K] -> formats.QuantizedTensor (role "weight")
    y  = linear(x, qw, bias)                  # x [..., K] -> y [..., N], implementation per policy
    print(explain("nvfp4", 1, 4096, 4096))    # which implementation auto picks here, and why

Each implementation is reached through two verbs: ``prepare(impl, qweight)`` turns the oracle's
QuantizedTensor into what the implementation consumes (once per weight; only cute repacks), and
``apply(impl, x, prepared, bias)`` is the call.
"""

from __future__ import annotations

import importlib
import platform
import weakref
from typing import Optional, Union

import torch

from formats import QuantizedTensor, quantize, reference_linear

from . import policy
from .devices import DeviceInfo, current_device, resolve
from .policy import choose, split_variant, variant_name


def quantize_weight(w: torch.Tensor, fmt: str, **opts) -> QuantizedTensor:
    """Quantize a weight [N, K] with the formats/ oracle (``role="weight"``).

    ``fmt`` may be the variant "mxfp4_w4a16" (its weight is plain MXFP4). ``opts`` are the format's
    options (fp8_block ``ue8m0``, mxfp8/mxfp4 ``scale_rule``, nvfp4 ``global_scale``, fp8_tensor
    ``scale``). Raises ValueError as formats.quantize does (K not a multiple of the block, ...).
    """
    base, _ = split_variant(fmt)
    return quantize(w, base, role="weight", **opts)


# ---------------------------------------------------------------------------------------------
# prepare / apply per implementation
# ---------------------------------------------------------------------------------------------
def prepare(impl: str, qweight: QuantizedTensor, *, a16: bool = False):
    """What ``impl`` consumes for this weight: the QuantizedTensor itself for triton and reference;
    ``kernels_cute.<fmt>.prepare_weight(qweight)`` for cute (packed/swizzled to b12x's contract)."""
    if impl in ("triton", "reference"):
        return qweight
    if impl == "cute":
        mod = importlib.import_module(f"kernels_cute.{qweight.fmt}")
        return mod.prepare_weight(qweight, a16=True) if a16 else mod.prepare_weight(qweight)
    raise ValueError(f"impl must be one of {policy.CONCRETE_IMPLS}, got {impl!r}")


def apply(impl: str, x: torch.Tensor, prepared, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None,
          *, a16: bool = False, **opts) -> torch.Tensor:
    """y = x . W^T (+ bias) with ``impl`` on an already prepared weight. ``opts`` go to the
    implementation (activation options such as ``out_dtype`` for reference)."""
    if impl == "reference":
        return reference_linear(x, qweight, bias, a16=a16, **opts)
    if impl == "triton":
        import kernels_triton

        mod = kernels_triton.module(qweight.fmt)
        return mod.linear(x, qweight, bias, a16=True, **opts) if a16 else mod.linear(x, qweight, bias, **opts)
    if impl == "cute":
        mod = importlib.import_module(f"kernels_cute.{qweight.fmt}")
        return mod.linear(x, prepared, bias, a16=True, **opts) if a16 else mod.linear(x, prepared, bias, **opts)
    raise ValueError(f"impl must be one of {policy.CONCRETE_IMPLS}, got {impl!r}")


# Prepared weights for linear() on a bare QuantizedTensor, keyed by (id, impl, a16) and dropped when
# the QuantizedTensor is garbage-collected (QuantLinear keeps its own cache instead).
_prepared: dict[tuple[int, str, bool], object] = {}


def _prepared_for(impl: str, qweight: QuantizedTensor, a16: bool):
    if impl != "cute":
        return qweight
    key = (id(qweight), impl, a16)
    if key not in _prepared:
        _prepared[key] = prepare(impl, qweight, a16=a16)
        weakref.finalize(qweight, _prepared.pop, key, None)
    return _prepared[key]


def device_of(x: torch.Tensor) -> DeviceInfo:
    """The DeviceInfo of the device a tensor lives on."""
    return current_device(x.device)


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           impl: Optional[str] = None, a16: bool = False, **opts) -> torch.Tensor:
    """y = x . W^T (+ bias) for a quantized weight, through the implementation the policy picks.

    Args:
        x: [..., K] float activations (bf16/fp16; the reference also takes float32).
        qweight: a weight from :func:`quantize_weight` ([N, K]).
        bias: optional [N].
        impl: per-call override of use_impl() / B12X_IMPL ("auto", "cute", "triton", "reference").
        a16: MXFP4 weight-only (W4A16): the activations stay unquantized.
        **opts: passed to the implementation (e.g. activation quantization options).
    Raises:
        ImplementationUnavailable: a forced implementation cannot serve this call.
        InvalidImplementation: an unknown implementation name.
    """
    if not isinstance(qweight, QuantizedTensor) or qweight.role != "weight":
        raise ValueError("qweight must be a QuantizedTensor with role 'weight' (see quantize_weight)")
    n, k = qweight.shape
    variant = variant_name(qweight.fmt, a16)
    m = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    c = choose(variant, m, n, k, device_of(x), impl=impl)
    return apply(c.impl, x, _prepared_for(c.impl, qweight, a16), qweight, bias, a16=a16, **opts)


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------
def library_versions() -> dict[str, str]:
    """Versions of what the results depend on, for reports and JSON: torch, triton, b12x,
    nvidia-cutlass-dsl and numpy as installed ("not installed" if absent), the Python version, and
    the CUDA version torch was built with ("None" for a CPU-only torch)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for dist in ("triton", "b12x", "nvidia-cutlass-dsl", "numpy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    out["python"] = platform.python_version()
    out["cuda"] = str(torch.version.cuda)
    return out


def describe_device(device: DeviceInfo) -> str:
    """Device line for reports: name, arch, SMs, shared memory per block and bandwidth."""
    if device.kind == "cpu":
        return f"{device.name}: no CUDA device; Triton kernels run in Triton's interpreter"
    bw = "unknown bandwidth" if device.mem_bandwidth is None else f"{device.mem_bandwidth:g} GB/s"
    return (f"{device.name} ({device.arch}, {device.sm_count} SMs, "
            f"{device.smem_per_block} B shared memory per block, {bw})")


def explain(fmt: str, M: int, N: int, K: int, device: Union[None, str, DeviceInfo, torch.device] = None) -> str:
    """A few lines saying which implementation serves ``fmt`` here, and why.

    Reports the device (``device``: a DeviceInfo, a table key such as "rtx_5090", a torch device,
    or None for the one this process runs on), the library versions, what B12X_IMPL/use_impl
    currently request, and auto's pick for the given shape and for decode (M=1, 16) and prefill
    (M=4096) shapes of the same N, K.
    """
    dev = resolve(device)
    versions = ", ".join(f"{k} {v}" for k, v in library_versions().items())
    requested, source = policy.requested_impl()
    lines = [
        f"device: {describe_device(dev)}",
        f"libraries: {versions}",
        f"requested: {requested} (from {source})",
    ]
    shapes = policy.shape_classes(N, K)
    if M not in [m for m, _, _ in shapes.values()]:
        shapes = {f"M={M}": (M, N, K), **shapes}
    for label, (m, n, k) in shapes.items():
        c = choose(fmt, m, n, k, dev, impl="auto", log_fallback=False)
        lines.append(f"{fmt} {label} N={n} K={k}: auto -> {c.impl}: {c.reason}")
    if requested != "auto":
        try:
            c = choose(fmt, M, N, K, dev)
            lines.append(f"{fmt} M={M} N={N} K={K}: {source}={requested} -> {c.impl}: {c.reason}")
        except policy.ImplementationUnavailable as e:
            lines.append(f"{fmt} M={M} N={N} K={K}: {source}={requested} -> error: {e}")
    return "\n".join(lines)
