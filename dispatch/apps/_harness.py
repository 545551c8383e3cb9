"""What ``b12x-dual sweep`` and ``b12x-dual bench`` share: the implementations as adapters, fresh
random inputs, error metrics, the device and library report, and output that degrades gracefully.

Implementations (``Impl``), each reached the same way whatever library is behind it:

    reference  formats/ oracle: formats.quantize (activation) and formats.reference_linear (float64
               out, so it is the exact value of the quantized operands' product)
    triton     kernels_triton.<fmt>: quantize_activation, gemm, linear (a16=True for W4A16)
    cute       kernels_cute.<fmt>: quantize_activation, gemm, linear when this device can
               run it (SM120/121); otherwise skipped with the reason (the registry's cute backend)

A test (or a user) can add an implementation by passing ``extra_impls={"name": Impl(...)}``.

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
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import kernels_triton  # noqa: F401  (sets TRITON_INTERPRET=1 on a machine without a GPU, before any kernel)
import formats
from dispatch import registry
from dispatch.devices import current_device, interpreting
from dispatch.registry import VARIANTS
from formats import QuantizedTensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_NAMES[torch.float32] = "fp32"
DTYPE_NAMES[torch.float64] = "fp64"


def variants_from_formats(names: Optional[list[str]]) -> list[str]:
    """--formats: format names and/or "mxfp4_w4a16"; "mxfp4" alone keeps only W4A4, so the default
    (None) is all five formats plus the W4A16 row."""
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


def registry_support(impl: str, variant: str, M: int, N: int, K: int) -> tuple[bool, str]:
    """The registry's verdict on (impl, variant) for this process's device and shape (bf16)."""
    try:
        entry = registry.get(impl, variant)
    except registry.Unsupported as e:
        return False, str(e)
    return registry.check(entry, registry.Problem(variant, M, N, K), current_device())


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------
def _always(variant: str, M: int, N: int, K: int) -> tuple[bool, str]:
    return True, ""


def _identity_prepare(qweight: QuantizedTensor, a16: bool):
    return qweight


@dataclass
class Impl:
    """One implementation as the harness drives it.

    linear(x, prepared, qweight, bias, a16) -> y [M, N]   (required)
    prepare(qweight, a16) -> what linear/gemm consume      (default: the QuantizedTensor itself)
    quantize(x, fmt) -> QuantizedTensor                    (optional; compared bit for bit with the oracle)
    gemm(xq, prepared, qweight, bias, out_dtype) -> y      (optional; the GEMM alone, for bench)
    support(variant, M, N, K) -> (ok, reason)              (default: always)
    """

    name: str
    linear: Callable
    prepare: Callable = _identity_prepare
    quantize: Optional[Callable] = None
    gemm: Optional[Callable] = None
    support: Callable = _always
    note: str = ""


def reference_impl() -> Impl:
    def linear(x, prepared, qweight, bias, a16):
        # float64 out: the exact product of the quantized operands (rounded once, to float64)
        return formats.reference_linear(x, qweight, bias, a16=a16, out_dtype=torch.float64)

    def quantize(x, fmt):
        return formats.quantize(x, fmt, role="activation")

    return Impl("reference", linear, quantize=quantize, note="formats/ oracle, float64 output")


def triton_impl() -> Impl:
    def mod(fmt):
        return kernels_triton.module(fmt)

    def support(variant, M, N, K):
        fmt, _ = split(variant)
        try:
            mod(fmt)
        except Exception as e:  # a format module not written yet, or one that does not import
            return False, f"kernels_triton.{fmt} does not import ({type(e).__name__}: {e})"
        return True, ""

    def linear(x, prepared, qweight, bias, a16):
        m = mod(qweight.fmt)
        return m.linear(x, qweight, bias, a16=True) if a16 else m.linear(x, qweight, bias)

    def quantize(x, fmt):
        return mod(fmt).quantize_activation(x)

    def gemm(xq, prepared, qweight, bias, out_dtype):
        return mod(qweight.fmt).gemm(xq, qweight, bias, out_dtype=out_dtype)

    note = "Triton interpreter (CPU)" if interpreting() else "Triton on GPU"
    return Impl("triton", linear, quantize=quantize, gemm=gemm, support=support, note=note)


def cute_impl() -> Impl:
    """kernels_cute, probed: skipped with a reason unless the format module exposes ``linear`` and
    the device can run it."""

    def mod(fmt):
        return importlib.import_module(f"kernels_cute.{fmt}")

    def support(variant, M, N, K):
        fmt, _ = split(variant)
        # the device first: that is the reason that matters on a machine without SM12x
        if not on_gpu():
            return False, "cute needs an SM120/SM121 GPU; no CUDA device here"
        cap = torch.cuda.get_device_capability()
        if cap not in ((12, 0), (12, 1)):
            return False, f"cute needs an SM120/SM121 GPU; this one is sm_{cap[0]}{cap[1]}"
        try:
            m = mod(fmt)
        except Exception as e:
            return False, f"kernels_cute.{fmt} does not import ({type(e).__name__}: {e})"
        if not callable(getattr(m, "linear", None)):
            return False, f"kernels_cute.{fmt} has no linear()"
        # the dispatcher's own test: b12x installed and supporting this GPU, the shape
        ok, why = registry_support("cute", variant, M, N, K)
        return (True, "") if ok else (False, why)

    def prepare(qweight, a16):
        m = mod(qweight.fmt)
        if not hasattr(m, "prepare_weight"):
            return qweight
        return m.prepare_weight(qweight, a16=True) if a16 else m.prepare_weight(qweight)

    def linear(x, prepared, qweight, bias, a16):
        m = mod(qweight.fmt)
        return m.linear(x, prepared, bias, a16=True) if a16 else m.linear(x, prepared, bias)

    def quantize(x, fmt):
        m = mod(fmt)
        if not hasattr(m, "quantize_activation"):
            return None
        return m.quantize_activation(x)

    def gemm(xq, prepared, qweight, bias, out_dtype):
        return mod(qweight.fmt).gemm(xq, prepared, bias, out_dtype=out_dtype)

    return Impl("cute", linear, prepare=prepare, quantize=quantize, gemm=gemm, support=support,
                note="b12x CuTe DSL (SM120/SM121)")


def builtin_impls() -> dict[str, Callable[[], Impl]]:
    return {"reference": reference_impl, "triton": triton_impl, "cute": cute_impl}


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

    norm_rel  ||y - ref|| / ||ref||          (the tolerance metric of the Triton and CuTe issues)
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
        from rich.table import Table

        t = Table(title=title, show_lines=False)
        for c in columns:
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*r)
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
