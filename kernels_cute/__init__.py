"""kernels_cute: the production path on SM120/SM121, wrapping b12x's CuTe DSL GEMMs (b12x==1.5.1).

One module per format of formats/ that b12x serves (fp8_tensor, fp8_block, mxfp8, nvfp4, mxfp4), each
a thin adapter to one b12x entry point, with the same verbs:

    supported(M, N, K) -> (bool, reason)          shape support (b12x's alignment rules)
    prepare_weight(qweight, *, into=None)         check (formats.validate) and repack once to b12x's
                                                  contract (into=: reload into the same storage)
    quantize_activation(x, **opts)                our CuTe DSL quantizer (kernels_cute/quant),
                                                  bit-exact with the oracle
    gemm(xq, prepared, bias=None, out_dtype=None) the b12x GEMM on an already quantized activation
                                                  (any quantizer's: linear scales are swizzled inside)
    linear(x, prepared, bias=None, **opts)        quantize_activation + gemm: W4A4 / W8A8 at every M,
                                                  bf16/fp16 out, bias after

plus the weight-only routes of nvfp4 and mxfp8 (``prepare_weight(q, a16=True)``, ``linear(x, w,
a16=True)``; the "nvfp4_w4a16" and "mxfp8_w8a16" variants). A format b12x has no kernel for has a
module declaring only ``UNSUPPORTED`` (the reason: fp8_channel). kernels_cute imports no kernels_triton module; "Triton quantizer + CuTe
GEMM" is composed by the caller (dispatch) as ``gemm(kernels_triton...quantize_activation(x), w)``.

The MoE layer (formats.reference_moe) is ``kernels_cute.moe``: b12x's fused MoE for nvfp4,
nvfp4_w4a16 and mxfp4_w4a16 (``supports``, ``prepare_experts``, ``fused_moe``, ``route``; FP8 MoE
and mxfp4 W4A4 are named gaps), imported on its own (not through this package's format registry).

This package adds the device gate (``supported(variant, M, N, K, device)``, which the dispatcher's
``auto`` consults; it answers (False, reason) for any variant it does not serve, never raises) and
ahead-of-time preparation (``prepare``). docs/cute.md explains the mapping onto b12x, the gaps
routed around and how it was verified without SM12x hardware.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

import formats

from . import _common
from ._common import B12X_VERSION, CuteWeight, PlanKey, SM12X_CAPABILITIES, a16_variant
from ._common import split_variant as _split

FORMATS = formats.FORMAT_NAMES


def _gates() -> tuple[dict[str, str], tuple[str, ...], dict[str, str]]:
    """What kernels_cute serves: {variant: the b12x module whose is_supported() gates it} (each
    format module's ``B12X_GATE``, and ``A16_GATE`` for its weight-only variant), the weight-only
    variants a module declares unsupported (``A16_UNSUPPORTED``: listed, so that supported() gives
    b12x's reason), and {format: reason} for a module that declares the whole format unsupported
    (``UNSUPPORTED``). A format of formats/ without a module here is answered "not served"."""
    gates, unsupported, gaps = {}, [], {}
    for fmt in FORMATS:
        if importlib.util.find_spec(f"{__name__}.{fmt}") is None:
            continue
        mod = importlib.import_module(f"{__name__}.{fmt}")
        if hasattr(mod, "UNSUPPORTED"):
            gaps[fmt] = mod.UNSUPPORTED
            continue
        gates[fmt] = mod.B12X_GATE
        if hasattr(mod, "A16_GATE"):
            gates[a16_variant(fmt)] = mod.A16_GATE
        elif hasattr(mod, "A16_UNSUPPORTED"):
            gates[a16_variant(fmt)] = mod.B12X_GATE
            unsupported.append(a16_variant(fmt))
    return gates, tuple(unsupported), gaps


_GATES, DECLARED_UNSUPPORTED, _GAPS = _gates()
# Every format and weight-only variant, whether served or not: W4A16 for the e2m1 formats, and the
# weight-only variants a module here declares (mxfp8_w8a16).
VARIANTS = FORMATS + tuple(dict.fromkeys(
    [a16_variant(f) for f in FORMATS if formats.spec(f).element == "e2m1"]
    + [v for v in _GATES if _split(v)[1]]))
SERVED = tuple(v for v in VARIANTS if v in _GATES and v not in DECLARED_UNSUPPORTED)

__all__ = ["FORMATS", "VARIANTS", "SERVED", "CuteWeight", "Preparation", "device_gate", "module", "not_served",
           "supported", "route", "prepare_weight", "gemm", "linear", "prepare", "B12X_VERSION"]


def not_served(variant: str) -> Optional[str]:
    """Why kernels_cute has no kernel for ``variant`` (a name of VARIANTS), or None when it has one."""
    if variant in _GAPS:
        return _GAPS[variant]
    if variant not in _GATES:
        return f"kernels_cute has no module for {variant!r} (it serves {SERVED})"
    if variant in DECLARED_UNSUPPORTED:
        return importlib.import_module(f"{__name__}.{_split(variant)[0]}").A16_UNSUPPORTED
    return None


def module(variant: str):
    """The kernels_cute.<fmt> module of a served variant ("nvfp4_w4a16" -> nvfp4, "mxfp8_w8a16" -> mxfp8).

    Raises ValueError naming the variants for a name outside VARIANTS, or one kernels_cute does
    not serve (``supported`` gives the same reason without raising)."""
    if variant not in VARIANTS:
        raise ValueError(f"fmt must be one of {VARIANTS}, got {variant!r}")
    if variant not in _GATES:
        why = f": {_GAPS[variant]}" if variant in _GAPS else ""
        raise ValueError(f"kernels_cute does not serve {variant!r} (it serves {SERVED}){why}")
    return importlib.import_module(f"{__name__}.{_split(variant)[0]}")


def query_maker(variant: str):
    """The function (cap, N, K, out_dtype) -> b12x query of a variant's plans."""
    mod = module(variant)
    return mod.make_query_a16 if _split(variant)[1] else mod.make_query


@functools.lru_cache(maxsize=None)
def _b12x_gate(variant: str) -> bool:
    try:
        return bool(importlib.import_module(_GATES[variant]).is_supported())
    except Exception:  # noqa: BLE001  (an entry point that does not import is not supported)
        return False


def device_gate(variant: str) -> tuple[bool, str]:
    """b12x's own ``is_supported()`` for the entry point of ``variant`` on the running GPU (asked
    once per process), as (ok, reason). Call it only where a CUDA device is present."""
    if variant not in _GATES:
        return False, f"kernels_cute does not serve {variant!r} (it serves {SERVED})"
    if not _b12x_gate(variant):
        return False, (f"{_GATES[variant]}.is_supported() is False on this GPU "
                       "(b12x needs nvidia-cutlass-dsl>=4.6 and triton)")
    return True, f"{_GATES[variant]}.is_supported() is True"


def _is_running_device(device) -> bool:
    """Is ``device`` (a described device) the GPU this process runs on?"""
    if getattr(device, "kind", "cuda") != "cuda" or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability()) == tuple(device.capability)


def supported(fmt: str, M: int, N: int, K: int, device, *, dtype: Optional[torch.dtype] = None) -> tuple[bool, str]:
    """Can kernels_cute serve y[M, N] = x[M, K] . W[N, K]^T in variant ``fmt`` on ``device``?

    Args:
        fmt: a format or weight-only variant name ("nvfp4_w4a16", "mxfp4_w4a16", "mxfp8_w8a16").
        device: any object with ``.capability`` (major, minor) and ``.sm_count`` (the
            dispatcher's DeviceInfo); b12x's own gate is consulted when it is the running GPU.
        dtype: the activation dtype, when known (nvfp4_w4a16 and mxfp8_w8a16 take bf16 only).
    Returns:
        (ok, reason), never raising: False with an actionable reason for a variant kernels_cute
        does not serve (an unknown name, a format formats/ defines but b12x has no entry point for,
        mxfp4_w4a16), when b12x is not importable, the capability is not (12, 0) / (12, 1), b12x's
        is_supported() is false on the running GPU, or the shape misses b12x's alignment; True with
        a description otherwise.
    """
    if fmt in _GAPS:
        return False, f"kernels_cute does not serve {fmt!r}: {_GAPS[fmt]}"
    if fmt not in _GATES:
        known = "a format formats/ defines but " if fmt in VARIANTS else "not a format name; "
        return False, f"kernels_cute does not serve {fmt!r} ({known}it serves {SERVED})"
    base, a16 = _split(fmt)
    cap = tuple(getattr(device, "capability", (0, 0)))
    if getattr(device, "kind", "cuda") != "cuda" or cap not in SM12X_CAPABILITIES:
        return False, f"kernels_cute needs an SM120/SM121 GPU (capability (12, 0)/(12, 1)), got {cap}"
    err = _common.b12x_import_error()
    if err:
        return False, err
    mod = module(fmt)
    if not_served(fmt):
        return mod.supported(M, N, K, a16=True)  # the module's own "no such kernel" reason
    if _is_running_device(device):
        ok, why = device_gate(fmt)
        if not ok:
            return False, why
    return mod.supported(M, N, K, a16=True, dtype=dtype) if a16 else mod.supported(M, N, K)


def route(variant: str, M: int, N: int, K: int, *, quantizer: str = "cute") -> tuple[tuple[str, ...], str, str]:
    """What ``linear`` launches for y[M, N] = x[M, K] . W[N, K]^T in ``variant``, without a GPU.

    Returns:
        (kernels, tile, why): the launches in order, named as this package calls them (our CuTe DSL
        activation quantizer ``kernels_cute.quant.<fmt>`` unless ``quantizer="triton"`` names
        kernels_triton's, then the ``b12x.gemm.blockscaled`` function the format module declares
        as ``B12X_GEMM`` / ``A16_GEMM``); tile: "" (b12x picks the MMA tile inside its plan); why:
        one sentence naming the plan's row capacity (the smallest prepared one >= M, else the next
        power of two, as ``_common.plan_for_call``). M == 0 launches nothing.
    Raises:
        ValueError: a variant kernels_cute does not serve (as :func:`module`).
    """
    mod = module(variant)
    base, a16 = _split(variant)
    if not_served(variant):
        raise ValueError(f"kernels_cute does not serve {variant!r}: {not_served(variant)}")
    if M <= 0:
        return (), "", "M = 0: an empty output, no kernel"
    cap = mod.cap_for(_common.next_pow2(M), K)
    plan = f"a b12x plan of >= {M} rows (a prepared capacity, else {cap})"
    if a16:
        gemm = f"b12x.gemm.blockscaled.{mod.A16_GEMM}"
        return (gemm,), "", f"b12x's weight-only GEMM {mod.A16_GEMM} on bf16 activations, {plan}"
    quant = f"kernels_cute.quant.{base}" if quantizer == "cute" else f"kernels_triton.{base}.quantize_activation"
    gemm = f"b12x.gemm.blockscaled.{mod.B12X_GEMM}"
    return (quant, gemm), "", f"the {quantizer} activation quantizer, then b12x's {mod.B12X_GEMM}, {plan}"


def prepare_weight(qweight, *, a16: bool = False, into: Optional[CuteWeight] = None) -> CuteWeight:
    """``kernels_cute.<qweight.fmt>.prepare_weight`` (see there; ValueError for a malformed weight)."""
    formats.validate.check_weight(qweight)
    return module(qweight.fmt).prepare_weight(qweight, into=into, a16=a16)


def gemm(xq, prepared: CuteWeight, bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None):
    """``kernels_cute.<prepared.fmt>.gemm``: the b12x GEMM on an already quantized activation."""
    return module(prepared.fmt).gemm(xq, prepared, bias, out_dtype)


def linear(x: torch.Tensor, prepared: CuteWeight, bias: Optional[torch.Tensor] = None, **opts) -> torch.Tensor:
    """``kernels_cute.<prepared.fmt>.linear`` (see there); a W4A16-prepared weight runs W4A16."""
    if prepared.a16:
        opts.setdefault("a16", True)
    return module(prepared.fmt).linear(x, prepared, bias, **opts)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time preparation
# ---------------------------------------------------------------------------------------------
@dataclass
class Preparation:
    """The result of :func:`prepare`: the plans it compiled, and b12x's session that owns them.

    Keep it alive while serving (closing the session releases the plans). ``freeze()`` makes any
    later unprepared shape an error instead of a compile; ``capture()`` is the context manager to
    wrap CUDA-graph capture in.
    """

    keys: list[PlanKey]
    session: object = None
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def freeze(self) -> None:
        self.session.freeze()

    def capture(self):
        return self.session.capture()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def token_counts(cuda_graph_sizes: Iterable[int] = (), max_tokens: Optional[int] = None,
                 extra: Iterable[int] = ()) -> list[int]:
    """The token counts a server uses: 1, the CUDA-graph batch sizes, the max batched tokens."""
    counts = {1, *cuda_graph_sizes, *extra}
    if max_tokens:
        counts.add(max_tokens)
    return sorted(c for c in counts if c > 0)


def plan_keys(layers: Sequence[tuple[str, int, int]], counts: Iterable[int], *,
              out_dtype: torch.dtype = torch.bfloat16, device="cuda") -> tuple[list[PlanKey], list[str]]:
    """Deduplicated plan keys for (variant, N, K) layers x token counts, plus the skipped (unsupported
    shape) reasons. Each count becomes the capacity the format plans for it (``cap_for``)."""
    dev = str(torch.device(device))
    if dev == "cuda" and torch.cuda.is_available():
        dev = f"cuda:{torch.cuda.current_device()}"
    name = _common.dtype_name(out_dtype)
    keys: dict[PlanKey, None] = {}
    skipped = []
    for variant, n, k in layers:
        mod = module(variant)
        a16 = _split(variant)[1]
        for m in counts:
            ok, why = mod.supported(m, n, k, a16=True, dtype=out_dtype) if a16 else mod.supported(m, n, k)
            if not ok:
                skipped.append(why)
                continue
            keys[PlanKey(variant, mod.cap_for(m, k), n, k, name, dev)] = None
    return list(keys), skipped


def prepare(layers, *, cuda_graph_sizes: Iterable[int] = (), max_tokens: Optional[int] = None,
            token_counts_extra: Iterable[int] = (), out_dtype: torch.dtype = torch.bfloat16, device="cuda",
            autotune: bool = False, progress: bool = True) -> Preparation:
    """Compile (and optionally tune) ahead of serving every plan the given layers will use.

    Args:
        layers: (variant, N, K) tuples, or CuteWeight objects (their variant and shape are used).
        cuda_graph_sizes / max_tokens / token_counts_extra: the token counts (1 is always included).
        out_dtype: activation / output dtype (bf16 or fp16).
        autotune: let b12x tune (the fixed serialized/prequantized plans used here have no tuning
            space, so this only matters if a future plan does).
        progress: show a tqdm progress bar.
    Returns:
        A :class:`Preparation`; identical (fmt, capacity, N, K, dtype) signatures are prepared once.
    Raises:
        RuntimeError: b12x missing, or no CUDA device (compile-only checks on a CPU host go
            through kernels_cute._compile instead).
    """
    import time

    _common.blockscaled()  # RuntimeError naming the install line when b12x is missing
    from b12x.preparation import PreparationSession, PreparedCall

    layers = [(w.variant, w.n, w.k) if isinstance(w, CuteWeight) else tuple(w) for w in layers]
    counts = token_counts(cuda_graph_sizes, max_tokens, token_counts_extra)
    keys, skipped = plan_keys(layers, counts, out_dtype=out_dtype, device=device)
    requests = []
    for key in keys:
        plan = _common.get_plan(key, query_maker(key.fmt))
        requests.append(plan.request(name=f"{key.fmt}:M<={key.cap}:N={key.n}:K={key.k}:{key.out_dtype}",
                                     prepare_call=lambda state: PreparedCall(run=lambda: None)))
    t0 = time.perf_counter()
    session = PreparationSession(device=torch.device(keys[0].device) if keys else None, autotune=autotune)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="kernels_cute.prepare", unit="plan")

    def on_progress(state):
        if bar is not None:
            bar.n = state.completed_requests
            bar.refresh()

    try:
        if requests:
            session.prepare(requests, progress=on_progress)
    finally:
        if bar is not None:
            bar.n = len(requests)
            bar.close()
    for key in keys:
        _common.mark_prepared(key)
    return Preparation(keys, session, time.perf_counter() - t0, skipped)
