"""Numerics checks of one linear call against the float64 oracle, and the serving watchdog.

Two users:

* ``b12x-dual diff`` (dispatch.apps.diff) calls :func:`compare_backend` for every implementation
  on identical quantized operands and reports where each departs;
* the watchdog (``B12X_CHECK``) calls :meth:`Watchdog.after_call` from ``QuantLinear.forward`` and
  the vLLM plugin's op on sampled calls; ``BoundMoE`` calls dispatch.moe_check.after_moe_call
  (the same sampling state, the MoE comparison).

What is compared, per call (M rows, N columns, K):

    activation  the implementation's quantize_activation(x) against formats.quantize(x, role=
                "activation"), byte for byte: codes (per row and scale block), block scales
                (unswizzled), global scale. W4A16 quantizes no activation.
    gemm        the implementation's GEMM on the oracle's quantized activation against
                formats.reference_linear on the same operands (diff), or the call's output against
                the oracle on the implementation's own quantized activation (watchdog);
    linear      apply(x) against reference_linear(x) (diff; the stage of implementations without a
                separate quantizer and GEMM, W4A16 included).

Errors are |y - ref| per element divided by the bound of :mod:`formats.bounds` (the one the kernel
tests assert), then maxed over (row, 128-column tile) blocks: a block is bad when that ratio is
above 1, or y is non-finite where the oracle is finite, or finite where it is not (NaN never
passes). The first bad block is the first in row-major order; the activation departs "first" when
its bytes differ, because the GEMM consumes it. A stage whose errors lean one way (their mean in
units of the bound, :func:`bias_stats`, over a threshold derived there) departs too, after any bad
block.

The watchdog: ``B12X_CHECK`` unset, empty or "0" is off: :data:`WATCHDOG` is None and the hooks
test only that (no call into this module, no host sync, nothing added to a CUDA graph). On, it is
a sampling rate: a probability ``0.01`` (seeded per process with ``B12X_CHECK_SEED``, default 0),
``every:100`` (the first call of each layer and every 100th after), or ``1`` (every call). A
sampled call quantizes x again with the implementation (where it has a separate quantizer),
recomputes the call with the oracle and compares. A layer's first divergence logs one WARNING
(:func:`warning_text`: a first line with the layer, implementation, M and first departure; then the
route, the bound, the replay file) and writes a replay file (dispatch.replay: the call's x with its
layout, the implementation's quantized activation, y, the weight as loaded) to ``B12X_CHECK_DIR``
(default: the current directory); that layer is not checked again. A check
that itself fails (an exception in the quantizer or the oracle, a replay file that cannot be
written) is logged once (ERROR) and never raised into the call. During
CUDA-graph capture nothing can be recomputed: captured calls are not checked (logged once, INFO);
eager and warmup calls are.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

import formats
from formats import QuantizedTensor
from formats.bounds import describe as describe_bound
from formats.bounds import gemm_bound

log = logging.getLogger(__name__)

ENV_CHECK = "B12X_CHECK"
ENV_DIR = "B12X_CHECK_DIR"
ENV_SEED = "B12X_CHECK_SEED"
TILE_N = 128
"""Columns per output tile of the error grid (the kernels' widest N tile)."""

E4M3_FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "fp8_channel")


