"""What the caller asked for: ``impl=``, ``use_impl()``, ``B12X_IMPL`` or auto (:data:`REQUESTS`),
read once per call as a :class:`Request`. The errors (InvalidImplementation,
ImplementationUnavailable) are dispatch.contract's, re-exported here.

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
import warnings
from typing import Iterator, NamedTuple, Optional

from . import contract
from .contract import (DECODE_M, PREFILL_M, ImplementationUnavailable,  # noqa: F401  (re-exported)
                       InvalidImplementation, shape_classes)

ENV_VAR = "B12X_IMPL"
REQUESTS = ("auto",) + contract.IMPLS
"""What B12X_IMPL / use_impl() / impl= accept: "auto" or one of the implementations (contract.IMPLS)."""


def __getattr__(name: str):
    # One release: policy.IMPLS meant REQUESTS (with "auto"); IMPLS now names the implementations
    # alone (contract.IMPLS, registry.IMPLS). docs/dispatch.md lists the moved names.
    if name == "IMPLS":
        warnings.warn("dispatch.policy.IMPLS is now dispatch.policy.REQUESTS (the implementations alone are "
                      "dispatch.registry.IMPLS)", DeprecationWarning, stacklevel=2)
        return REQUESTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Request(NamedTuple):
    """What one call asks for: ``impl`` ("auto" or an implementation) and ``source`` ("impl=",
    "use_impl()", "B12X_IMPL" or "default"). Unpacks as the pair (impl, source)."""

    impl: str
    source: str


# ---------------------------------------------------------------------------------------------
# What was asked for
# ---------------------------------------------------------------------------------------------
_override: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("b12x_impl", default=None)


def parse_impl(value, source: str = ENV_VAR) -> str:
    """Normalize an implementation name (case and surrounding blanks ignored).

    Raises:
        InvalidImplementation: naming ``source`` (the variable or argument), the value and REQUESTS.
    """
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in REQUESTS:
        raise InvalidImplementation(f"{source}={value!r} is not an implementation; allowed: {', '.join(REQUESTS)}")
    return name


def requested_impl(impl: Optional[str] = None) -> Request:
    """What one call asks for, and from where (a :class:`Request`): the ``impl`` argument, then the
    innermost ``use_impl``, then ``B12X_IMPL``, then "auto". An empty B12X_IMPL counts as unset.
    A bound call (dispatch.bound) reads it once and passes it on. Raises InvalidImplementation."""
    if impl is not None:
        return Request(parse_impl(impl, "impl"), "impl=")
    ctx = _override.get()
    if ctx is not None:
        return Request(ctx, "use_impl()")
    env = os.environ.get(ENV_VAR, "")
    if env.strip():
        return Request(parse_impl(env, ENV_VAR), ENV_VAR)
    return Request("auto", "default")


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
