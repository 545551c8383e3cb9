"""What ``b12x-dual sweep`` and ``b12x-dual bench`` share: the implementations as registry backends,
fresh random inputs, error metrics, the device and library report, and output that degrades gracefully.

Implementations are reached only through :mod:`dispatch.registry`: a name maps to a factory
``variant -> table cell`` (for the built-in ones ``registry.entries()[(impl, variant)]``: a Backend
or an UnsupportedEntry). Per cell the apps ask ``registry.verdict(cell, Problem, device)`` with the
device the tensors are on (``running_device``); a cell that cannot run is a skip row carrying the
registry's reason. Then ``prepare``, ``apply`` (the whole linear), and where the sweep and bench
look inside a call ``quantize_activation`` / ``gemm`` (``backend.splits``):

    reference  formats/ oracle: formats.quantize (activation) and formats.reference_linear (the sweep
               asks apply(..., out_dtype=torch.float64): the exact product of the quantized operands)
    triton     kernels_triton.<fmt>
    cute       kernels_cute.<fmt> on SM120/SM121 with b12x; elsewhere skipped with the reason

A test (or a user) adds an implementation with ``extra_backends={"name": factory}``, ``factory(variant)``
returning a registry.Backend.

rich, tqdm and matplotlib are optional here: without rich the tables are plain text, without rich
and tqdm the progress is a line every few percent, without matplotlib ``--plot`` says so and skips.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable, Optional

import torch

import kernels_triton  # noqa: F401  (sets TRITON_INTERPRET=1 on a machine without a GPU, before any kernel)
import formats
from dispatch import registry
from dispatch.devices import CPU, DeviceInfo, current_device, interpreting
from dispatch.registry import VARIANTS
from formats import QuantizedTensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_NAMES[torch.float32] = "fp32"
DTYPE_NAMES[torch.float64] = "fp64"


def variants_from_formats(names: Optional[list[str]]) -> list[str]:
    """--formats: variant names of dispatch.registry.VARIANTS ("mxfp4" alone is W4A4 only,
    "mxfp4_w4a16" its weight-only form); the default (None) is every variant."""
    return list(VARIANTS) if names is None else names


# ---------------------------------------------------------------------------------------------
# Devices (versions: dispatch.api.library_versions)
# ---------------------------------------------------------------------------------------------
def on_gpu() -> bool:
    return torch.cuda.is_available()


def default_device() -> str:
    return "cuda" if on_gpu() else "cpu"


def device_report() -> dict[str, Any]:
    """The device as JSON: name, capability, SMs, L2, memory; or the CPU with the interpreter note."""
    if not on_gpu():
        return {"kind": "cpu", "name": platform.processor() or platform.machine(),
                "note": "no CUDA device: Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1)"}
    p = torch.cuda.get_device_properties(0)
    return {
        "kind": "cuda",
        "name": p.name,
        "capability": f"sm_{p.major}{p.minor}",
        "sm_count": p.multi_processor_count,
        "l2_bytes": int(getattr(p, "L2_cache_size", 0)),
        "memory_bytes": int(p.total_memory),
    }


def split(variant: str) -> tuple[str, bool]:
    """A variant name of dispatch.registry.VARIANTS -> (format, a16); ValueError naming them otherwise."""
    v = registry.variant(variant)
    return v.fmt, v.a16


# ---------------------------------------------------------------------------------------------
# Implementations: registry backends
# ---------------------------------------------------------------------------------------------
BackendFactory = Callable[[str], Any]
"""variant name -> the table cell that serves it: a registry.Backend, or a registry.UnsupportedEntry."""


def registry_backend(impl: str) -> BackendFactory:
    """The factory of a built-in implementation: its cell of ``registry.entries()`` per variant."""

    def factory(variant: str):
        return registry.entries()[(impl, variant)]

    factory.__name__ = f"registry_backend_{impl}"
    return factory


def implementations(names: Optional[list[str]], default: tuple[str, ...],
                    extra_backends: Optional[dict[str, BackendFactory]] = None) -> dict[str, BackendFactory]:
    """{name: factory} of the implementations to run: the built-in ``names`` (``default`` when None)
    in ``default``'s order, then ``extra_backends`` (name -> factory(variant) -> Backend) as given.
    ValueError naming an unknown built-in name."""
    names = list(default) if names is None else list(names)
    unknown = [n for n in names if n not in registry.IMPLS]
    if unknown:
        raise ValueError(f"implementations must be among {registry.IMPLS}, got {unknown}")
    out = {n: registry_backend(n) for n in default if n in names}
    for n, factory in (extra_backends or {}).items():
        if not callable(factory):
            raise ValueError(f"extra_backends[{n!r}] must be a callable variant -> Backend, got {factory!r}")
        out[n] = factory
    return out


def running_device(device: str) -> DeviceInfo:
    """The DeviceInfo the registry checks against for tensors on torch device ``device``: the
    current CUDA device for "cuda", :data:`dispatch.devices.CPU` (Triton's interpreter) otherwise."""
    return current_device() if torch.device(device).type == "cuda" else CPU


def check(entry, variant: str, M: int, N: int, K: int, dtype: torch.dtype, device: DeviceInfo) -> tuple[bool, str]:
    """registry.verdict of one cell on (variant, M, N, K, activation dtype) and ``device``: (ok, reason)."""
    return registry.verdict(entry, registry.Problem(variant, M, N, K, dtype), device)


def route_record(backend, variant: str, M: int, N: int, K: int, device: DeviceInfo,
                 dtype: torch.dtype = torch.bfloat16) -> Optional[dict[str, Any]]:
    """The route ``backend.apply`` takes for (variant, M, N, K) on ``device``, as JSON: {"impl",
    "kernels" (names, in launch order), "tile", "split_k", "why", "text" (api.route_text)}; None for
    a backend without a route (an extra one) or when the route cannot be computed."""
    try:
        r = backend.route(registry.Problem(variant, M, N, K, dtype), device)
    except Exception:  # noqa: BLE001  (a row records what it can; the call itself reports its errors)
        return None
    from dispatch.api import route_text

    return {"impl": r.impl, "kernels": list(r.kernels), "tile": r.tile, "split_k": r.split_k, "why": r.why,
            "text": route_text(r)}


def has_quantizer(backend) -> bool:
    """True when ``backend`` has its own quantize_activation (not W4A16, not the base class's)."""
    return (not backend.a16
            and type(backend).quantize_activation is not registry.Backend.quantize_activation)


def impl_note(name: str) -> str:
    """What a built-in implementation is, for the JSON's "impls"; empty for an extra one."""
    return {
        "reference": "formats/ oracle, float64 output",
        "triton": "Triton interpreter (CPU)" if interpreting() else "Triton on GPU",
        "hopper": "Hopper production Triton kernels (sm_90)",
        "cute": "b12x CuTe DSL (SM120/SM121)",
    }.get(name, "")


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def make_input(shape, dtype, gen: torch.Generator, device, *, block: int = 32) -> torch.Tensor:
    """Fresh random activations: normal values, ~0.2% outliers x40 and (when K allows) a few
    all-zero ``block``-wide groups along K (both the amax and the zero-block paths). Drawn on
    ``device`` with ``gen`` (a generator of that device)."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float32, device=device)
    flat = x.reshape(-1, shape[-1])
    n = flat.numel()
    if n:
        idx = torch.randint(0, n, (max(1, n // 500),), generator=gen, device=device)
        flat.view(-1)[idx] *= 40.0
    if flat.shape[0] and shape[-1] >= 2 * block:
        rows = torch.randint(0, flat.shape[0], (max(1, flat.shape[0] // 4),), generator=gen, device=device)
        kb = torch.randint(0, shape[-1] // block, (rows.numel(),), generator=gen, device=device)
        cols = kb[:, None] * block + torch.arange(block, device=device)[None, :]
        flat[rows[:, None], cols] = 0.0
    return x.to(dtype)


def make_weight(n: int, k: int, gen: torch.Generator, device) -> torch.Tensor:
    """A float32 weight [N, K] ~ N(0, 0.05^2) with a few outliers (outputs stay in fp16 range)."""
    w = torch.randn(n, k, generator=gen, dtype=torch.float32, device=device) * 0.05
    idx = torch.randint(0, w.numel(), (max(1, w.numel() // 1000),), generator=gen, device=device)
    w.view(-1)[idx] *= 20.0
    return w


def qt_nbytes(q: QuantizedTensor) -> int:
    """Bytes of a QuantizedTensor: codes + scales (+ global scale)."""
    return sum(t.numel() * t.element_size() for t in q.tensors().values())


def clone_qt(q: QuantizedTensor) -> QuantizedTensor:
    """A copy in distinct memory (same values), for rotating weights past the L2."""
    from dataclasses import replace

    g = None if q.global_scale is None else q.global_scale.clone()
    return replace(q, data=q.data.clone(), scale=q.scale.clone(), global_scale=g)


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def compare_outputs(y: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Errors of y against ref (both computed in float64):

    norm_rel  ||y - ref|| / ||ref||          (the metric the sweep's tolerances bound)
    max_rel   max |y - ref| / max |ref|
    mean_rel  mean |y - ref| / mean |ref|
    cosine    <y, ref> / (||y|| ||ref||)
    Any NaN/Inf in y or ref makes the errors inf and the cosine -inf (NaN never passes)."""
    if tuple(y.shape) != tuple(ref.shape):
        return {"norm_rel": math.inf, "max_rel": math.inf, "mean_rel": math.inf, "cosine": -math.inf,
                "shape_mismatch": f"{tuple(y.shape)} vs {tuple(ref.shape)}"}
    a = y.detach().to(torch.float64).reshape(-1)
    b = ref.detach().to(torch.float64).reshape(-1)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return {"norm_rel": math.inf, "max_rel": math.inf, "mean_rel": math.inf, "cosine": -math.inf}
    if a.numel() == 0:
        return {"norm_rel": 0.0, "max_rel": 0.0, "mean_rel": 0.0, "cosine": 1.0}
    d = a - b
    nb, na = b.norm().item(), a.norm().item()
    safe = lambda v: v if v > 0 else 1.0  # noqa: E731
    cos = 1.0 if (na == 0 and nb == 0) else (a @ b).item() / safe(na * nb)
    return {
        "norm_rel": d.norm().item() / safe(nb),
        "max_rel": d.abs().max().item() / safe(b.abs().max().item()),
        "mean_rel": d.abs().mean().item() / safe(b.abs().mean().item()),
        "cosine": cos,
    }


def _bytes_of(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def linear_scales(q: QuantizedTensor) -> torch.Tensor:
    """q's scales in linear layout (swizzled_128x4 ones unswizzled), for byte comparison."""
    if q.scale_layout == "swizzled_128x4" and q.block_shape is not None:
        return formats.unswizzle_128x4(q.scale, q.rows, q.k // q.block_shape[1])
    return q.scale


def compare_quantized(q: Optional[QuantizedTensor], ref: QuantizedTensor) -> dict[str, Any]:
    """Bit-exactness of an activation against the oracle's: codes, scales and global scale compared
    as bytes. Returns {ok, data_equal, scale_equal, global_scale_equal, mismatched_bytes, detail}."""
    if q is None:
        return {"ok": None, "detail": "no quantize_activation"}
    out: dict[str, Any] = {"mismatched_bytes": 0}
    detail = []
    for name, a, b in (
        ("data", q.data, ref.data),
        ("scale", linear_scales(q), ref.scale),
        ("global_scale", q.global_scale, ref.global_scale),
    ):
        if a is None and b is None:
            out[f"{name}_equal"] = True
            continue
        if (a is None) != (b is None):
            out[f"{name}_equal"] = False
            detail.append(f"{name}: present in only one")
            continue
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            out[f"{name}_equal"] = False
            detail.append(f"{name}: {a.dtype}{tuple(a.shape)} vs oracle {b.dtype}{tuple(b.shape)}")
            continue
        ab, bb = _bytes_of(a), _bytes_of(b).to(a.device)
        bad = int((ab != bb).sum().item())
        out[f"{name}_equal"] = bad == 0
        out["mismatched_bytes"] += bad
        if bad:
            detail.append(f"{name}: {bad} of {ab.numel()} bytes differ")
    out["ok"] = all(out[f"{n}_equal"] for n in ("data", "scale", "global_scale"))
    out["detail"] = "; ".join(detail)
    return out


# ---------------------------------------------------------------------------------------------
# Output: tables, progress, JSON
# ---------------------------------------------------------------------------------------------
def _have(mod: str) -> bool:
    try:
        importlib.import_module(mod)
        return True
    except Exception:
        return False


HAVE_RICH = _have("rich")
HAVE_TQDM = _have("tqdm")


def console(stderr: bool = False):
    """A rich Console wide enough for the tables when stdout is not a terminal (a log file)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 200)


def fmt_num(v, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


def print_table(title: str, columns: list[str], rows: list[list], *, plain: bool = False) -> None:
    """A table with rich when it is installed (and ``plain`` is false), else fixed-width text."""
    rows = [[("" if c is None else str(c)) for c in r] for r in rows]
    if HAVE_RICH and not plain:
        from rich.markup import escape
        from rich.table import Table

        # cells are text, not rich markup: "[hopper] ..." must print as written
        t = Table(title=escape(title), show_lines=False)
        for c in columns:
            t.add_column(escape(c), overflow="fold")
        for r in rows:
            t.add_row(*(escape(v) for v in r))
        console().print(t)
        return
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    sys.stdout.flush()


class Progress:
    """A progress bar on stderr: rich, else tqdm, else a line every ~10%. ``enabled=False`` is silent."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._rich = self._tqdm = None
        self._last_pct = -1
        if not enabled:
            return
        if HAVE_RICH:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn

            self._rich = RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[label]}"),
                            console=console(stderr=True), transient=False)
            self._task = self._rich.add_task(desc, total=total, label="")
            self._rich.start()
        elif HAVE_TQDM:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=desc, file=sys.stderr, mininterval=1.0)

    def advance(self, label: str = "", n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=n, label=label)
        elif self._tqdm is not None:
            self._tqdm.set_postfix_str(label, refresh=False)
            self._tqdm.update(n)
        else:
            pct = int(100 * self.n / max(1, self.total)) // 10 * 10
            if pct != self._last_pct:
                self._last_pct = pct
                print(f"{self.desc}: {self.n}/{self.total} ({pct}%) {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        if self._tqdm is not None:
            self._tqdm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _json_default(o):
    if isinstance(o, float):
        return str(o)
    if isinstance(o, torch.dtype):
        return str(o)
    return repr(o)


def _finite(o):
    """inf/nan -> strings so that the file is strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return "inf" if o > 0 else ("-inf" if o < 0 else "nan")
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str, data: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(data), f, indent=1, default=_json_default)
        f.write("\n")


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