# ---------------------------------------------------------------------------------------------
# The bound per implementation
# ---------------------------------------------------------------------------------------------
def bound_params(impl: str, variant: str, device_kind: str, K: int) -> dict[str, int]:
    """The accumulation parameters of formats.bounds.gemm_bound for an implementation on a device.

    cpu (any implementation; the Triton interpreter sums in fp32) and reference: fp32 summation.
    cuda, e4m3 formats (fp8_tensor, fp8_block, mxfp8, fp8_channel), triton and hopper: the products may be
    summed on Hopper's fp8 MMA, fp8_interval 128 (fp8_tensor / fp8_block / fp8_channel) or 32 (mxfp8's decode kernel) for
    triton (the kernel tests' values), 128 for hopper. cute fp8_block: b12x's split-K adds partials
    with bf16 atomics, at most K/128 of them. Everything else: fp32 summation.
    """
    from .registry import variant as _variant

    fmt, a16 = _variant(variant).fmt, _variant(variant).a16
    out = {"fp8_interval": 0, "bf16_adds": 0}
    if device_kind != "cuda" or impl == "reference" or a16:
        return out
    if fmt in E4M3_FORMATS and impl in ("triton", "hopper"):
        out["fp8_interval"] = 32 if (fmt == "mxfp8" and impl == "triton") else 128
    if fmt == "fp8_block" and impl == "cute":
        out["bf16_adds"] = max(1, K // 128)
    return out


def bound_text(impl: str, variant: str, device_kind: str, K: int, out_dtype: torch.dtype) -> str:
    """The bound's formula for this implementation, variant and device (formats.bounds.describe)."""
    return describe_bound(out_dtype, **bound_params(impl, variant, device_kind, K))


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(torch.uint8).reshape(t.shape[0] if t.dim() else 1, -1)


def linear_scales(q: QuantizedTensor) -> torch.Tensor:
    """q's scales in linear layout (swizzled_128x4 ones unswizzled), on the CPU."""
    if q.scale_layout == "swizzled_128x4" and q.block_shape is not None:
        return formats.unswizzle_128x4(q.scale.cpu(), q.rows, q.k // q.block_shape[1])
    return q.scale.cpu()


def _elems_per_byte(q: QuantizedTensor) -> int:
    return 2 if q.data.dtype == torch.uint8 else 1


def quant_diff(q: QuantizedTensor, ref: QuantizedTensor, *, limit: int = 16) -> dict[str, Any]:
    """Which bytes of a quantized tensor differ from the oracle's.

    Args:
        q, ref: QuantizedTensors of one format and shape (activations [M, K] or weights [N, K]).
        limit: how many differing blocks to list.
    Returns:
        {"equal": bool, "codes_rows": rows whose codes differ (first ``limit``), "codes_blocks":
        [[row, kblock], ...] (first ``limit``), "scale_blocks": [[scale row, kblock], ...] (first
        ``limit``), "global_scale": True when it differs, "n_code_bytes", "n_scale_bytes", "first":
        {"what": "codes"|"scale"|"tensor_scale"|"global_scale", "row", "kblock", "columns": [first,
        last]} or None} ("tensor_scale": fp8_tensor's one scale; "global_scale": nvfp4's; for both
        row and K-block are 0 and stand for the whole tensor). K-blocks are the format's scale
        blocks (16 columns for nvfp4, 32 for MX, 128 for fp8_block and for fp8_tensor's per-tensor
        scale); "columns" are the first block's columns of K.
    Raises:
        ValueError: q and ref are of different formats, shapes or tensor layouts.
    """
    if (q.fmt, q.shape) != (ref.fmt, ref.shape) or q.data.shape != ref.data.shape or q.data.dtype != ref.data.dtype:
        raise ValueError(f"q must match ref's format and shape: {q.fmt} {q.shape} {q.data.dtype} vs "
                         f"{ref.fmt} {ref.shape} {ref.data.dtype}")
    bk = q.block_shape[1] if q.block_shape is not None else TILE_N
    br = q.block_shape[0] if q.block_shape is not None else 1
    epb = _elems_per_byte(q)
    out: dict[str, Any] = {"equal": True, "codes_rows": [], "codes_blocks": [], "scale_blocks": [],
                           "global_scale": False, "n_code_bytes": 0, "n_scale_bytes": 0, "first": None}
    firsts = []
    d = (_bytes(q.data) != _bytes(ref.data))
    if bool(d.any()):
        per_byte = d.shape[1] // (q.data.shape[1] if q.data.dim() == 2 else 1)
        rows, cols = d.nonzero(as_tuple=True)
        kb = (cols // per_byte) * epb // bk
        blocks = sorted({(int(r), int(b)) for r, b in zip(rows.tolist(), kb.tolist())})
        out["n_code_bytes"] = int(d.sum())
        out["codes_rows"] = sorted({r for r, _ in blocks})[:limit]
        out["codes_blocks"] = [list(b) for b in blocks[:limit]]
        firsts.append((blocks[0][0], blocks[0][1], "codes"))
    qs, rs = linear_scales(q), linear_scales(ref)
    if qs.dim() == 0 or q.block_shape is None:
        if not torch.equal(_bytes(qs.reshape(1)), _bytes(rs.reshape(1))):
            out["global_scale"] = True
            firsts.append((0, 0, "tensor_scale"))
    else:
        s = (_bytes(qs) != _bytes(rs))
        if bool(s.any()):
            esz = qs.element_size()
            rows, cols = s.nonzero(as_tuple=True)
            blocks = sorted({(int(r), int(c) // esz) for r, c in zip(rows.tolist(), cols.tolist())})
            out["n_scale_bytes"] = int(s.sum())
            out["scale_blocks"] = [list(b) for b in blocks[:limit]]
            firsts.append((blocks[0][0] * br, blocks[0][1], "scale"))
    if (q.global_scale is None) != (ref.global_scale is None) or (
            q.global_scale is not None and not torch.equal(_bytes(q.global_scale.reshape(1)),
                                                           _bytes(ref.global_scale.reshape(1)))):
        out["global_scale"] = True
        firsts.append((0, 0, "global_scale"))
    if firsts:
        r, b, what = min(firsts)
        out["equal"] = False
        out["first"] = {"what": what, "row": r, "kblock": b, "columns": [b * bk, min(b * bk + bk, q.k) - 1]}
    return out


def error_grid(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, *, tile_n: int = TILE_N) -> torch.Tensor:
    """max |y - ref| / bound over each (row, ``tile_n``-column tile): float64 [M, ceil(N/tile_n)] on the CPU.

    A non-finite y where ref is finite counts as inf; where ref is non-finite too (a NaN input row),
    a non-finite y agrees (0) and a finite one is inf (NaN never silently becomes finite).
    """
    M, N = bound.shape
    y2 = y.detach().reshape(M, N).double().cpu()
    r2 = ref.detach().reshape(M, N).double().cpu()
    ratio = (y2 - r2).abs() / bound
    yf, rf = torch.isfinite(y2), torch.isfinite(r2)
    ratio = torch.where(yf & rf, ratio, torch.where(~yf & ~rf, torch.zeros_like(ratio),
                                                    torch.full_like(ratio, math.inf)))
    T = -(-N // tile_n)
    pad = torch.zeros(M, T * tile_n, dtype=torch.float64)
    pad[:, :N] = ratio
    return pad.reshape(M, T, tile_n).amax(-1)


def grid_summary(grid: torch.Tensor) -> dict[str, Any]:
    """{"worst": max ratio, "n_bad": blocks over 1, "first": {"row", "tile"} of the first bad block
    (row-major) or None}."""
    bad = grid > 1.0
    first = None
    if bool(bad.any()):
        r, t = bad.nonzero()[0].tolist()
        first = {"row": int(r), "tile": int(t)}
    worst = float(grid.max()) if grid.numel() else 0.0
    return {"worst": worst, "n_bad": int(bad.sum()), "first": first}


BIAS_ALPHA = 1e-6
"""The false-alarm probability of each bias statistic of one stage (see :func:`bias_stats`)."""


def bias_threshold(n: int, alpha: float = BIAS_ALPHA) -> float:
    """sqrt(2 ln(2 / alpha) / n): the Hoeffding threshold of :func:`bias_stats` (inf for n = 0)."""
    return math.sqrt(2.0 * math.log(2.0 / alpha) / n) if n > 0 else math.inf


def bias_stats(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, *, alpha: float = BIAS_ALPHA) -> dict[str, Any]:
    """Whether a stage's errors lean one way, in units of the bound.

    With e_i = (y_i - ref_i) / bound_i over the n elements where y and ref are both finite and
    |e_i| <= 1 (an element beyond the bound is a bad block, reported as such):

        signed     = (1/n) sum_i e_i              a directed rounding (toward +inf or -inf), an offset
        magnitude  = (1/n) sum_i sign(ref_i) e_i  toward zero (< 0: truncation, a scale or alpha
                                                  rounded down) or away from it (> 0)

    Each is flagged when its absolute value reaches t = sqrt(2 ln(2 / alpha) / n).

    Derivation of t. If the implementation rounds without bias (round-to-nearest-even, a correct
    summation), each e_i has mean 0 and |e_i| <= 1 (the bound holds for it; the elements beyond it
    are left out above); sign(ref_i) e_i is bounded by 1 the same way. Taking the e_i
    as independent (rounding errors of different outputs are uncorrelated for an unbiased
    rounding), Hoeffding's inequality for n variables in [-1, 1] gives
    P(|mean| >= t) <= 2 exp(-n t^2 / 2); setting the right side to alpha and solving for t gives
    the threshold above. So an unbiased implementation is flagged with probability at most alpha
    (:data:`BIAS_ALPHA` = 1e-6) per statistic and stage, whatever its error distribution within
    the bound; the test is conservative, as real errors are far smaller than the bound. A bf16
    epilogue that truncates instead of rounding errs by U(0, 1) ulp toward zero, 1/4 to 1/2 of the
    bound per element (the bound's 2^-7 |ref| output term is 1 to 2 ulp), so its magnitude mean
    is about -0.35, over t from n = 240 elements on (t = 0.35; n = 1024: t = 0.17).

    Args: y, ref [M, N] (any float dtype, any device), bound [M, N] float64 on the CPU.
    Returns: {"n", "signed", "magnitude", "threshold", "alpha", "flagged": bool, "which": "signed" |
    "magnitude" | None (the statistic flagged, the larger in units of t)}.
    """
    M, N = bound.shape
    y2 = y.detach().reshape(M, N).double().cpu()
    r2 = ref.detach().reshape(M, N).double().cpu()
    ok = torch.isfinite(y2) & torch.isfinite(r2)
    e = torch.where(ok, (y2 - r2) / bound, torch.zeros_like(bound))
    ok &= e.abs() <= 1
    e = torch.where(ok, e, torch.zeros_like(e))
    n = int(ok.sum())
    signed = float(e.sum()) / n if n else 0.0
    magnitude = float((torch.sign(r2).where(ok, torch.zeros_like(r2)) * e).sum()) / n if n else 0.0
    t = bias_threshold(n, alpha)
    which = None
    over = [(abs(v) / t, k) for k, v in (("signed", signed), ("magnitude", magnitude)) if abs(v) >= t]
    if over:
        which = max(over)[1]
    return {"n": n, "signed": signed, "magnitude": magnitude, "threshold": t, "alpha": alpha,
            "flagged": which is not None, "which": which}


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _stage(name: str, y, ref, bound) -> dict[str, Any]:
    grid = error_grid(y, ref, bound)
    return {"stage": name, "grid": grid, **grid_summary(grid), "bias": bias_stats(y, ref, bound)}


def first_departure(result: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The first departure of one implementation's result: the activation when its bytes differ
    (the GEMM consumes it), else the first bad (row, tile) of the gemm stage, else of linear, else
    a flagged bias of gemm, else of linear ({"stage", "bias": bias_stats})."""
    act = result.get("activation")
    if act is not None and not act["equal"]:
        f = act["first"]
        return {"stage": "activation", "row": f["row"], "kblock": f["kblock"], "what": f["what"],
                "columns": f.get("columns")}
    for name in ("gemm", "linear"):
        st = result.get(name)
        if st is not None and st["first"] is not None:
            return {"stage": name, "row": st["first"]["row"], "tile": st["first"]["tile"],
                    "ratio": float(st["grid"][st["first"]["row"], st["first"]["tile"]])}
    for name in ("gemm", "linear"):
        st = result.get(name)
        if st is not None and st.get("bias", {}).get("flagged"):
            return {"stage": name, "bias": dict(st["bias"])}
    return None


def compare_backend(backend, qweight: QuantizedTensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                    act_opts: Optional[dict] = None, device_kind: Optional[str] = None,
                    prepared=None) -> dict[str, Any]:
    """Run one registry backend on (x, qweight, bias) and compare each stage with the oracle.

    Args:
        backend: a dispatch.registry.Backend of the weight's variant.
        qweight: the layer's weight, QuantizedTensor [N, K] (the oracle uses it; the backend gets
            ``prepared`` or backend.prepare(qweight)).
        x: activations [..., K], bf16/fp16 (the output dtype is x's).
        bias: None or [N].
        act_opts: the activation options of the call (e.g. fp8_tensor ``scale``, nvfp4 ``global_scale``).
        device_kind: "cpu" or "cuda" for the bound (default: x's device type).
    Returns:
        {"impl", "variant", "M", "N", "K", "out_dtype", "bound": text, "activation": quant_diff or
        None, "weight": quant_diff of the prepared weight against qweight (when prepare returns a
        QuantizedTensor of the same layout) or None, "gemm" / "linear": {"stage", "grid" [M, T],
        "worst", "n_bad", "first"} or None, "first": first_departure, "ok": bool, "error": str
        (when the backend raised)}.
    """
    act_opts = dict(act_opts or {})
    x2 = _as_2d(x)
    M, K = x2.shape
    N = qweight.rows
    out_dtype = x.dtype
    kind = device_kind or x.device.type
    params = bound_params(backend.impl, backend.variant, kind, K)
    res: dict[str, Any] = {"impl": backend.impl, "variant": backend.variant, "M": M, "N": N, "K": K,
                           "out_dtype": str(out_dtype).replace("torch.", ""),
                           "bound": describe_bound(out_dtype, **params), "bound_params": params,
                           "activation": None, "weight": None, "gemm": None, "linear": None, "error": None}
    try:
        if prepared is None:
            prepared = backend.prepare(qweight)
        if isinstance(prepared, QuantizedTensor) and prepared is not qweight and prepared.scale_layout == qweight.scale_layout:
            try:  # informative only: a backend may legitimately repack (then the layouts differ)
                res["weight"] = quant_diff(prepared, qweight)
            except ValueError:
                res["weight"] = None
        xq_o = None if backend.a16 else formats.quantize(x2, backend.fmt, role="activation", **act_opts)
        if backend.splits:
            res["activation"] = quant_diff(backend.quantize_activation(x2, **act_opts), xq_o)
            y_g = backend.gemm(xq_o.to(x.device), prepared, bias, out_dtype=out_dtype)
            ref_g = formats.reference_linear(xq_o, qweight, bias, out_dtype=out_dtype)
            res["gemm"] = _stage("gemm", y_g, ref_g, gemm_bound(xq_o, qweight, bias, out_dtype, ref_g, **params))
        y = backend.apply(x2, prepared, bias, **act_opts)
        ref = formats.reference_linear(x2, qweight, bias, a16=backend.a16, out_dtype=out_dtype, **act_opts)
        xb = x2 if backend.a16 else xq_o
        res["linear"] = _stage("linear", y, ref, gemm_bound(xb, qweight, bias, out_dtype, ref, **params))
    except Exception as e:  # noqa: BLE001  (a backend that raises on a call it claimed fails it, with the reason)
        res["error"] = f"{type(e).__name__}: {e}"
    res["first"] = first_departure(res)
    res["ok"] = res["error"] is None and res["first"] is None
    return res


def check_call(backend, qweight: QuantizedTensor, x: torch.Tensor, y: torch.Tensor, bias: Optional[torch.Tensor],
               act_opts: dict, *, device_kind: Optional[str] = None, requantize: bool = True,
               xq: Optional[QuantizedTensor] = None) -> dict[str, Any]:
    """The watchdog's check of a call that produced ``y``: the implementation's quantized
    activation against the oracle's bytes, and y against the oracle on that same quantized
    activation, per (row, tile), in multiples of the bound.

    Args:
        backend, qweight, x [..., K], y [..., N], bias, act_opts: the call as it was made.
        device_kind: the device that produced y, for the bound (default x's).
        requantize: True (the watchdog): rerun the implementation's quantize_activation(x), where
            it has one. False (a replay): do not; use ``xq`` when given, else the oracle's.
        xq: the implementation's quantized activation as recorded (a replay file of version 2), so
            that the stage is rechecked, not guessed.
    Returns: the fields of :func:`compare_backend` ("gemm" holds the output check, or "linear" for
    W4A16 and backends without a separate quantizer), plus "xq": the quantized activation the
    output was checked on when it is the implementation's (for the replay file), else None.
    """
    kind = device_kind or x.device.type
    splits = bool(backend.splits and requantize)
    x2 = _as_2d(x)
    M, K = x2.shape
    out_dtype = y.dtype
    params = bound_params(backend.impl, backend.variant, kind, K)
    res: dict[str, Any] = {"impl": backend.impl, "variant": backend.variant, "M": M, "N": qweight.rows, "K": K,
                           "out_dtype": str(out_dtype).replace("torch.", ""),
                           "bound": describe_bound(out_dtype, **params), "bound_params": params,
                           "activation": None, "weight": None, "gemm": None, "linear": None, "error": None,
                           "xq": None}
    # the oracle runs on the CPU, on copies: the serving stream's tensors are only read
    y2 = y.reshape(M, -1).cpu()
    qweight = qweight.to("cpu")
    bias = None if bias is None else bias.cpu()
    act_opts = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in act_opts.items()}
    if backend.a16:
        x2 = x2.cpu()
        ref = formats.reference_linear(x2, qweight, bias, a16=True, out_dtype=out_dtype)
        res["linear"] = _stage("linear", y2, ref, gemm_bound(x2, qweight, bias, out_dtype, ref, **params))
    else:
        dev_opts = {k: (v.to(x.device) if isinstance(v, torch.Tensor) else v) for k, v in act_opts.items()}
        xq_o = formats.quantize(x2.cpu(), backend.fmt, role="activation", **act_opts)
        xq_used = xq_o
        if splits:
            xq_used = backend.quantize_activation(x2, **dev_opts).to("cpu")
        elif xq is not None:
            xq_used = xq.to("cpu")
        if xq_used is not xq_o:
            res["activation"] = quant_diff(xq_used, xq_o)
            res["xq"] = xq_used
        ref = formats.reference_linear(xq_used, qweight, bias, out_dtype=out_dtype)
        name = "gemm" if backend.splits else "linear"  # a replayed output keeps the stage it was checked at
        res[name] = _stage(name, y2, ref, gemm_bound(xq_used, qweight, bias, out_dtype, ref, **params))
    res["first"] = first_departure(res)
    res["ok"] = res["first"] is None
    return res


def describe_bias(stage: str, b: dict[str, Any]) -> str:
    """One line for a flagged bias of a stage."""
    v = b[b["which"]]
    direction = ({"signed": "upward" if v > 0 else "downward",
                  "magnitude": "away from zero" if v > 0 else "toward zero"})[b["which"]]
    return (f"{stage} is biased {direction}: mean error {v:+.3g}x the bound over {b['n']} elements "
            f"(threshold {b['threshold']:.3g}: Hoeffding at alpha {b['alpha']:g})")


def describe_first(first: Optional[dict[str, Any]]) -> str:
    """One line for a first departure (or "none")."""
    if first is None:
        return "none"
    if "bias" in first:
        return describe_bias(first["stage"], first["bias"])
    if first["stage"] == "activation" and first["what"] in ("global_scale", "tensor_scale"):
        what = "global scale" if first["what"] == "global_scale" else "per-tensor scale"
        return f"activation quantization departs first: its {what} (one for the whole tensor)"
    if first["stage"] == "activation":
        cols = first.get("columns")
        cols = f" (columns {cols[0]}-{cols[1]})" if cols else ""
        return (f"activation quantization departs first: {first['what']} of row {first['row']}, "
                f"K-block {first['kblock']}{cols}")
    c0 = first["tile"] * TILE_N
    return (f"{first['stage']} departs first: row {first['row']}, column tile {first['tile']} "
            f"(columns {c0}-{c0 + TILE_N - 1}), {first['ratio']:.3g}x the bound")


def route_of(backend, M: int, N: int, K: int, dtype: torch.dtype, device, act_opts: Optional[dict] = None) -> str:
    """The route a backend takes for this call, as one line: ``backend.route(problem, device,
    **act_opts).describe()`` (the kernels launched, their tile and split-K, why). A route that cannot
    be computed is reported as such, never raised (it must not hide the divergence report)."""
    from .contract import Problem

    problem = Problem(backend.variant, M, N, K, dtype)
    try:
        return backend.route(problem, device, **(act_opts or {})).describe()
    except Exception as e:  # noqa: BLE001  (a route that cannot be described must not hide the report)
        return f"(route unavailable: {type(e).__name__}: {e})"


# ---------------------------------------------------------------------------------------------
# The watchdog
# ---------------------------------------------------------------------------------------------
@dataclass
class Sampling:
    """A parsed B12X_CHECK: ``rate`` (probability per call) or ``every`` (every n-th call per layer)."""

    rate: Optional[float] = None
    every: Optional[int] = None

    def describe(self) -> str:
        return f"every {self.every} calls per layer" if self.every else f"probability {self.rate:g} per call"


def parse_sampling(value: Optional[str]) -> Optional[Sampling]:
    """B12X_CHECK's value -> None (off: unset, "", "0", "off") or a Sampling.

    Accepted: a probability in (0, 1] ("0.01", "1"), or "every:N" with N >= 1.
    Raises ValueError naming B12X_CHECK, the value and what is allowed.
    """
    v = (value or "").strip().lower()
    if v in ("", "0", "off", "false", "no"):
        return None
    allowed = "a probability in (0, 1] (e.g. 0.01), every:N with N >= 1 (e.g. every:100), or 0/unset for off"
    if v.startswith("every:"):
        try:
            n = int(v[len("every:"):])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_CHECK}={value!r}: allowed: {allowed}")
        return Sampling(every=n)
    try:
        p = float(v)
    except ValueError:
        p = math.nan
    if not (0.0 < p <= 1.0):
        raise ValueError(f"{ENV_CHECK}={value!r}: allowed: {allowed}")
    return Sampling(rate=p)


@dataclass
class Watchdog:
    """The sampling state of B12X_CHECK: per-layer call counters, the layers that diverged, where
    replay files go. ``diverged`` keeps every divergence found (layer -> report, or {"error"} for a
    layer that could not be checked); ``clean`` counts, per layer, the sampled calls found within the
    bound; ``checked`` is the number of checks that ran (clean or not)."""

    sampling: Sampling
    directory: str = "."
    seed: int = 0
    counts: dict = field(default_factory=dict)
    diverged: dict = field(default_factory=dict)
    clean: dict = field(default_factory=dict)
    checked: int = 0
    _rng: random.Random = field(default_factory=random.Random)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _logged_capture: bool = False

    def __post_init__(self):
        self._rng.seed(self.seed)

    def sample(self, key: str) -> bool:
        """Whether this call of layer ``key`` is checked."""
        with self._lock:
            if key in self.diverged:
                return False
            if self.sampling.every:
                n = self.counts.get(key, 0)
                self.counts[key] = n + 1
                return n % self.sampling.every == 0
            return self._rng.random() < self.sampling.rate

    def passed(self, layer: str) -> None:
        """Record a sampled call of ``layer`` found within the bound."""
        with self._lock:
            self.checked += 1
            self.clean[layer] = self.clean.get(layer, 0) + 1

    def departed(self, layer: str) -> None:
        """Record a sampled call of ``layer`` found outside its bound (its finding is kept in
        ``diverged`` by the caller)."""
        with self._lock:
            self.checked += 1

    def summary(self) -> str:
        """One line: how many checks ran, the layers found clean (sampled calls each) and those that
        diverged or could not be checked."""
        with self._lock:
            clean = {k: v for k, v in self.clean.items() if k not in self.diverged}
            bad = sorted(self.diverged)
        text = f"b12x-dual watchdog: {self.checked} checks; {len(clean)} layer(s) clean"
        return text + (f"; diverged or not checkable: {', '.join(bad)}" if bad else "; none diverged")

    def give_up(self, layer: str, backend, e: Exception, what: str = "layer") -> None:
        """``layer`` could not be checked (``e`` raised in the check): record it as diverged with the
        error, so it is never sampled again, and log it once. The check must not take the server down."""
        with self._lock:
            self.diverged[layer] = {"error": f"{type(e).__name__}: {e}", "ok": False}
        log.error("b12x-dual watchdog: cannot check %s %s on %s (%s): %s: %s; not checking it again",
                  what, layer, backend.impl, backend.variant, type(e).__name__, e)

    def _capturing(self, x: torch.Tensor) -> bool:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if not self._logged_capture:
                self._logged_capture = True
                log.info("b12x-dual watchdog (%s): calls inside CUDA-graph capture are not checked (the "
                         "oracle cannot run there); eager and warmup calls are", ENV_CHECK)
            return True
        return False

    def after_call(self, layer: str, backend, x: torch.Tensor, y: torch.Tensor, qweight: QuantizedTensor,
                   bias: Optional[torch.Tensor], act_opts: dict) -> Optional[dict]:
        """Check a call that returned ``y`` if it is sampled. Returns the report of a divergence
        (also logged once per layer and written as a replay file), else None."""
        if self._capturing(x) or not self.sample(layer):
            return None
        try:
            with torch.no_grad():
                res = check_call(backend, qweight, x, y, bias, act_opts)
        except Exception as e:  # noqa: BLE001  (the check must not take the server down; it says why, once)
            self.give_up(layer, backend, e)
            return None
        if res["ok"]:
            self.passed(layer)
            return None
        self.departed(layer)
        from .devices import device_of
        from . import replay

        M = _as_2d(x).shape[0]
        res["route"] = route_of(backend, M, qweight.rows, qweight.k, x.dtype, device_of(x), act_opts)
        res["layer"] = layer
        xq = res.pop("xq", None)
        path = None
        try:  # x as the layer received it: the file records its strides and storage
            path = replay.write(self.directory, layer=layer, impl=backend.impl, variant=backend.variant, x=x,
                                qweight=qweight, bias=bias, act_opts=act_opts, y=y.reshape(M, -1),
                                route=res["route"], report=summarize(res), xq=xq)
        except Exception as e:  # noqa: BLE001  (a full disk must not take the server down; say so)
            log.error("b12x-dual watchdog: could not write the replay file for %s to %s: %s", layer,
                      self.directory, e)
        res["replay"] = None if path is None else str(path)
        with self._lock:
            self.diverged[layer] = res
        log.warning("%s", warning_text(res, backend))
        return res


def warning_text(res: dict[str, Any], backend) -> str:
    """The watchdog's WARNING: a short first line with the finding (layer, implementation, variant,
    M, the first departure), then one detail per line (route, bound, replay file, what to run)."""
    return _warning_lines(res, backend, describe_first(res["first"]))


def _warning_lines(res: dict[str, Any], backend, finding: str) -> str:
    head = f"b12x-dual watchdog: layer {res['layer']} on {backend.impl} ({backend.variant}, M={res['M']}): {finding}"
    lines = [head, f"  route: {res.get('route') or '-'}", f"  bound: {res['bound']}",
             f"  replay file: {res.get('replay') or '(not written)'}"]
    if res.get("replay"):
        lines.append(f"  rerun it anywhere: b12x-dual diff --replay {res['replay']}")
    return "\n".join(lines)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """A result of compare_backend / check_call without its tensors (JSON-able)."""
    out = {k: v for k, v in res.items() if k not in ("gemm", "linear", "xq")}
    for name in ("gemm", "linear"):
        st = res.get(name)
        out[name] = None if st is None else {k: v for k, v in st.items() if k != "grid"}
    return out


def from_env() -> Optional[Watchdog]:
    """The watchdog B12X_CHECK asks for (None when off). Raises ValueError for a bad value."""
    sampling = parse_sampling(os.environ.get(ENV_CHECK))
    if sampling is None:
        return None
    try:
        seed = int(os.environ.get(ENV_SEED, "0"))
    except ValueError:
        raise ValueError(f"{ENV_SEED}={os.environ.get(ENV_SEED)!r}: must be an integer") from None
    wd = Watchdog(sampling, os.environ.get(ENV_DIR) or ".", seed)
    log.info("b12x-dual watchdog on (%s=%s): %s; replay files to %s", ENV_CHECK, os.environ.get(ENV_CHECK),
             sampling.describe(), wd.directory)
    return wd


class _Invalid:
    """Stands in for the watchdog when B12X_CHECK is malformed: the first checked call raises."""

    def __init__(self, err: ValueError):
        self.err = err

    def after_call(self, *args, **kwargs):
        raise self.err


WATCHDOG: Optional[Watchdog] = None
"""The process's watchdog; None when B12X_CHECK is off (the hooks test only this)."""


def reload() -> Optional[Watchdog]:
    """Read B12X_CHECK / B12X_CHECK_DIR / B12X_CHECK_SEED again (they are read once, at import)."""
    global WATCHDOG
    try:
        WATCHDOG = from_env()
    except ValueError as e:
        WATCHDOG = _Invalid(e)  # type: ignore[assignment]
    return WATCHDOG


reload()


def layer_name(module) -> str:
    """The name the watchdog reports a QuantLinear under: ``b12x_name`` (set by quantize_model and
    load_quantized), else its shape and id."""
    return getattr(module, "b12x_name", None) or (
        f"QuantLinear({module.out_features}x{module.in_features})@{id(module):x}")
