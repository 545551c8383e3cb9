"""The public entry points: quantize_weight, linear and explain.

    qw = quantize_weight(w, "nvfp4")          # w [N, K] -> formats.QuantizedTensor (role "weight")
    y  = linear(x, qw, bias)                  # x [..., K] -> y [..., N], backend per registry.choose
    print(explain("nvfp4", 1, 4096, 4096))    # which backend auto picks here, why, and its route
    route("nvfp4", 1, 4096, 4096, "h200")     # the Route: kernels launched, tile, split-K, why

``linear`` is a few lines over ``dispatch.bound``: the weight's BoundLinear (one per weight and
variant, living as long as the weight) validates x once, lets the registry decide per M bucket,
prepares the weight once per backend and runs it. The helpers that lower modules share live below
this facade and are re-exported here: ``tokens`` (dispatch.contract), ``device_of``
(dispatch.devices), ``act_dtypes`` (dispatch.registry), ``library_versions``, ``describe_device``
and ``route_text`` (dispatch.describe).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from formats import QuantizedTensor, quantize

from . import policy, registry
from .bound import bound_weight, validate_input
from .contract import DECODE_MAX_M, m_bucket, shape_classes, tokens  # noqa: F401  (tokens: re-exported)
from .describe import describe_device, library_versions, route_text  # noqa: F401  (re-exported)
from .devices import DeviceInfo, device_of, resolve  # noqa: F401  (device_of: re-exported)
from .registry import act_dtypes  # noqa: F401  (re-exported)


def quantize_weight(w: torch.Tensor, fmt: str, **opts) -> QuantizedTensor:
    """Quantize a weight [N, K] with the formats/ oracle (``role="weight"``).

    ``fmt`` may be a weight-only variant ("nvfp4_w4a16", "mxfp4_w4a16", "mxfp8_w8a16": the weight is
    plain NVFP4 / MXFP4 / MXFP8). ``opts`` are the format's options (fp8_block ``ue8m0``, mxfp8/mxfp4
    ``scale_rule``, nvfp4 ``global_scale``, fp8_tensor / fp8_channel ``scale``). Raises ValueError as formats.quantize does (K not a
    multiple of the block, ...) and for an unknown format.
    """
    return quantize(w, registry.variant(fmt).fmt, role="weight", **opts)


def check_input(x, variant_: str, K: int, impl: Optional[str] = None, *,
                act_dtype: Optional[torch.dtype] = None) -> None:
    """The old name of ``dispatch.bound.validate_input`` with the request read here (``impl``:
    None reads use_impl() / B12X_IMPL / auto), kept for one release (docs/dispatch.md)."""
    validate_input(x, variant_, K, policy.requested_impl(impl), act_dtype=act_dtype)


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
            QuantizedTensor, another dtype, another K, the meta device: ``bound.validate_input``); a
            bias that is not [N] on x's device; a weight on the meta device.
        ImplementationUnavailable: a forced implementation cannot serve this call.
        InvalidImplementation: an unknown implementation name.
        NoBackend: auto found nothing that serves the call (the message lists every reason).
    """
    if not isinstance(qweight, QuantizedTensor) or qweight.role != "weight":
        raise ValueError("qweight must be a QuantizedTensor with role 'weight' (see quantize_weight)")
    return bound_weight(qweight, registry.variant_name(qweight.fmt, a16))(x, bias, impl=impl, **opts)


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------
def _bucket_text(M: int) -> str:
    """"M bucket 17-32" (or "M bucket 8" for an exact decode bucket): the Ms that share M's decision."""
    hi = m_bucket(M)
    return f"M bucket {hi}" if M <= DECODE_MAX_M else f"M bucket {hi // 2 + 1}-{hi}"


def explain(fmt: str, M: int, N: int, K: int, device: Union[None, str, DeviceInfo, torch.device] = None, *,
            dtype: torch.dtype = torch.bfloat16) -> str:
    """A few lines saying which backend serves ``fmt`` here, and why.

    Reports the device (``device``: a DeviceInfo, a table key such as "rtx_5090", a torch device,
    or None for the one this process runs on), the library versions and what B12X_IMPL/use_impl
    currently request; then, first, the asked shape (with the M bucket its decision holds for) and
    after it each decode (M=1, 16) and prefill (M=4096) class of the same N, K that is not the
    asked M: auto's pick, every backend of the priority list with its verdict and reason where
    one was skipped, and the chosen backend's route: the kernels it launches (by name, in order),
    the tile, split-K and why (``Backend.route``, the route ``apply`` executes). Under a forced
    request, a last line gives that request's pick for the asked shape.
    ``fmt`` is a variant name (a format, or "nvfp4_w4a16" / "mxfp4_w4a16" / "mxfp8_w8a16").
    Raises ValueError for an unknown format or device.
    """
    registry.variant(fmt)
    dev = resolve(device)
    versions = ", ".join(f"{k} {v}" for k, v in library_versions().items())
    request = policy.requested_impl()
    lines = [
        f"device: {describe_device(dev)}",
        f"libraries: {versions}",
        f"requested: {request.impl} (from {request.source})",
    ]
    classes = shape_classes(N, K)
    asked = next((label for label, (m, _, _) in classes.items() if m == M), f"M={M}")
    shapes = [(asked, M, f" ({_bucket_text(M)}, asked)")]
    shapes += [(label, m, "") for label, (m, _, _) in classes.items() if m != M]
    for label, m, note in shapes:
        head = f"{fmt} {label} N={N} K={K}{note}: auto -> "
        try:
            c = registry.choose(fmt, m, N, K, dev, impl="auto", dtype=dtype, log_choice=False)
        except registry.NoBackend as e:
            lines.append(head + f"error: {e}")
            continue
        lines.append(head + f"{c.impl}: {c.reason}")
        if len(c.considered) > 1:  # something was skipped: show every step of the walk
            for name, ok, why in c.considered:
                lines.append(f"    {name}: {'yes' if ok else 'no'}: {why}")
        lines.append(f"    route: {route_text(c.backend.route(registry.Problem(fmt, m, N, K, dtype), dev))}")
    if request.impl != "auto":
        head = f"{fmt} M={M} N={N} K={K}: {request.source}={request.impl} -> "
        try:
            c = registry.decide(request, fmt, M, N, K, dev, dtype=dtype, log_choice=False)
            lines.append(head + f"{c.impl}: {c.reason}")
            lines.append(f"    route: {route_text(c.backend.route(registry.Problem(fmt, M, N, K, dtype), dev))}")
        except policy.ImplementationUnavailable as e:
            lines.append(head + f"error: {e}")
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
