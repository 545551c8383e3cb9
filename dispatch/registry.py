"""The registry of backends: one object per (implementation x format variant), with vLLM's verbs.

Every caller (``dispatch.linear``, ``QuantLinear``, ``explain``, ``b12x-dual info``, bench, sweep,
the vLLM plugin) reaches an implementation the same way:

    b = registry.get("triton", "nvfp4")            # a Backend
    b.is_supported(device)      -> (ok, reason)    # can this platform run it
    b.can_implement(problem)    -> (ok, reason)    # format, shape, dtype: pure, no device needed
    p = b.prepare(qweight, into=None)              # repack once (into=: reuse storage)
    y = b.apply(x, p, bias, **act_opts)            # the call: validates its arguments, then runs
    y = b.run(x, p, bias, **act_opts)              # the trusted hot path (arguments validated)

    b.route(problem, device)    -> Route           # the kernels apply launches, tile, split-K, why

    c = registry.choose("nvfp4", M, N, K, device)  # walks priority(device), cached per
                                                   # (device, variant, M bucket, N, K, dtype, request)

A layer's calls go through one ``dispatch.bound.BoundLinear``, which decides per call with
:func:`decide` (the request read once), keeps the prepared weights and runs the backend.

The vocabulary (variants, Problem, Backend, UnsupportedEntry, the errors, the M buckets) is
``dispatch.contract``, which this module and ``dispatch.backends`` both import; it is re-exported
here. A variant is a format (formats.FORMAT_NAMES) or its weight-only form ("nvfp4_w4a16",
"mxfp4_w4a16", "mxfp8_w8a16": activations stay bf16/fp16). A format is added by one entry in
``contract.FORMATS``; everything else is derived. An implementation that does not serve a variant
has an explicit :class:`UnsupportedEntry` saying why, so the table is complete.

What the caller asked for (``impl=`` > ``use_impl()`` > ``B12X_IMPL`` > auto) is read by
:mod:`dispatch.policy`; this module decides.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import backends, policy
from .contract import (A16_SUFFIX, A16_SUFFIXES, ACT_DTYPES, FORMATS, IMPLS, VARIANTS, Backend,  # noqa: F401  (re-exported)
                       FormatEntry, NoBackend, Problem, Unsupported, UnsupportedEntry, Variant, m_bucket,
                       variant, variant_name)
from .devices import DeviceInfo, resolve
from .policy import ImplementationUnavailable, Request

log = logging.getLogger(__name__)

# [priority]
PRIORITY: dict[str, tuple[str, ...]] = {
    "sm_90": ("hopper", "triton", "reference"),
    "sm_12x": ("cute", "triton", "reference"),
    "other": ("triton", "reference"),
}
"""The order auto tries the implementations in, per device class (:func:`device_class`): on sm_90
the Hopper production kernels, on SM120/SM121 b12x's CuTe DSL kernels, then the readable Triton
kernels and the oracle everywhere (other CUDA GPUs and the CPU interpreter)."""
# [/priority]


PRODUCTION = ("cute", "hopper")
"""The production implementations: auto not picking the one at the head of the list warns."""


def device_class(device: DeviceInfo) -> str:
    """The key of :data:`PRIORITY` for a device: "sm_90", "sm_12x" or "other"."""
    if device.is_sm90:
        return "sm_90"
    if device.is_sm12x:
        return "sm_12x"
    return "other"


def priority(device: DeviceInfo) -> tuple[str, ...]:
    """The implementations auto tries on ``device``, in order (``PRIORITY[device_class(device)]``)."""
    return PRIORITY[device_class(device)]


_TABLE: dict[tuple[str, str], object] = {}


def _build_table() -> None:
    for v in VARIANTS:
        for impl in IMPLS:
            _TABLE[(impl, v)] = backends.make(impl, v)


def entries() -> dict[tuple[str, str], object]:
    """The whole table: {(impl, variant): Backend or UnsupportedEntry}."""
    if not _TABLE:
        _build_table()
    return dict(_TABLE)


def get(impl: str, variant_name_: str):
    """The Backend of (impl, variant). Raises ValueError for an unknown name, :class:`Unsupported`
    (with the reason) for a declared-unsupported entry."""
    variant(variant_name_)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    entry = entries()[(impl, variant_name_)]
    if isinstance(entry, UnsupportedEntry):
        raise Unsupported(f"{entry.name} is not implemented: {entry.reason}")
    return entry


def verdict(entry, problem: Problem, device: DeviceInfo) -> tuple[bool, str]:
    """Can this table entry serve ``problem`` on ``device``: is_supported then can_implement, as
    one (ok, reason); a declared-unsupported entry gives (False, its reason)."""
    if isinstance(entry, UnsupportedEntry):
        return False, f"{entry.impl} does not implement {entry.variant}: {entry.reason}"
    ok, why = entry.is_supported(device)
    if not ok:
        return False, why
    ok2, why2 = entry.can_implement(problem)
    return ok2, (f"{why}; {why2}" if ok2 else why2)


check = verdict  # the old name, kept for one release (docs/dispatch.md)


def act_dtypes(variant_: str, impl: Optional[str] = None) -> tuple[torch.dtype, ...]:
    """The activation dtypes a call of ``variant_`` can take under the request ``impl`` (None: what
    use_impl() / B12X_IMPL / auto ask for): the forced implementation's (:data:`ACT_DTYPES`), or
    under auto the union over the implementations that have a backend for the variant (bfloat16,
    float16 and, through the reference, float32). Raises InvalidImplementation for an unknown
    name, ValueError for an unknown variant."""
    variant(variant_)
    return act_dtypes_of(variant_, policy.requested_impl(impl).impl)


@functools.lru_cache(maxsize=None)
def act_dtypes_of(variant_: str, requested: str) -> tuple[torch.dtype, ...]:
    """:func:`act_dtypes` for a request already read ("auto" or an implementation name)."""
    table = entries()  # fixed once built: the answer is cached per (variant, request)
    names = IMPLS if requested == "auto" else (requested,)
    found = [d for n in names if isinstance(table[(n, variant_)], Backend) for d in ACT_DTYPES[n]]
    if not found:  # a forced implementation with no backend for the variant: choose says why
        found = [d for (n, v), e in table.items() if v == variant_ and isinstance(e, Backend) for d in ACT_DTYPES[n]]
    return tuple(dict.fromkeys(found))


# ---------------------------------------------------------------------------------------------
# choose
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """The backend that serves a call, and why.

    backend: the Backend; impl: its implementation name.
    reason: why this one (for auto: the reasons of the ones skipped before it, then its own).
    requested / source: what was asked ("auto" or a name) and where from ("impl=", "use_impl()",
        "B12X_IMPL", "default").
    considered: ((impl, ok, reason), ...) for every entry looked at, in order.
    """

    backend: Backend
    reason: str
    requested: str
    source: str
    considered: tuple[tuple[str, bool, str], ...] = field(default=())

    @property
    def impl(self) -> str:
        return self.backend.impl


_cache: dict[tuple, Choice] = {}
_logged: set[tuple] = set()


def clear_cache() -> None:
    """Forget cached decisions and which choices were logged (tests; a changed environment)."""
    _cache.clear()
    _logged.clear()


def _log_once(c: Choice, device: DeviceInfo, variant_: str) -> None:
    key = (device, variant_, c.impl, c.reason)
    if key in _logged:
        return
    _logged.add(key)
    # Where a production implementation heads the priority list (cute on SM12x, hopper on sm_90),
    # anything else means the production path was missed: worth a warning.
    production = PRIORITY[device_class(device)][0]
    level = logging.WARNING if production in PRODUCTION and c.impl != production else logging.INFO
    log.log(level, "b12x-dual: %s on %s: auto chose %s: %s", variant_, device.describe(), c.impl, c.reason)


def choose(variant_: str, M: int, N: int, K: int, device: DeviceInfo, *, impl: Optional[str] = None,
           dtype: torch.dtype = torch.bfloat16, log_choice: bool = True) -> Choice:
    """The backend for y[M, N] = x[M, K] . W[N, K]^T in ``variant_`` on ``device``.

    Args:
        variant_: a name of :data:`VARIANTS`.
        M, N, K: the GEMM shape (M = tokens).
        device: where the call runs: a DeviceInfo (a described device works as well as a real one),
            a dispatch.devices.KNOWN_DEVICES key such as "h200", or a torch device.
        impl: per-call request; None reads use_impl() / B12X_IMPL / "auto" (dispatch.policy).
        dtype: the activation dtype.
        log_choice: log auto's choice once per (device, variant, backend, reason); False for reports.
    Returns:
        a :class:`Choice`; the same object for every call of a (device, variant, M bucket, N, K,
        dtype, request), so a hot path does no policy work after the first call.
    Raises:
        ValueError: unknown variant, or a device that is none of the above.
        dispatch.InvalidImplementation: an unknown name in impl= / use_impl() / B12X_IMPL.
        dispatch.ImplementationUnavailable: a forced implementation cannot serve the call.
        NoBackend: auto found nothing that serves the call (the message lists every reason).
    """
    if not isinstance(device, DeviceInfo):
        device = resolve(device)
    return decide(policy.requested_impl(impl), variant_, M, N, K, device, dtype=dtype, log_choice=log_choice)


def decide(request: Request, variant_: str, M: int, N: int, K: int, device: DeviceInfo, *,
           dtype: torch.dtype = torch.bfloat16, log_choice: bool = True) -> Choice:
    """:func:`choose` for a request already read (a ``policy.Request``, from
    ``policy.requested_impl``): a bound call reads the request once and decides with it. Same
    cache, result and errors as :func:`choose` (but no InvalidImplementation: the request was parsed)."""
    requested, source = request
    key = (device, variant_, m_bucket(M), N, K, dtype, requested, source)
    c = _cache.get(key)
    if c is not None:
        if log_choice and requested == "auto":
            _log_once(c, device, variant_)  # a set lookup: the decision may have been cached by a report
        return c
    variant(variant_)
    problem = Problem(variant_, M, N, K, dtype)
    table = entries()
    if requested != "auto":
        ok, why = verdict(table[(requested, variant_)], problem, device)
        if not ok:
            raise ImplementationUnavailable(requested, device, why)
        c = Choice(table[(requested, variant_)], why, requested, source, ((requested, True, why),))
    else:
        # [auto-walk]
        considered, skipped = [], []
        for name in priority(device):
            ok, why = verdict(table[(name, variant_)], problem, device)
            considered.append((name, ok, why))
            if ok:
                c = Choice(table[(name, variant_)], "; ".join(skipped + [why]) if skipped else why,
                           requested, source, tuple(considered))
                break
            skipped.append(why)
        if c is None:
            lines = "; ".join(f"{n}: {w}" for n, _, w in considered)
            raise NoBackend(f"no backend serves {variant_} M={M} N={N} K={K} {dtype} on {device.describe()}: {lines}")
        # [/auto-walk]
        if log_choice:
            _log_once(c, device, variant_)
    _cache[key] = c
    return c
