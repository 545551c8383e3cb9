"""The public entry points: quantize_weight, linear and explain.

    qw = quantize_weight(w, "nvfp4")          # w [N, K] -> formats.QuantizedTensor (role "weight")
    y  = linear(x, qw, bias)                  # x [..., K] -> y [..., N], backend per registry.choose
    print(explain("nvfp4", 1, 4096, 4096))    # which backend auto picks here, why, and its route
    route("nvfp4", 1, 4096, 4096, "h200")     # the Route: kernels launched, tile, split-K, why

Every call goes through the backend registry (dispatch.registry): ``choose`` picks the backend,
``prepare`` repacks the weight once (cached per weight and backend), ``apply`` is the call.
"""

from __future__ import annotations

import functools
import platform
import weakref
from typing import Optional, Union

import torch

from formats import QuantizedTensor, quantize
from formats.validate import check_linear_input

from . import policy, registry
from .devices import DeviceInfo, current_device, resolve


def quantize_weight(w: torch.Tensor, fmt: str, **opts) -> QuantizedTensor:
    """Quantize a weight [N, K] with the formats/ oracle (``role="weight"``).

    ``fmt`` may be a weight-only variant ("nvfp4_w4a16", "mxfp4_w4a16", "mxfp8_w8a16": the weight is
    plain NVFP4 / MXFP4 / MXFP8). ``opts`` are the format's options (fp8_block ``ue8m0``, mxfp8/mxfp4
    ``scale_rule``, nvfp4 ``global_scale``, fp8_tensor / fp8_channel ``scale``). Raises ValueError as formats.quantize does (K not a
    multiple of the block, ...) and for an unknown format.
    """
    return quantize(w, registry.variant(fmt).fmt, role="weight", **opts)


# Prepared weights for linear() on a bare QuantizedTensor, keyed by (id, backend name) and dropped
# when the QuantizedTensor is garbage-collected (QuantLinear keeps its own cache instead).
_prepared: dict[tuple[int, str], object] = {}


def _prepared_for(backend: registry.Backend, qweight: QuantizedTensor):
    key = (id(qweight), backend.name)
    if key not in _prepared:
        prepared = backend.prepare(qweight)
        if prepared is qweight:  # nothing repacked (triton, reference): caching it would keep it alive
            return prepared
        _prepared[key] = prepared
        weakref.finalize(qweight, _prepared.pop, key, None)
    return _prepared[key]


def device_of(x: torch.Tensor) -> DeviceInfo:
    """The DeviceInfo of the device a tensor lives on."""
    return current_device(x.device)


