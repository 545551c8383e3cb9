"""kernels_cute: the production path on SM120/SM121, wrapping b12x's CuTe DSL GEMMs (b12x==1.5.1).

One module per format (fp8_tensor, fp8_block, mxfp8, nvfp4, mxfp4), each a thin adapter to one
b12x entry point, with the same verbs:

    supported(M, N, K) -> (bool, reason)          shape support (b12x's alignment rules)
    prepare_weight(qweight, *, into=None)         repack once to b12x's contract (into=: reload)
    quantize_activation(x, **opts)                bit-exact with the oracle (see each module)
    linear(x, prepared, bias=None, **opts)        W4A4 / W8A8 at every M, bf16/fp16 out, bias after

This package adds the device gate (``supported(fmt, M, N, K, device)``, which the dispatcher's
``auto`` consults) and ahead-of-time preparation (``prepare``). docs/cute.md explains the mapping
onto b12x, the gaps routed around and how it was verified without SM12x hardware.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from . import _common
from ._common import B12X_VERSION, CuteWeight, PlanKey, SM12X_CAPABILITIES

FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4")
VARIANTS = FORMATS + ("mxfp4_w4a16",)
# b12x's own device gate for each format's entry point (tensor-FP8 and MXFP8 also need the SM120
# MXF8 warp MMA in nvidia-cutlass-dsl, so they have their own).
_GATES = {
    "fp8_tensor": "b12x.gemm.tensor_fp8_linear",
    "mxfp8": "b12x.gemm.mxfp8_linear",
    "fp8_block": "b12x.gemm.blockscaled",
    "nvfp4": "b12x.gemm.blockscaled",
    "mxfp4": "b12x.gemm.blockscaled",
}

__all__ = ["FORMATS", "VARIANTS", "CuteWeight", "Preparation", "module", "supported", "prepare_weight",
           "linear", "prepare", "B12X_VERSION"]


def module(fmt: str):
    """The kernels_cute.<fmt> module ("mxfp4_w4a16" -> mxfp4); ValueError for an unknown name."""
    base = "mxfp4" if fmt == "mxfp4_w4a16" else fmt
    if base not in FORMATS:
        raise ValueError(f"fmt must be one of {VARIANTS}, got {fmt!r}")
    return importlib.import_module(f"{__name__}.{base}")


@functools.lru_cache(maxsize=None)
def _b12x_gate(fmt: str) -> bool:
    return bool(importlib.import_module(_GATES[fmt]).is_supported())


def _is_running_device(device) -> bool:
    """Is ``device`` (a described device) the GPU this process runs on?"""
    if getattr(device, "kind", "cuda") != "cuda" or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability()) == tuple(device.capability)


def supported(fmt: str, M: int, N: int, K: int, device) -> tuple[bool, str]:
    """Can kernels_cute serve y[M, N] = x[M, K] . W[N, K]^T in format ``fmt`` on ``device``?

    Args:
        fmt: one of VARIANTS ("mxfp4_w4a16" is the W4A16 variant).
        device: any object with ``.capability`` (major, minor) and ``.sm_count`` (the
            dispatcher's DeviceInfo); b12x's own gate is consulted when it is the running GPU.
    Returns:
        (ok, reason): False with an actionable reason when b12x is not importable, the capability is
        not (12, 0) / (12, 1), b12x's is_supported() is false on the running GPU, or the shape
        misses b12x's alignment; True with a description otherwise.
    """
    mod = module(fmt)
    base = mod.FMT
    cap = tuple(getattr(device, "capability", (0, 0)))
    if getattr(device, "kind", "cuda") != "cuda" or cap not in SM12X_CAPABILITIES:
        return False, f"kernels_cute needs an SM120/SM121 GPU (capability (12, 0)/(12, 1)), got {cap}"
    err = _common.b12x_import_error()
    if err:
        return False, err
    if fmt == "mxfp4_w4a16":
        return mod.supported(M, N, K, a16=True)
    if _is_running_device(device) and not _b12x_gate(base):
        return False, (f"{_GATES[base]}.is_supported() is False on this sm_{cap[0]}{cap[1]} GPU "
                       "(b12x needs nvidia-cutlass-dsl>=4.6 and triton)")
    return mod.supported(M, N, K)


def prepare_weight(qweight, *, a16: bool = False, into: Optional[CuteWeight] = None) -> CuteWeight:
    """``kernels_cute.<qweight.fmt>.prepare_weight`` (see there)."""
    return module(qweight.fmt).prepare_weight(qweight, into=into, a16=a16)


def linear(x: torch.Tensor, prepared: CuteWeight, bias: Optional[torch.Tensor] = None, **opts) -> torch.Tensor:
    """``kernels_cute.<prepared.fmt>.linear`` (see there)."""
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
    """Deduplicated plan keys for (fmt, N, K) layers x token counts, plus the skipped (unsupported
    shape) reasons. Each count becomes the capacity the format plans for it (``cap_for``)."""
    dev = str(torch.device(device))
    if dev == "cuda" and torch.cuda.is_available():
        dev = f"cuda:{torch.cuda.current_device()}"
    name = _common.dtype_name(out_dtype)
    keys: dict[PlanKey, None] = {}
    skipped = []
    for fmt, n, k in layers:
        mod = module(fmt)
        for m in counts:
            ok, why = mod.supported(m, n, k)
            if not ok:
                skipped.append(why)
                continue
            keys[PlanKey(mod.FMT, mod.cap_for(m, k), n, k, name, dev)] = None
    return list(keys), skipped


def prepare(layers, *, cuda_graph_sizes: Iterable[int] = (), max_tokens: Optional[int] = None,
            token_counts_extra: Iterable[int] = (), out_dtype: torch.dtype = torch.bfloat16, device="cuda",
            autotune: bool = False, progress: bool = True) -> Preparation:
    """Compile (and optionally tune) ahead of serving every plan the given layers will use.

    Args:
        layers: (fmt, N, K) tuples, or CuteWeight objects (their fmt and shape are used).
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

    from b12x.preparation import PreparationSession, PreparedCall

    bs = _common.blockscaled()
    del bs
    layers = [(w.fmt, w.n, w.k) if isinstance(w, CuteWeight) else tuple(w) for w in layers]
    counts = token_counts(cuda_graph_sizes, max_tokens, token_counts_extra)
    keys, skipped = plan_keys(layers, counts, out_dtype=out_dtype, device=device)
    requests = []
    for key in keys:
        mod = module(key.fmt)
        plan = _common.get_plan(key, mod.make_query)
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
