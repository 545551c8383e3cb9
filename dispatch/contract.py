"""The contract between the registry and its backends: what both sides name, and nothing that decides.

``dispatch.registry`` decides which backend serves a call; ``dispatch.backends`` implements the
backends. Both import this module and neither imports the other for it:

    IMPLS                      the implementations: cute, hopper, triton, reference
    ACT_DTYPES                 the activation (and output) dtypes each implementation takes
    FORMATS, Variant, VARIANTS the table's rows: a format, or its weight-only W4A16 form
    Problem                    one GEMM y[M, N] = x[M, K] . W[N, K]^T of a variant
    Backend                    the verbs every backend has (vLLM's four, ``run`` and ``route``)
    UnsupportedEntry           a table cell with no backend, and why
    m_bucket, M_BUCKETS        the M buckets a decision holds for (a backend's verdict is constant
                               inside one); DECODE_M / PREFILL_M, the shape classes reports show
    the errors                 Unsupported, NoBackend, InvalidImplementation, ImplementationUnavailable
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch

from formats import FORMAT_NAMES, format_module
from formats.validate import ACT_DTYPES as KERNEL_DTYPES
from formats.validate import check_bias, check_linear_input

from .devices import DeviceInfo

IMPLS = ("cute", "hopper", "triton", "reference")
"""The implementations: cute (b12x, SM120/SM121), hopper (kernels_triton.hopper, sm_90), triton
(the readable kernels, every device) and reference (the formats/ oracle). What a caller may ask
for adds "auto" (:data:`dispatch.policy.REQUESTS`)."""

ACT_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cute": KERNEL_DTYPES,
    "hopper": KERNEL_DTYPES,
    "triton": KERNEL_DTYPES,
    "reference": KERNEL_DTYPES + (torch.float32,),
}
"""The activation (and output) dtypes of each implementation: the kernels take bf16 and fp16
(``KERNEL_DTYPES``, formats.validate's, which the kernels' own checks use); the oracle also float32. A backend's ``can_implement`` refuses the others; the public door's dtype
check names the union over what a request may run (:func:`dispatch.registry.act_dtypes`)."""


# ---------------------------------------------------------------------------------------------
# The M vocabulary
# ---------------------------------------------------------------------------------------------
DECODE_MAX_M = 16
"""Token counts up to this one are decode calls: each is a bucket of its own."""
MAX_BUCKET_M = 1 << 20
"""The largest token count :data:`M_BUCKETS` covers (a vLLM layer is prepared for each bucket up to it)."""


def m_bucket(M: int) -> int:
    """The bucket of a token count: exact up to :data:`DECODE_MAX_M` (decode), else the next power
    of two. The registry caches its decision per bucket, so a backend's ``can_implement`` must give
    the same answer for every M of a bucket (tested)."""
    if M <= DECODE_MAX_M:
        return max(M, 0)
    return 1 << (M - 1).bit_length()


M_BUCKETS: tuple[int, ...] = tuple(range(1, DECODE_MAX_M + 1)) + tuple(
    1 << i for i in range(DECODE_MAX_M.bit_length(), MAX_BUCKET_M.bit_length()))
"""One M per bucket of :func:`m_bucket` from 1 to :data:`MAX_BUCKET_M` (each its bucket's own
value): 1..16, then 32, 64, ..., 2^20. A layer prepared for the choice of each serves any call
up to 2^20 tokens."""

DECODE_M = (1, DECODE_MAX_M)
"""The decode shape classes reports show (explain, ``b12x-dual info``, bench's default Ms)."""
PREFILL_M = 4096
"""The prefill shape class reports show."""


def shape_classes(N: int = 4096, K: int = 4096) -> dict[str, tuple[int, int, int]]:
    """{label: (M, N, K)} of the shape classes reports show: decode (M = 1, 16), prefill (M = 4096)."""
    out = {f"decode M={m}": (m, N, K) for m in DECODE_M}
    out[f"prefill M={PREFILL_M}"] = (PREFILL_M, N, K)
    return out


def tokens(x: torch.Tensor) -> int:
    """M of an activation [..., K]: the number of rows once the leading dims are flattened."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class Unsupported(ValueError):
    """``registry.get`` of an entry that is declared unsupported; the message says why."""


class NoBackend(ValueError):
    """auto found no backend for a call; the message lists every backend's reason."""


class InvalidImplementation(ValueError):
    """B12X_IMPL, use_impl() or impl= holds a name that is not in dispatch.policy.REQUESTS."""


class ImplementationUnavailable(ValueError):
    """A forced implementation cannot serve the call. ``impl``, ``device`` and ``reason`` say why."""

    def __init__(self, impl: str, device: DeviceInfo, reason: str):
        self.impl, self.device, self.reason = impl, device, reason
        super().__init__(f"implementation {impl!r} cannot serve this call on {device.describe()}: {reason}")


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------
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


def variant(name: str, arg: str = "format") -> Variant:
    """The Variant of a name; ValueError naming ``arg`` (the caller's argument: "format" for a
    linear, "variant" for an MoE layer) and listing the names otherwise."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{arg} must be one of {tuple(VARIANTS)}, got {name!r}") from None


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


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------
class Backend:
    """Base class of a backend: one implementation serving one variant.

    Subclasses implement ``is_supported``, ``can_implement``, ``prepare``, ``run`` and ``route``.
    ``prepare`` returns what ``run`` consumes (for triton and reference the validated
    QuantizedTensor itself; for cute the repacked b12x weight), and with ``into=`` (an earlier
    result for a weight of the same shape) copies into its storage and returns it, so CUDA graphs
    that captured it stay valid. ``apply`` is the public call: it validates its arguments
    (:meth:`validate_call`), then runs. ``run`` is the trusted path of a caller that validated
    them at its own door (``dispatch.bound.BoundLinear``): it checks nothing of x again.
    """

    impl: str = ""

    def __init__(self, variant_name: str):
        self.variant = variant_name
        spec = variant(variant_name)
        self.fmt, self.a16 = spec.fmt, spec.a16

    @property
    def act_dtypes(self) -> tuple[torch.dtype, ...]:
        """The activation (and output) dtypes ``apply`` takes (:data:`ACT_DTYPES` of the implementation)."""
        return ACT_DTYPES[self.impl]

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

    def run(self, x: torch.Tensor, prepared, bias: Optional[torch.Tensor] = None, **act_opts) -> torch.Tensor:
        """y [..., N] = x [..., K] . W^T (+ bias) on arguments the caller has validated (x a float
        tensor [..., K] of one of :attr:`act_dtypes`, bias None or [N] on x's device, ``act_opts``
        among :attr:`act_options`): the hot path of a bound call. Raises only what the kernels
        raise (and ImplementationUnavailable where x lives where they cannot run)."""
        raise NotImplementedError

    def apply(self, x: torch.Tensor, prepared, bias: Optional[torch.Tensor] = None, **act_opts) -> torch.Tensor:
        """y [..., N] = x [..., K] . W^T (+ bias), x bf16/fp16 (the reference also float32), y of
        x's dtype: :meth:`validate_call`, then :meth:`run`. Raises ValueError naming a bad
        argument (an unknown option, x or bias as formats.validate.check_linear_input / check_bias
        say)."""
        self.validate_call(x, prepared, bias, act_opts)
        return self.run(x, prepared, bias, **act_opts)

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

    def validate_options(self, opts: dict) -> None:
        """ValueError naming an option this backend does not take, and the ones it does."""
        bad = set(opts) - self.act_options
        if bad:
            allowed = ", ".join(sorted(self.act_options)) or "none"
            raise ValueError(f"{self.name}: unknown option(s) {sorted(bad)} for {self.variant} on {self.impl}; "
                             f"allowed: {allowed}")

    def check_options(self, opts: dict) -> None:
        """The old name of :meth:`validate_options`, kept for one release (docs/dispatch.md)."""
        self.validate_options(opts)

    def validate_call(self, x, prepared, bias, act_opts: dict) -> None:
        """The argument checks of :meth:`apply` (formats.validate), options first: x a float
        tensor [..., K] of a dtype in :attr:`act_dtypes`, not on the meta device; bias None or [N]
        on x's device. ``prepared`` is what prepare returned (its ``shape`` is (N, K)). Raises
        ValueError naming the argument, the value and what is allowed."""
        self.validate_options(act_opts)
        n, k = prepared.shape
        check_linear_input(x, k, self.act_dtypes)
        check_bias(bias, n, x.device)

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
