"""Which implementation serves a call: per (device, format, shape), and why.

Three implementations can compute a quantized linear layer:

    cute       b12x's CuTe DSL kernels (kernels_cute/): the production path, SM120/SM121 only.
    triton     the readable Triton kernels (kernels_triton/): any CUDA GPU, and the CPU through
               Triton's interpreter (TRITON_INTERPRET=1).
    reference  the formats/ oracle (dequantize, float64 matmul): every device, slow.

What the caller asks for, highest priority first: the per-call ``impl=`` argument, the innermost
``use_impl(...)`` context, the ``B12X_IMPL`` environment variable, and finally "auto".

    auto       cute when the device is SM120/SM121, b12x reports it supported and the shape is in
               kernels_cute's supported set; otherwise triton (otherwise reference, if the Triton
               module of the format is missing). Each fallback is logged once per (format, reason).
    cute | triton | reference
               that implementation, or ImplementationUnavailable naming it, the device and the
               reason. A forced implementation never falls back silently.

Everything here takes a :class:`dispatch.devices.DeviceInfo`, so the whole table can be evaluated
(and is tested) for devices this machine does not have.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from formats import FORMAT_NAMES

from .devices import DeviceInfo, current_device, interpreting

log = logging.getLogger(__name__)

ENV_VAR = "B12X_IMPL"
IMPLS = ("auto", "cute", "triton", "reference")
"""Values B12X_IMPL / use_impl / impl= accept."""
CONCRETE_IMPLS = ("cute", "triton", "reference")
INSTALL_CUTE = "pip install 'b12x-dual[cute]'"

A16_VARIANT = "mxfp4_w4a16"
VARIANTS: dict[str, tuple[str, bool]] = {**{f: (f, False) for f in FORMAT_NAMES}, A16_VARIANT: ("mxfp4", True)}
"""Named variants -> (format, a16). "mxfp4_w4a16" is MXFP4 weights with unquantized activations."""

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


def split_variant(name: str) -> tuple[str, bool]:
    """A format or variant name -> (format, a16). ValueError listing the names otherwise."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"format must be one of {tuple(VARIANTS)}, got {name!r}") from None


def variant_name(fmt: str, a16: bool) -> str:
    """Inverse of split_variant; ValueError for a16 on a format that has no A16 variant."""
    if a16 and fmt != "mxfp4":
        raise ValueError(f"a16=True (weight-only W4A16) is only defined for mxfp4, not {fmt!r}")
    return A16_VARIANT if a16 else fmt


# ---------------------------------------------------------------------------------------------
# Can an implementation serve (device, format, shape)? Each check returns (ok, reason).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class B12xProbe:
    """Result of importing b12x once: the module (None if absent), its version, the import error."""

    module: object
    version: Optional[str]
    error: Optional[str]


@functools.lru_cache(maxsize=1)
def b12x_probe() -> B12xProbe:
    """Import b12x lazily, once (importing it pulls in CuTe DSL; nothing here needs it otherwise)."""
    try:
        mod = importlib.import_module("b12x")
    except Exception as e:  # noqa: BLE001  (any import failure means "not usable", with the reason)
        return B12xProbe(None, None, f"{type(e).__name__}: {e}")
    return B12xProbe(mod, _dist_version("b12x") or getattr(mod, "__version__", "?"), None)


def _dist_version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _b12x_is_supported(mod) -> Optional[bool]:
    """b12x's own device gate for the running GPU, wherever this b12x version exposes it (asked
    once per process: the answer cannot change, and this sits on every call's path)."""
    fn = getattr(mod, "is_supported", None)
    if fn is None:
        try:
            fn = getattr(importlib.import_module("b12x.gemm.blockscaled"), "is_supported", None)
        except Exception:  # noqa: BLE001
            fn = None
    return None if fn is None else bool(fn())


def _is_running_device(device: DeviceInfo) -> bool:
    return device.kind == "cuda" and torch.cuda.is_available() and current_device() == device


def b12x_support(device: DeviceInfo) -> tuple[bool, str]:
    """Can b12x run on ``device``? SM120/121, b12x importable, and b12x's own gate (when the device
    is the one this process runs on; a described device is judged by its capability)."""
    if device.kind == "cpu":
        return False, "cute needs an SM120/SM121 GPU; this call runs on the CPU"
    if not device.is_sm12x:
        return False, f"cute needs an SM120/SM121 GPU; {device.name} is {device.arch}"
    probe = b12x_probe()
    if probe.module is None:
        return False, f"b12x is not installed ({probe.error}); install it with: {INSTALL_CUTE}"
    if _is_running_device(device):
        ok = _b12x_is_supported(probe.module)
        if ok is None:
            return False, f"b12x {probe.version} has no is_supported(); expected b12x==1.5.1 ({INSTALL_CUTE})"
        if not ok:
            return False, (f"b12x {probe.version} reports {device.arch} unsupported "
                           f"(it needs nvidia-cutlass-dsl>=4.6 and triton; {INSTALL_CUTE})")
        return True, f"b12x {probe.version} supports {device.arch}"
    return True, f"b12x {probe.version} targets {device.arch} (described device, not probed)"


