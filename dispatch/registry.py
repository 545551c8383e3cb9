"""The registry of backends: one object per (implementation x format variant), with vLLM's verbs.

Every caller (``dispatch.linear``, ``QuantLinear``, ``explain``, ``b12x-dual info``, bench, sweep,
the vLLM plugin) reaches an implementation the same way:

    b = registry.get("triton", "nvfp4")            # a Backend
    b.is_supported(device)      -> (ok, reason)    # can this platform run it
    b.can_implement(problem)    -> (ok, reason)    # format, shape, dtype: pure, no device needed
    p = b.prepare(qweight, into=None)              # repack once (into=: reuse storage)
    y = b.apply(x, p, bias, **act_opts)            # the hot path

    b.route(problem, device)    -> Route           # the kernels apply launches, tile, split-K, why

    c = registry.choose("nvfp4", M, N, K, device)  # walks priority(device), cached per
                                                   # (device, variant, M bucket, N, K, dtype, request)

A variant is a format (formats.FORMAT_NAMES) or its weight-only form ("nvfp4_w4a16",
"mxfp4_w4a16", "mxfp8_w8a16": activations stay bf16/fp16). A format is added to the registry by one entry in
:data:`FORMATS`; everything else here is derived. An implementation that does not serve a variant
has an explicit :class:`UnsupportedEntry` saying why, so the table is complete.

What the caller asked for (``impl=`` > ``use_impl()`` > ``B12X_IMPL`` > auto) is read by
:mod:`dispatch.policy`; this module decides.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from formats import FORMAT_NAMES, format_module

from .devices import DeviceInfo
from .policy import ImplementationUnavailable, requested_impl

log = logging.getLogger(__name__)

IMPLS = ("cute", "hopper", "triton", "reference")
"""The concrete implementations: cute (b12x, SM120/SM121), hopper (kernels_triton.hopper, sm_90),
triton (the readable kernels, every device) and reference (the formats/ oracle)."""

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
    if device.kind == "cuda" and tuple(device.capability) == (9, 0):
        return "sm_90"
    if device.is_sm12x:
        return "sm_12x"
    return "other"


def priority(device: DeviceInfo) -> tuple[str, ...]:
    """The implementations auto tries on ``device``, in order (``PRIORITY[device_class(device)]``)."""
    return PRIORITY[device_class(device)]


@dataclass(frozen=True)
class FormatEntry:
    """What the registry needs to know of a format beyond formats/: whether it has a weight-only
    variant (W4A16 for 4-bit weights, W8A16 for 8-bit ones)."""

    w4a16: bool = False
    w8a16: bool = False


# [format-entries]
FORMATS: dict[str, FormatEntry] = {
    "fp8_tensor": FormatEntry(),
    "fp8_block": FormatEntry(),
    "mxfp8": FormatEntry(w8a16=True),
    "nvfp4": FormatEntry(w4a16=True),
    "mxfp4": FormatEntry(w4a16=True),
    "fp8_channel": FormatEntry(),
}
"""One entry per format of formats.FORMAT_NAMES (a test checks the two agree)."""
# [/format-entries]

A16_SUFFIX = "_w4a16"
A16_SUFFIXES = {"w4a16": A16_SUFFIX, "w8a16": "_w8a16"}
"""The weight-only variant's name suffix per FormatEntry flag."""


@dataclass(frozen=True)
class Variant:
    """A row of the table: ``name`` ("nvfp4_w4a16"), its formats/ format ``fmt`` ("nvfp4") and
    ``a16`` (activations stay unquantized)."""

    name: str
    fmt: str
    a16: bool


def _variants() -> dict[str, Variant]:
    out = {}
    for fmt in FORMAT_NAMES:
        entry = FORMATS.get(fmt, FormatEntry())
        out[fmt] = Variant(fmt, fmt, False)
        for flag, suffix in A16_SUFFIXES.items():
            if getattr(entry, flag):
                out[fmt + suffix] = Variant(fmt + suffix, fmt, True)
    return out


