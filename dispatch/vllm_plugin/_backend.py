"""The one place the vLLM plugin meets the dispatcher: choose a backend, prepare, apply.

The plugin's kernel classes reach an implementation only through the backend registry
(``dispatch.registry``, see REGISTRY_SPEC in docs/dispatch.md): ``choose`` gives a Backend with
``prepare(qweight, into=None)`` and ``apply(x, prepared, bias, **act_opts)``. Until the registry
is importable, :class:`_PolicyBackend` gives the same surface over ``dispatch.policy`` /
``dispatch.api`` (the cute, triton and reference implementations as they are today), so this
module is the only one to change when it lands.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Optional

import torch

from formats import QuantizedTensor

from ..devices import DeviceInfo

try:  # the registry (dispatch/registry.py); absent before it lands
    from .. import registry as _registry  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the checkout
    _registry = None

VARIANT_FMT = {
    "fp8_tensor": ("fp8_tensor", False),
    "fp8_block": ("fp8_block", False),
    "mxfp8": ("mxfp8", False),
    "nvfp4": ("nvfp4", False),
    "nvfp4_w4a16": ("nvfp4", True),
    "mxfp4": ("mxfp4", False),
    "mxfp4_w4a16": ("mxfp4", True),
}


@dataclass(frozen=True)
class Chosen:
    """A backend for one layer signature, and why (``considered``: every step of the walk)."""

    backend: object
    impl: str
    reason: str
    requested: str
    source: str
    considered: tuple = ()


class _PolicyBackend:
    """Registry-shaped Backend over dispatch.policy / dispatch.api (used until the registry lands)."""

    def __init__(self, impl: str, variant: str):
        self.impl, self.variant = impl, variant
        self.fmt, self.a16 = VARIANT_FMT[variant]
        self.name = f"{impl}:{variant}"

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        from .. import policy

        if self.impl == "reference":
            return True, "the formats/ oracle runs on every device"
        if self.impl == "triton":
            if self.variant == "nvfp4_w4a16":
                return False, "no Triton NVFP4 W4A16 kernel in this dispatcher (the registry adds it)"
            return policy.triton_support(self.fmt, device)
        ok, why = policy.b12x_support(device)
        if ok and self.variant == "nvfp4_w4a16":
            return False, "kernels_cute has no NVFP4 W4A16 entry in this dispatcher (the registry adds it)"
        return ok, why

    def can_implement(self, problem) -> tuple[bool, str]:
        if self.impl != "cute":
            return True, f"{self.impl} serves every {self.variant} shape"
        kc = importlib.import_module("kernels_cute")
        mod = kc.module(self.variant)
        if self.variant == "mxfp4_w4a16":
            return mod.supported(problem.M, problem.N, problem.K, a16=True)
        return mod.supported(problem.M, problem.N, problem.K)

    def prepare(self, qweight: QuantizedTensor, into=None):
        if self.impl == "cute":
            return importlib.import_module("kernels_cute").prepare_weight(qweight, a16=self.a16, into=into)
        if into is None:
            return qweight
        for name, t in qweight.tensors().items():
            getattr(into, name).copy_(t)
        return into

    def apply(self, x: torch.Tensor, prepared, bias: Optional[torch.Tensor] = None, **act_opts) -> torch.Tensor:
        from .. import api

        qweight = None if self.impl == "cute" else prepared
        return api.apply(self.impl, x, prepared, qweight, bias, a16=self.a16, **act_opts)


@dataclass(frozen=True)
class _Problem:
    variant: str
    M: int
    N: int
    K: int
    dtype: torch.dtype


def problem(variant: str, M: int, N: int, K: int, dtype: torch.dtype):
    """A registry Problem (or the same fields, before the registry lands)."""
    if _registry is not None:
        return _registry.Problem(variant=variant, M=M, N=N, K=K, dtype=dtype)
    return _Problem(variant, M, N, K, dtype)


def get(impl: str, variant: str):
    """The Backend of (impl, variant); ValueError (registry.Unsupported) where it is declared absent."""
    if _registry is not None:
        return _registry.get(impl, variant)
    return _PolicyBackend(impl, variant)


IMPLS = ("cute", "triton", "reference")


def requested_impl() -> tuple[str, str]:
    """What B12X_IMPL / use_impl() ask for: (name, source)."""
    from .. import policy

    return policy.requested_impl()


def choose(variant: str, M: int, N: int, K: int, device: DeviceInfo, dtype: torch.dtype) -> Chosen:
    """The backend that serves (variant, M, N, K, dtype) on ``device``: B12X_IMPL / use_impl() when
    set, else auto's walk (cute, triton, reference).

    Raises:
        dispatch.ImplementationUnavailable: a forced implementation cannot serve it (reason inside).
        ValueError: auto found nothing (every reason listed).
    """
    if _registry is not None:
        c = _registry.choose(variant, M, N, K, device, dtype=dtype)
        return Chosen(c.backend, c.impl, c.reason, c.requested, c.source, tuple(c.considered))
    from ..policy import ImplementationUnavailable

    requested, source = requested_impl()
    prob = _Problem(variant, M, N, K, dtype)
    order = IMPLS if requested == "auto" else (requested,)
    considered = []
    for impl in order:
        b = _PolicyBackend(impl, variant)
        ok, why = b.is_supported(device)
        if ok:
            ok, why = b.can_implement(prob)
        considered.append((impl, ok, why))
        if ok:
            return Chosen(b, impl, why, requested, source, tuple(considered))
        if requested != "auto":
            raise ImplementationUnavailable(impl, device, why)
    raise ValueError("; ".join(f"{i}: {w}" for i, _, w in considered))


def support(impl: str, variant: str, device: DeviceInfo) -> tuple[bool, str]:
    """``get(impl, variant).is_supported(device)``, with a declared-unsupported entry as (False, why)."""
    try:
        b = get(impl, variant)
    except ValueError as e:
        return False, str(e)
    return b.is_supported(device)


def can_implement(impl: str, variant: str, M: int, N: int, K: int, dtype: torch.dtype) -> tuple[bool, str]:
    """``get(impl, variant).can_implement(Problem(...))``, declared-unsupported as (False, why)."""
    try:
        b = get(impl, variant)
    except ValueError as e:
        return False, str(e)
    return b.can_implement(problem(variant, M, N, K, dtype))


def replace_fields(qw: QuantizedTensor, **kw) -> QuantizedTensor:
    return dataclasses.replace(qw, **kw)