def kernels_cute_supported(fmt: str, M: int, N: int, K: int, device: DeviceInfo) -> tuple[bool, str]:
    """Is (format, M, N, K) in kernels_cute's supported set on ``device``?

    Calls ``kernels_cute.supported(fmt, M, N, K, device)`` when kernels_cute defines it (``fmt`` may
    be the variant name "mxfp4_w4a16"); until it does, nothing is supported.
    """
    try:
        kc = importlib.import_module("kernels_cute")
    except Exception as e:  # noqa: BLE001
        return False, f"kernels_cute does not import ({type(e).__name__}: {e})"
    fn = getattr(kc, "supported", None)
    if fn is None:
        return False, "kernels_cute has no supported shapes yet"
    ok, reason = fn(fmt, M, N, K, device)
    return bool(ok), str(reason)


@functools.lru_cache(maxsize=None)
def _triton_module_present(fmt: str) -> bool:
    try:
        return importlib.util.find_spec(f"kernels_triton.{fmt}") is not None
    except ImportError:
        return False


def triton_support(fmt: str, device: DeviceInfo) -> tuple[bool, str]:
    """Can the Triton kernels serve ``fmt`` on ``device``? Module present, and on the CPU the
    interpreter on (kernels_triton turns it on at import when there is no GPU)."""
    if not _triton_module_present(fmt):
        return False, f"kernels_triton.{fmt} is not in this installation"
    if device.kind == "cpu":
        importlib.import_module("kernels_triton")  # sets TRITON_INTERPRET=1 when there is no GPU
        if not interpreting():
            value = os.environ.get("TRITON_INTERPRET", "")
            return False, (f"CPU tensors need Triton's interpreter but TRITON_INTERPRET={value!r}; set "
                           "TRITON_INTERPRET=1 before kernels_triton is imported, or move the inputs to the GPU")
        return True, "Triton interpreter on CPU (TRITON_INTERPRET=1)"
    return True, f"Triton kernels on {device.arch}"


def cute_support(variant: str, M: int, N: int, K: int, device: DeviceInfo) -> tuple[bool, str]:
    """b12x_support and kernels_cute_supported together (the reasons joined)."""
    ok, why = b12x_support(device)
    if not ok:
        return False, why
    ok2, why2 = kernels_cute_supported(variant, M, N, K, device)
    return ok2, f"{why}; {why2}"


# ---------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """The implementation that serves a call, and why.

    impl: "cute" | "triton" | "reference".
    reason: why this one (for auto: why not the ones before it).
    requested: what was asked for ("auto" or a forced name); source: where that came from
        ("impl=", "use_impl()", "B12X_IMPL" or "default").
    """

    impl: str
    reason: str
    requested: str
    source: str


_logged: set[tuple[str, str]] = set()


def _log_fallback_once(variant: str, reason: str, device: DeviceInfo) -> None:
    key = (variant, reason)
    if key in _logged:
        return
    _logged.add(key)
    # On SM12x a fallback means the production path was missed: worth a warning. Elsewhere Triton
    # is simply the implementation for that device.
    level = logging.WARNING if device.is_sm12x else logging.INFO
    log.log(level, "b12x-dual: %s on %s: auto did not pick cute: %s", variant, device.describe(), reason)


def reset_fallback_log() -> None:
    """Forget which fallbacks were logged (for tests)."""
    _logged.clear()


def choose(fmt: str, M: int, N: int, K: int, device: DeviceInfo, *, impl: Optional[str] = None,
           a16: bool = False, log_fallback: bool = True) -> Choice:
    """Pick the implementation for y[M, N] = x[M, K] . W[N, K]^T in ``fmt`` on ``device``.

    Args:
        fmt: a format name, or the variant "mxfp4_w4a16" (same as fmt="mxfp4", a16=True).
        M, N, K: the GEMM shape (M = tokens).
        device: where the call runs.
        impl: per-call override; None means use_impl() / B12X_IMPL / "auto".
        a16: weight-only MXFP4 (activations unquantized).
        log_fallback: log auto's fallbacks (once per (format, reason)); False for reports.
    Raises:
        InvalidImplementation: an unknown name in impl=/use_impl()/B12X_IMPL.
        ImplementationUnavailable: a forced implementation cannot serve this call.
        ValueError: unknown format, or a16 on a format other than mxfp4.
    """
    base, variant_a16 = split_variant(fmt)
    a16 = a16 or variant_a16
    variant = variant_name(base, a16)
    requested, source = requested_impl(impl)

    if requested == "reference":
        return Choice("reference", "the formats/ oracle runs on every device", requested, source)
    if requested == "triton":
        ok, why = triton_support(base, device)
        if not ok:
            raise ImplementationUnavailable("triton", device, why)
        return Choice("triton", why, requested, source)
    if requested == "cute":
        ok, why = cute_support(variant, M, N, K, device)
        if not ok:
            raise ImplementationUnavailable("cute", device, why)
        return Choice("cute", why, requested, source)

    # auto
    ok, why = cute_support(variant, M, N, K, device)
    if ok:
        return Choice("cute", why, requested, source)
    ok_t, why_t = triton_support(base, device)
    if ok_t:
        if log_fallback:
            _log_fallback_once(variant, why, device)
        return Choice("triton", why, requested, source)
    reason = f"{why}; {why_t}"
    if log_fallback:
        _log_fallback_once(variant, reason, device)
    return Choice("reference", reason, requested, source)


def shape_classes(N: int = 4096, K: int = 4096) -> dict[str, tuple[int, int, int]]:
    """The shape classes the table and `b12x-dual info` report: decode (M=1, 16), prefill (M=4096)."""
    out = {f"decode M={m}": (m, N, K) for m in DECODE_M}
    out[f"prefill M={PREFILL_M}"] = (PREFILL_M, N, K)
    return out