VARIANTS: dict[str, Variant] = _variants()


def variant(name: str) -> Variant:
    """The Variant of a name; ValueError listing the names otherwise."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"format must be one of {tuple(VARIANTS)}, got {name!r}") from None


def variant_name(fmt: str, a16: bool = False) -> str:
    """(format, a16) -> variant name ("mxfp8", True -> "mxfp8_w8a16"); ValueError when the format
    has no weight-only variant."""
    if not a16:
        variant(fmt)
        return fmt
    for v in VARIANTS.values():
        if v.a16 and v.fmt == fmt:
            return v.name
    if fmt in VARIANTS:
        allowed = sorted(v.fmt for v in VARIANTS.values() if v.a16)
        raise ValueError(f"a16=True (weight-only W4A16 / W8A16) is defined for {allowed}, not {fmt!r}")
    return variant(fmt).name


@dataclass(frozen=True)
class Problem:
    """One GEMM y[M, N] = x[M, K] . W[N, K]^T of ``variant``; ``dtype`` is x's (and y's) dtype."""

    variant: str
    M: int
    N: int
    K: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def fmt(self) -> str:
        return variant(self.variant).fmt

    @property
    def a16(self) -> bool:
        return variant(self.variant).a16


class Unsupported(ValueError):
    """``get`` of an entry that is declared unsupported; the message says why."""


class NoBackend(ValueError):
    """auto found no backend for a call; the message lists every backend's reason."""


