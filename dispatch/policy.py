"""What the caller asked for: ``impl=``, ``use_impl()``, ``B12X_IMPL`` or auto, and the errors.

Four implementations can compute a quantized linear layer:

    cute       b12x's CuTe DSL kernels (kernels_cute/): the production path, SM120/SM121 only.
    hopper     the Hopper production Triton kernels (kernels_triton/hopper/): sm_90 only.
    triton     the readable Triton kernels (kernels_triton/<fmt>.py): any CUDA GPU, and the CPU
               through Triton's interpreter (TRITON_INTERPRET=1).
    reference  the formats/ oracle (dequantize, float64 matmul): every device, slow.

What the caller asks for, highest priority first: the per-call ``impl=`` argument, the innermost
``use_impl(...)`` context, the ``B12X_IMPL`` environment variable, and finally "auto". The decision
itself (which backend serves a call, and why) is :func:`dispatch.registry.choose`:

    auto       walks the device's priority list (``registry.priority(device)``: sm_90 hopper,
               triton, reference; SM120/SM121 cute, triton, reference; elsewhere triton,
               reference) and takes the first backend whose ``is_supported(device)`` and
               ``can_implement(problem)`` both pass; the choice is logged once with the reasons
               of the ones skipped.
    cute | hopper | triton | reference
               that implementation, or ImplementationUnavailable naming it, the device and the
               reason. A forced implementation never falls back silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Optional

from .devices import DeviceInfo

ENV_VAR = "B12X_IMPL"
IMPLS = ("auto", "cute", "hopper", "triton", "reference")
"""Values B12X_IMPL / use_impl / impl= accept."""
DECODE_M = (1, 16)
PREFILL_M = 4096


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class InvalidImplementation(ValueError):
    """B12X_IMPL, use_impl() or impl= holds a name that is not in IMPLS."""


class ImplementationUnavailable(ValueError):
    """A forced implementation cannot serve the call. ``impl``, ``device`` and ``reason`` say why."""

    def __init__(self, impl: str, device: DeviceInfo, reason: str):
        self.impl, self.device, self.reason = impl, device, reason
        super().__init__(f"implementation {impl!r} cannot serve this call on {device.describe()}: {reason}")


# ---------------------------------------------------------------------------------------------
# What was asked for
# ---------------------------------------------------------------------------------------------
_override: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("b12x_impl", default=None)


def parse_impl(value, source: str = ENV_VAR) -> str:
    """Normalize an implementation name (case and surrounding blanks ignored).

    Raises:
        InvalidImplementation: naming ``source`` (the variable or argument), the value and IMPLS.
    """
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in IMPLS:
        raise InvalidImplementation(f"{source}={value!r} is not an implementation; allowed: {', '.join(IMPLS)}")
    return name


def requested_impl(impl: Optional[str] = None) -> tuple[str, str]:
    """(implementation asked for, where the request came from) for one call.

    Order: ``impl`` argument, then the innermost ``use_impl``, then ``B12X_IMPL``, then "auto".
    An empty B12X_IMPL counts as unset.
    """
    if impl is not None:
        return parse_impl(impl, "impl"), "impl="
    ctx = _override.get()
    if ctx is not None:
        return ctx, "use_impl()"
    env = os.environ.get(ENV_VAR, "")
    if env.strip():
        return parse_impl(env, ENV_VAR), ENV_VAR
    return "auto", "default"


@contextlib.contextmanager
def use_impl(impl: str) -> Iterator[str]:
    """Force (or, with "auto", un-force) the implementation inside a ``with`` block.

    Overrides B12X_IMPL; a per-call ``impl=`` still wins. Nests, and is local to the thread/task.
    """
    token = _override.set(parse_impl(impl, "use_impl()"))
    try:
        yield _override.get()
    finally:
        _override.reset(token)


def shape_classes(N: int = 4096, K: int = 4096) -> dict[str, tuple[int, int, int]]:
    """The shape classes the table and `b12x-dual info` report: decode (M=1, 16), prefill (M=4096)."""
    out = {f"decode M={m}": (m, N, K) for m in DECODE_M}
    out[f"prefill M={PREFILL_M}"] = (PREFILL_M, N, K)
    return out
