"""The one place the vLLM plugin meets the dispatcher: the backend registry (dispatch/registry.py).

The plugin's kernel classes reach an implementation only through here: :func:`choose` gives the
registry's Choice for a layer signature (its ``backend`` has ``prepare(qweight, into=None)`` and
``apply(x, prepared, bias, **act_opts)``), :func:`support` / :func:`can_implement` ask one table
entry, with a declared-unsupported entry as (False, reason).
"""

from __future__ import annotations

import torch

from .. import registry
from ..devices import DeviceInfo
from ..policy import requested_impl  # noqa: F401  (re-exported: what B12X_IMPL / use_impl() ask for)

IMPLS = registry.IMPLS
priority = registry.priority  # the implementations auto walks on a device, in order


def choose(variant: str, M: int, N: int, K: int, device: DeviceInfo, dtype: torch.dtype) -> registry.Choice:
    """The registry's choice for (variant, M, N, K, dtype) on ``device`` (B12X_IMPL / use_impl()
    honoured; cached by the registry).

    Raises:
        dispatch.ImplementationUnavailable: a forced implementation cannot serve it (reason inside).
        registry.NoBackend: auto found nothing (every reason listed). Both are ValueErrors.
    """
    return registry.choose(variant, M, N, K, device, dtype=dtype)


def support(impl: str, variant: str, device: DeviceInfo) -> tuple[bool, str]:
    """``registry.get(impl, variant).is_supported(device)``; a declared-unsupported entry gives
    (False, its reason)."""
    try:
        b = registry.get(impl, variant)
    except registry.Unsupported as e:
        return False, str(e)
    return b.is_supported(device)


def can_implement(impl: str, variant: str, M: int, N: int, K: int, dtype: torch.dtype) -> tuple[bool, str]:
    """``registry.get(impl, variant).can_implement(Problem(...))``, declared-unsupported as (False, why)."""
    try:
        b = registry.get(impl, variant)
    except registry.Unsupported as e:
        return False, str(e)
    return b.can_implement(registry.Problem(variant, M, N, K, dtype))