class Backend:
    """Base class of a backend: one implementation serving one variant.

    Subclasses implement the four verbs. ``prepare`` returns what ``apply`` consumes (for triton and
    reference the validated QuantizedTensor itself; for cute the repacked b12x weight), and with
    ``into=`` (an earlier result for a weight of the same shape) copies into its storage and
    returns it, so CUDA graphs that captured it stay valid.
    """

    impl: str = ""
    act_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    """The activation (and output) dtypes apply takes; can_implement refuses the others."""

    def __init__(self, variant_name: str):
        self.variant = variant_name
        spec = variant(variant_name)
        self.fmt, self.a16 = spec.fmt, spec.a16

    @property
    def name(self) -> str:
        return f"{self.impl}:{self.variant}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def is_supported(self, device: DeviceInfo) -> tuple[bool, str]:
        raise NotImplementedError

    def can_implement(self, problem: Problem) -> tuple[bool, str]:
        raise NotImplementedError

    def prepare(self, qweight, into=None):
        raise NotImplementedError

    def apply(self, x: torch.Tensor, prepared, bias: Optional[torch.Tensor] = None, **act_opts) -> torch.Tensor:
        raise NotImplementedError

    extra_options: tuple[str, ...] = ()
    """Keyword options of apply beyond the format's activation options (e.g. reference's out_dtype)."""

    @functools.cached_property
    def act_options(self) -> frozenset[str]:
        """The activation options apply takes: the keyword-only options of the format's oracle
        quantizer (fp8_tensor ``scale``, fp8_block ``ue8m0``, MX ``scale_rule``, nvfp4
        ``global_scale``; none for W4A16), plus ``extra_options``."""
        names = set(self.extra_options)
        if not self.a16:
            sig = inspect.signature(format_module(self.fmt).quantize)
            names |= {p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}
        return frozenset(names)

    def check_options(self, opts: dict) -> None:
        """ValueError naming an option this backend does not take, and the ones it does."""
        bad = set(opts) - self.act_options
        if bad:
            allowed = ", ".join(sorted(self.act_options)) or "none"
            raise ValueError(f"{self.name}: unknown option(s) {sorted(bad)} for {self.variant} on {self.impl}; "
                             f"allowed: {allowed}")

    def route(self, problem: Problem, device: DeviceInfo, **act_opts):
        """The route ``apply(x, prepared, bias, **act_opts)`` takes for ``problem`` on ``device``: a
        ``kernels_triton.Route`` with the kernels it launches (by name, in order), the tile
        (split-K included) and why. Pure: a described device gives the same answer as the real
        one. ``explain``, ``b12x-dual info``, bench and sweep report it (with the default, dynamic
        activation scales); a test checks it against the launches ``apply`` makes."""
        raise NotImplementedError

    # Two optional verbs for the test sweeps and benchmarks, which look inside a call: the
    # activation quantizer alone (compared bit for bit with the oracle) and the GEMM alone.
    def quantize_activation(self, x: torch.Tensor, **act_opts):
        """x [..., K] -> the activation QuantizedTensor this backend's GEMM consumes.
        Raises NotImplementedError where the backend has no separate quantizer (W4A16)."""
        raise NotImplementedError(f"{self.name} has no separate activation quantizer")

    def gemm(self, xq, prepared, bias: Optional[torch.Tensor] = None,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The GEMM alone on an already quantized activation xq [M, K] -> [M, N] of ``out_dtype``.
        Raises NotImplementedError where the backend has no separate GEMM (W4A16)."""
        raise NotImplementedError(f"{self.name} has no separate GEMM entry")

    @property
    def splits(self) -> bool:
        """True when quantize_activation and gemm are available separately."""
        return (type(self).quantize_activation is not Backend.quantize_activation
                and type(self).gemm is not Backend.gemm and not self.a16)


@dataclass(frozen=True)
class UnsupportedEntry:
    """A table cell with no backend: ``impl`` does not serve ``variant``, because ``reason``."""

    impl: str
    variant: str
    reason: str

    @property
    def name(self) -> str:
        return f"{self.impl}:{self.variant}"


_TABLE: dict[tuple[str, str], object] = {}


def _build_table() -> None:
    from . import backends

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


def check(entry, problem: Problem, device: DeviceInfo) -> tuple[bool, str]:
    """is_supported then can_implement of one table entry, as one (ok, reason)."""
    if isinstance(entry, UnsupportedEntry):
        return False, f"{entry.impl} does not implement {entry.variant}: {entry.reason}"
    ok, why = entry.is_supported(device)
    if not ok:
        return False, why
    ok2, why2 = entry.can_implement(problem)
    return ok2, (f"{why}; {why2}" if ok2 else why2)


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


def m_bucket(M: int) -> int:
    """The cache bucket of a token count: exact up to 16 (decode), else the next power of two.
    Backends' can_implement must give the same answer for every M of a bucket (tested)."""
    if M <= 16:
        return max(M, 0)
    return 1 << (M - 1).bit_length()


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
        device: where the call runs (a DeviceInfo: a described device works as well as a real one).
        impl: per-call request; None reads use_impl() / B12X_IMPL / "auto" (dispatch.policy).
        dtype: the activation dtype.
        log_choice: log auto's choice once per (device, variant, backend, reason); False for reports.
    Returns:
        a :class:`Choice`; the same object for every call of a (device, variant, M bucket, N, K,
        dtype, request), so a hot path does no policy work after the first call.
    Raises:
        ValueError: unknown variant.
        dispatch.InvalidImplementation: an unknown name in impl= / use_impl() / B12X_IMPL.
        dispatch.ImplementationUnavailable: a forced implementation cannot serve the call.
        NoBackend: auto found nothing that serves the call (the message lists every reason).
    """
    requested, source = requested_impl(impl)
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
        ok, why = check(table[(requested, variant_)], problem, device)
        if not ok:
            raise ImplementationUnavailable(requested, device, why)
        c = Choice(table[(requested, variant_)], why, requested, source, ((requested, True, why),))
    else:
        # [auto-walk]
        considered, skipped = [], []
        for name in priority(device):
            ok, why = check(table[(name, variant_)], problem, device)
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