def tokens(x: torch.Tensor) -> int:
    """M of an activation [..., K]: the number of rows once the leading dims are flattened."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def act_dtypes(variant_: str, impl: Optional[str] = None) -> tuple[torch.dtype, ...]:
    """The activation dtypes a call of ``variant_`` can take under the request ``impl`` (None: what
    use_impl() / B12X_IMPL / auto ask for): the forced implementation's, or under auto the union
    over the implementations (bfloat16, float16 and, through the reference, float32).
    Raises InvalidImplementation for an unknown name, ValueError for an unknown variant."""
    registry.variant(variant_)
    return _act_dtypes(variant_, policy.requested_impl(impl)[0])


@functools.lru_cache(maxsize=None)
def _act_dtypes(variant_: str, requested: str) -> tuple[torch.dtype, ...]:
    table = registry.entries()  # fixed once built: the answer is cached per (variant, request)
    names = registry.IMPLS if requested == "auto" else (requested,)
    found = [d for n in names for d in getattr(table[(n, variant_)], "act_dtypes", ())]
    if not found:  # a forced implementation with no backend for the variant: choose says why
        found = [d for (n, v), e in table.items() if v == variant_ for d in getattr(e, "act_dtypes", ())]
    return tuple(dict.fromkeys(found))


def check_input(x, variant_: str, K: int, impl: Optional[str] = None, *,
                act_dtype: Optional[torch.dtype] = None) -> None:
    """The argument checks of a linear call before any implementation is chosen, so that a bad
    argument is reported as one (not as an implementation that cannot serve the call).

    x: [..., K] float tensor; its dtype (or ``act_dtype``, the dtype QuantLinear casts it to) must
    be one of :func:`act_dtypes` for the request ``impl``. Raises ValueError naming ``x`` (or
    ``act_dtype``), the value found and what is allowed (formats.validate.check_linear_input): a
    QuantizedTensor, not a tensor, another dtype, a 0-d tensor, another K, the meta device."""
    allowed = act_dtypes(variant_, impl)
    if act_dtype is None:
        check_linear_input(x, K, allowed)
        return
    check_linear_input(x, K, (x.dtype,) if isinstance(x, torch.Tensor) and x.is_floating_point() else allowed)
    if act_dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"act_dtype must be one of ({names}) here, got {str(act_dtype).removeprefix('torch.')}")


def linear(x: torch.Tensor, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None, *,
           impl: Optional[str] = None, a16: bool = False, **opts) -> torch.Tensor:
    """y = x . W^T (+ bias) for a quantized weight, through the backend the registry picks.

    Args:
        x: [..., K] float activations (bf16/fp16; the reference also takes float32).
        qweight: a weight from :func:`quantize_weight` ([N, K]).
        bias: optional [N].
        impl: per-call override of use_impl() / B12X_IMPL ("auto", "cute", "triton", "reference").
        a16: weight-only (W4A16: nvfp4 and mxfp4; W8A16: mxfp8): the activations stay unquantized.
        **opts: passed to the backend's apply (activation options: fp8_tensor ``scale``, nvfp4
            ``global_scale``, fp8_block ``ue8m0``, MX ``scale_rule``; cute ``quantizer``).
    Raises:
        ValueError: qweight is not a weight QuantizedTensor, or a16 on a format without W4A16; x is
            not a float tensor [..., K] of a dtype the requested implementation(s) take (a
            QuantizedTensor, another dtype, another K, the meta device: :func:`check_input`); a
            bias that is not [N] on x's device; a weight on the meta device.
        ImplementationUnavailable: a forced implementation cannot serve this call.
        InvalidImplementation: an unknown implementation name.
        NoBackend: auto found nothing that serves the call (the message lists every reason).
    """
    if not isinstance(qweight, QuantizedTensor) or qweight.role != "weight":
        raise ValueError("qweight must be a QuantizedTensor with role 'weight' (see quantize_weight)")
    n, k = qweight.shape
    variant = registry.variant_name(qweight.fmt, a16)
    check_input(x, variant, k, impl)
    c = registry.choose(variant, tokens(x), n, k, device_of(x), impl=impl, dtype=x.dtype)
    return c.backend.apply(x, _prepared_for(c.backend, qweight), bias, **opts)


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


def explain(fmt: str, M: int, N: int, K: int, device: Union[None, str, DeviceInfo, torch.device] = None, *,
            dtype: torch.dtype = torch.bfloat16) -> str:
    """A few lines saying which backend serves ``fmt`` here, and why.

    Reports the device (``device``: a DeviceInfo, a table key such as "rtx_5090", a torch device,
    or None for the one this process runs on), the library versions, what B12X_IMPL/use_impl
    currently request, and for the given shape and for decode (M=1, 16) and prefill (M=4096)
    shapes of the same N, K: auto's pick, then every backend of the priority list with its
    verdict and reason, and the chosen backend's route: the kernels it launches (by name, in
    order), the tile, split-K and why (``Backend.route``, the route ``apply`` executes).
    ``fmt`` is a variant name (a format, or "nvfp4_w4a16" / "mxfp4_w4a16" / "mxfp8_w8a16").
    Raises ValueError for an unknown format or device.
    """
    registry.variant(fmt)
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
        head = f"{fmt} {label} N={n} K={k}: auto -> "
        try:
            c = registry.choose(fmt, m, n, k, dev, impl="auto", dtype=dtype, log_choice=False)
        except registry.NoBackend as e:
            lines.append(head + f"error: {e}")
            continue
        lines.append(head + f"{c.impl}: {c.reason}")
        if len(c.considered) > 1:  # something was skipped: show every step of the walk
            for name, ok, why in c.considered:
                lines.append(f"    {name}: {'yes' if ok else 'no'}: {why}")
        lines.append(f"    route: {route_text(c.backend.route(registry.Problem(fmt, m, n, k, dtype), dev))}")
    if requested != "auto":
        try:
            c = registry.choose(fmt, M, N, K, dev, dtype=dtype, log_choice=False)
            lines.append(f"{fmt} M={M} N={N} K={K}: {source}={requested} -> {c.impl}: {c.reason}")
            lines.append(f"    route: {route_text(c.backend.route(registry.Problem(fmt, M, N, K, dtype), dev))}")
        except policy.ImplementationUnavailable as e:
            lines.append(f"{fmt} M={M} N={N} K={K}: {source}={requested} -> error: {e}")
    return "\n".join(lines)


def route(fmt: str, M: int, N: int, K: int, device: Union[None, str, DeviceInfo, torch.device] = None, *,
          impl: Optional[str] = None, dtype: torch.dtype = torch.bfloat16):
    """The route a call of ``fmt`` (a variant name) with this shape takes on ``device``: the
    chosen backend's ``route(problem, device)`` (a ``kernels_triton.Route``: impl, kernels launched
    in order, tile, split-K, why). ``impl`` / use_impl() / B12X_IMPL are honoured as in linear.
    Raises what :func:`registry.choose` raises (ValueError subclasses)."""
    dev = resolve(device)
    c = registry.choose(fmt, M, N, K, dev, impl=impl, dtype=dtype, log_choice=False)
    return c.backend.route(registry.Problem(fmt, M, N, K, dtype), dev)


def route_text(r) -> str:
    """One line of a Route: "kernels a -> b, tile T, SPLIT_K=s: why" (no kernel: the why alone)."""
    parts = [" -> ".join(r.kernels) if r.kernels else "no kernel"]
    if r.tile:
        parts.append(f"tile {r.tile}")
    if r.split_k > 1 and "splitk" not in r.tile:  # TileConfig's text names split-K itself
        parts.append(f"SPLIT_K={r.split_k}")
    return ", ".join(parts) + (f": {r.why}" if r.why else "")
