"""How ``b12x-dual bench`` measures: the timer (CUDA-graph replay, do_bench, host timers on the
CPU), the ceilings measured in the same run, the inputs per shape, the baselines' calls, and the run
loop (``run_bench``) that turns the plan into rows. The method is in ``dispatch/apps/bench.py``'s
docstring and docs/bench.md.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import formats
from dispatch.api import library_versions
from dispatch.devices import CPU, DeviceInfo

from . import _harness as H
from .bench_plan import (BASELINE_NOTES, BASELINES, CPU_NOTE, GRAPH_MAX_M, Shape, ShapeCache, check_output,
                         check_rows, n_sets_for, plan, rand_x, select_shapes)
from .bench_peers import peer_info, time_peers, unquantized_error
from .bench_record import ratios, targets


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, *, gpu: bool, warmup_ms: float, rep_ms: float, graph_max_m: int, host_reps: int = 3):
        self.gpu, self.warmup_ms, self.rep_ms, self.graph_max_m, self.host_reps = gpu, warmup_ms, rep_ms, graph_max_m, host_reps

    def __call__(self, fns: list[Callable], M: int) -> dict[str, Any]:
        """Median time of one call (us), rotating over ``fns`` (one per input set)."""
        if not self.gpu:
            return self._host(fns)
        note = None
        if M <= self.graph_max_m:
            try:
                return self._graph(fns)
            except Exception as e:  # capture refused (a host sync in a wrapper, ...): time eagerly
                note = f"graph capture failed, timed eagerly: {type(e).__name__}: {str(e)[:160]}"
                torch.cuda.synchronize()
        r = self._eager(fns)
        if note:
            r["note"] = note
        return r

    def _host(self, fns):
        fns[0]()  # warm-up (compiles nothing under the interpreter, but imports and caches)
        ts = []
        for i in range(self.host_reps):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            ts.append((time.perf_counter() - t0) * 1e6)
        ts.sort()
        return {"us": statistics.median(ts), "us_p20": ts[0], "us_p80": ts[-1], "method": "host_timer",
                "reps": len(ts)}

    def _eager(self, fns):
        import triton.testing

        it = itertools.cycle(fns)
        q = triton.testing.do_bench(lambda: next(it)(), warmup=self.warmup_ms, rep=self.rep_ms,
                                    quantiles=[0.2, 0.5, 0.8])
        return {"us": q[1] * 1e3, "us_p20": q[0] * 1e3, "us_p80": q[2] * 1e3, "method": "do_bench (L2 flushed)"}

    def _graph(self, fns):
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:  # warm-up: compiles, autotunes, allocates outside the capture
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        try:
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
            n = int(min(1000, max(20, self.rep_ms / est_ms)))
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for i in range(n):
                starts[i].record()
                g.replay()
                ends[i].record()
            torch.cuda.synchronize()
            ts = sorted(a.elapsed_time(b) * 1e3 / len(fns) for a, b in zip(starts, ends))
        finally:
            g.reset()
        return {"us": statistics.median(ts), "us_p20": ts[int(0.2 * (n - 1))], "us_p80": ts[int(0.8 * (n - 1))],
                "method": f"cuda_graph ({len(fns)} calls per replay)", "reps": n}


def measure_ceilings(timer: Timer) -> dict[str, Any]:
    """Copy bandwidth, bf16 and FP8 matmul rates on this device, measured now on random data."""
    if not timer.gpu:
        return {"note": "not measured on CPU"}
    out: dict[str, Any] = {}
    n = 1 << 29  # 1 GiB of bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    r = timer._eager([lambda: b.copy_(a)])
    out["copy_GBps"] = 2 * a.numel() * a.element_size() / (r["us"] * 1e3)
    del a, b
    s = 8192
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    r = timer._eager([lambda: torch.matmul(x, w)])
    out["bf16_TFLOPs"] = 2 * s**3 / (r["us"] * 1e6)
    try:
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        for fast in (False, True):
            r = timer._eager([lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                       use_fast_accum=fast)])
            out[f"fp8_TFLOPs{'_fast_accum' if fast else ''}"] = 2 * s**3 / (r["us"] * 1e6)
    except Exception as e:
        out["fp8_TFLOPs"] = None
        out["fp8_note"] = f"torch._scaled_mm unavailable: {type(e).__name__}: {e}"
    del x, w
    torch.cuda.empty_cache()
    return out


def compute_ceiling(name: str, variant: Optional[str], ceilings: dict) -> tuple[Optional[float], str]:
    """(TFLOP/s, which) the roofline uses: fp8 rate for e4m3 formats and FP8 baselines; bf16 for
    bf16, W4A16 and the e2m1 formats on devices without FP4 tensor cores (sm_90; the FP4 MMA rate is not
    measurable through torch, so sm_100/sm_12x fall back to the fp8 rate and say so)."""
    bf16, fp8 = ceilings.get("bf16_TFLOPs"), ceilings.get("fp8_TFLOPs")
    if name == "torch_bf16" or (variant is not None and H.split(variant)[1]):
        return bf16, "bf16"
    if name.startswith("torch_fp8") or variant in ("fp8_tensor", "fp8_block", "mxfp8", "fp8_channel"):
        return (fp8, "fp8") if fp8 else (bf16, "bf16 (no fp8 measured)")
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    if cap[0] >= 10 and fp8:
        return fp8, "fp8 (FP4 rate not measured)"
    return bf16, "bf16 (no FP4 tensor cores)"



# ---------------------------------------------------------------------------------------------
# Rows: derived metrics, and the baselines' calls
# ---------------------------------------------------------------------------------------------
def _metrics(row: dict, ceilings: dict, gpu: bool) -> None:
    us = row["us"]
    row["tflops"] = row["flops"] / (us * 1e6)
    row["gbps"] = row["bytes"] / (us * 1e3)
    peak, which = compute_ceiling(row["name"], row.get("variant"), ceilings)
    bw = ceilings.get("copy_GBps")
    row["compute_ceiling"] = which
    if gpu and peak and bw:
        t_c = row["flops"] / (peak * 1e6)
        t_m = row["bytes"] / (bw * 1e3)
        row["roofline_us"] = max(t_c, t_m)
        row["bound"] = "memory" if t_m >= t_c else "compute"
        row["roofline_share"] = row["roofline_us"] / us
    else:
        row["roofline_us"] = row["roofline_share"] = row["bound"] = None


def _baseline_calls(name: str, cache: ShapeCache, M: int, xs: list[torch.Tensor], gpu: bool):
    """(fns, bytes, check-closure) for a baseline, or raise with the reason it cannot run."""
    N, K = cache.shape.N, cache.shape.K
    if name == "torch_bf16":
        w0 = cache.w.to(torch.bfloat16)
        n = len(xs)
        ws = [w0] + [w0.clone() for _ in range(n - 1)]
        fns = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws)]
        nbytes = N * K * 2 + M * K * 2 + M * N * 2
        ref_fn = lambda rows: xs[0][rows].to(torch.float64) @ cache.wd(None).T  # noqa: E731
        return fns, nbytes, ref_fn, {}
    fmt = {"torch_fp8_tensor": "fp8_tensor", "torch_fp8_block": "fp8_block", "torch_fp8_channel": "fp8_channel"}[name]
    qw = cache.qweight(fmt)
    xqs = [formats.quantize(x, fmt, role="activation") for x in xs]
    qws = [qw] + [H.clone_qt(qw) for _ in range(len(xs) - 1)]
    extra: dict[str, Any] = {}
    pad = 0
    if name == "torch_fp8_tensor":
        def call(xq, q):
            return torch._scaled_mm(xq.data, q.data.t(), xq.scale.float(), q.scale.float(),
                                    out_dtype=torch.bfloat16, use_fast_accum=False)
    elif name == "torch_fp8_channel":
        def call(xq, q):  # row-wise scaling: scale_a [M, 1], scale_b [1, N], both fp32
            return torch._scaled_mm(xq.data, q.data.t(), xq.scale[:, None], q.scale[None, :],
                                    out_dtype=torch.bfloat16, use_fast_accum=False)
    else:
        def call(xq, q):
            sa = xq.scale.t().contiguous().t()  # [M, K/128], outer-dim-major (stride (1, M))
            return torch._scaled_mm(xq.data, q.data.t(), sa, q.scale.t(), out_dtype=torch.bfloat16,
                                    use_fast_accum=False)
    try:
        call(xqs[0], qws[0])
    except Exception as e:
        if M % 16 == 0:
            raise
        # cuBLASLt wants M % 16 on some paths: pad the activation rows, as a caller would have to
        pad = (-M) % 16
        xqs = [formats.quantize(torch.cat([x, x.new_zeros(pad, K)]), fmt, role="activation") for x in xs]
        call(xqs[0], qws[0])
        extra["padded_m"] = M + pad
        extra["pad_reason"] = f"{type(e).__name__}: {str(e)[:120]}"
    fns = [(lambda xq=xq, q=q: call(xq, q)) for xq, q in zip(xqs, qws)]
    nbytes = H.qt_nbytes(qw) + H.qt_nbytes(xqs[0]) + (M + pad) * N * 2
    x_oracle = formats.quantize(xs[0], fmt, role="activation")

    def ref_fn(rows):
        return formats.dequantize(x_oracle, torch.float64)[rows] @ cache.wd(fmt).T

    extra["_first"] = lambda: call(xqs[0], qws[0])[:M]
    return fns, nbytes, ref_fn, extra



# ---------------------------------------------------------------------------------------------
# The run loop, in steps: open a session, then per (shape, M) build the inputs and time every
# baseline and every implementation x mode, then assemble the result
# ---------------------------------------------------------------------------------------------
@dataclass
class Session:
    """What every configuration of one bench run shares: the device, the timer, the ceilings
    measured at the start, and the rows so far."""

    gpu: bool
    device: str
    timer: Timer
    l2: int
    check: bool
    ceilings: dict = field(default_factory=dict)
    results: list = field(default_factory=list)
    device_info: DeviceInfo = CPU
    baseline_notes: dict = field(default_factory=lambda: dict(BASELINE_NOTES))
    unquantized_err: bool = False  # --peers: linear rows also get err_vs_unquantized (bench_peers)

    def record(self, row: dict) -> None:
        """A timed row: derived metrics (TFLOP/s, GB/s, roofline share), then kept."""
        _metrics(row, self.ceilings, self.gpu)
        self.results.append(row)


@dataclass
class Config:
    """One (shape, M): its activations (one per input set), the rows re-checked, and the fields
    every row of it carries."""

    shape: Shape
    M: int
    cache: ShapeCache
    xs: list
    rows: torch.Tensor
    common: dict

    @property
    def x_bytes(self) -> int:
        return self.M * self.shape.K * 2


def open_session(*, warmup_ms: float, rep_ms: float, graph_max_m: int, check: bool) -> tuple[Session, dict]:
    """The session and the device report; measures the ceilings (the CPU note is printed once, with
    the results)."""
    gpu = H.on_gpu()
    timer = Timer(gpu=gpu, warmup_ms=warmup_ms, rep_ms=rep_ms, graph_max_m=graph_max_m)
    dev_rep = H.device_report()
    device = "cuda" if gpu else "cpu"
    session = Session(gpu=gpu, device=device, timer=timer, l2=dev_rep.get("l2_bytes", 0) or (50 << 20),
                      check=check, device_info=H.running_device(device))
    session.ceilings = measure_ceilings(timer)
    return session, dev_rep


BENCH_IMPLS = ("triton", "hopper", "cute")
"""The implementations bench times by default (the oracle is never timed): on sm_90 both the
readable kernels (triton) and the production ones (hopper) get rows; cute runs on SM12x."""


def new_shape_cache(session: Session, shape: Shape, seed: int) -> ShapeCache:
    """A fresh cache for ``shape``, after collecting what the previous shape left (the caller drops
    its reference first, so that two shapes' weights are never held together)."""
    gc.collect()
    if session.gpu:
        torch.cuda.empty_cache()
    return ShapeCache(shape, session.device, seed)


def make_config(session: Session, cache: ShapeCache, M: int) -> Config:
    """Activations for (shape, M): enough input sets for the smallest weight (FP4, ~0.56 B per
    element) to rotate past the L2; each row takes as many as its own weight needs."""
    shape = cache.shape
    N, K = shape.N, shape.K
    n_sets = n_sets_for(N * K // 2 + M * K * 2, session.l2, gpu=session.gpu)
    xs = [rand_x(M, K, cache.gen, session.device) for _ in range(n_sets)]
    common = {"shape": shape.id, "model": shape.model, "layer": shape.layer, "M": M, "N": N, "K": K,
              "flops": 2 * M * N * K}
    return Config(shape, M, cache, xs, check_rows(M), common)


def time_baseline(session: Session, cfg: Config, name: str) -> None:
    """One baseline row: timed and (--check) re-checked, or the error it raised (noted as unsupported)."""
    row = {"kind": "baseline", "name": name, "variant": None, "mode": "gemm" if name != "torch_bf16" else "linear",
           **cfg.common}
    N, K = cfg.shape.N, cfg.shape.K
    try:
        w_bytes = N * K * (2 if name == "torch_bf16" else 1)
        ns = min(len(cfg.xs), n_sets_for(w_bytes + cfg.x_bytes, session.l2, gpu=session.gpu))
        fns, nbytes, ref_fn, extra = _baseline_calls(name, cfg.cache, cfg.M, cfg.xs[:ns], session.gpu)
        first = extra.pop("_first", None) or fns[0]
        row.update(extra)
        row["bytes"] = nbytes
        row["n_sets"] = len(fns)
        row.update(session.timer(fns, cfg.M))
        if session.check:
            row["check"] = check_output(first(), ref_fn(cfg.rows.to(session.device)), cfg.rows, 4e-3)
        session.record(row)
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row.update({"error": msg, "us": None})
        session.results.append(row)
        key = f"{name} unsupported"
        session.baseline_notes.setdefault(key, "")
        session.baseline_notes[key] = (session.baseline_notes[key] + f" {cfg.shape.id} M={cfg.M}: {msg};")[:2000]


def modes_of(variant: str) -> list[str]:
    """The whole linear, and the GEMM alone except for W4A16 (no activation quantization)."""
    return ["linear"] if H.split(variant)[1] else ["linear", "gemm"]


def _impl_calls(cfg: Config, backend, fmt: str, mode: str, l2: int, gpu: bool):
    """(fns, weight bytes, activation bytes) for one registry backend x mode: one call per input set,
    each on its own copy of the weight (``backend.prepare``d), through ``apply`` (linear) or
    ``quantize_activation`` beforehand and ``gemm`` timed (gemm)."""
    qw = cfg.cache.qweight(fmt)
    w_bytes = H.qt_nbytes(qw)
    ns = min(n_sets_for(w_bytes + cfg.x_bytes, l2, gpu=gpu), len(cfg.xs))
    qws = [qw] + [H.clone_qt(qw) for _ in range(ns - 1)]
    preps = [backend.prepare(q) for q in qws]
    if mode == "linear":
        fns = [(lambda x=x, p=p: backend.apply(x, p, None)) for x, p in zip(cfg.xs, preps)]
        return fns, w_bytes, cfg.x_bytes
    xqs = [backend.quantize_activation(x) for x in cfg.xs[:ns]]
    fns = [(lambda xq=xq, p=p: backend.gemm(xq, p, None, torch.bfloat16)) for xq, p in zip(xqs, preps)]
    return fns, w_bytes, H.qt_nbytes(xqs[0])


def time_impl(session: Session, cfg: Config, variant: str, iname: str, backend, mode: str,
              unsupported: Optional[str]) -> str:
    """One implementation row: skipped (``unsupported``: the registry's reason), timed and (--check)
    re-checked, or the error it raised. Returns the progress label."""
    fmt, a16 = H.split(variant)
    M, N, K = cfg.M, cfg.shape.N, cfg.shape.K
    label = f"{cfg.shape.id} M={M} {variant} {iname}"
    row = {"kind": "impl", "name": iname, "variant": variant, "fmt": fmt, "a16": a16, "mode": mode, **cfg.common}
    if mode == "gemm" and unsupported is None and not backend.splits:
        unsupported = f"{iname} has no separate activation quantization and GEMM to time alone"
    if unsupported is not None:
        row.update({"skipped": unsupported, "us": None})
        session.results.append(row)
        return label + " skipped"
    try:
        fns, w_bytes, act_bytes = _impl_calls(cfg, backend, fmt, mode, session.l2, session.gpu)
        row["bytes"] = w_bytes + act_bytes + M * N * 2
        row["n_sets"] = len(fns)
        route = H.route_record(backend, variant, M, N, K, session.device_info)
        row["route"] = route
        row["tile_config"] = None if route is None else route["text"]
        row.update(session.timer(fns, M))
        if session.check:
            rows_d = cfg.rows.to(session.device)
            x0 = cfg.xs[0]
            ref = (x0[rows_d].to(torch.float64) if a16 else
                   formats.dequantize(formats.quantize(x0, fmt, role="activation"),
                                      torch.float64)[rows_d]) @ cfg.cache.wd(fmt).T
            row["check"] = check_output(fns[0](), ref, cfg.rows, 4e-3)
        if session.unquantized_err and mode == "linear":
            row["err_vs_unquantized"] = unquantized_error(fns[0](), cfg.xs[0], cfg.cache.wd(None), cfg.rows)
        session.record(row)
    except Exception as e:
        row.update({"error": f"{type(e).__name__}: {str(e)[:300]}", "us": None,
                    "traceback": traceback.format_exc(limit=3)})
        session.results.append(row)
    return f"{label} {mode}"


def run_bench(*, variants: Optional[list[str]] = None, impls: Optional[list[str]] = None,
              shapes: Optional[list[Shape]] = None, ms: Optional[list[int]] = None, quick: bool = False,
              baselines: Optional[list[str]] = None, check: bool = False, budget_s: Optional[float] = None,
              warmup_ms: float = 10, rep_ms: float = 50, graph_max_m: int = GRAPH_MAX_M, seed: int = 0,
              progress: bool = True, extra_backends: Optional[dict[str, H.BackendFactory]] = None,
              peers: Optional[list[str]] = None) -> dict[str, Any]:
    """Time every (shape, M) x baseline and implementation x mode; the JSON-able result (fields in
    docs/bench.md). ``budget_s`` stops starting new configurations after that many seconds (the
    rest are listed in "skipped"). Implementations are registry backends (``impls``: names from
    :data:`BENCH_IMPLS`; ``extra_backends``: name -> factory(variant) -> registry.Backend); a
    configuration ``registry.verdict`` refuses on this device is a skip row with its reason.
    ``peers`` (names from bench_peers.PEERS) adds their rows (kind "peer") to every configuration."""
    gpu = H.on_gpu()
    variants = H.variants_from_formats(variants)
    shapes = shapes if shapes is not None else select_shapes(None, gpu=gpu, quick=quick)
    baselines = list(BASELINES) if baselines is None else baselines
    impl_objs = H.implementations(impls, BENCH_IMPLS, extra_backends)
    clock = H.Stopwatch()
    session, dev_rep = open_session(warmup_ms=warmup_ms, rep_ms=rep_ms, graph_max_m=graph_max_m, check=check)
    peers = list(peers or [])
    session.unquantized_err = bool(peers)
    peer_state: dict = {}
    configs = plan(shapes, ms, gpu=gpu, quick=quick)
    per_config = (len(baselines) + sum(len(modes_of(v)) for v in variants) * len(impl_objs)
                  + len(variants) * len(peers))
    skipped: list[dict] = []
    cache: Optional[ShapeCache] = None

    with H.Progress(len(configs) * per_config, "bench", enabled=progress) as bar:
        for ci, (shape, M) in enumerate(configs):
            if budget_s is not None and clock() > budget_s:
                if not skipped:
                    print(f"bench: time budget of {budget_s:g} s spent; skipping the remaining configurations",
                          file=sys.stderr)
                skipped.append({"shape": shape.id, "M": M, "reason": f"time budget ({budget_s:g} s) spent"})
                bar.advance(f"{shape.id} M={M} skipped (budget)", per_config)
                continue
            if cache is None or cache.shape.id != shape.id:
                cache = None  # the old shape's weights go before the new one's are made
                cache = new_shape_cache(session, shape, seed * 7919 + ci)
            cfg = make_config(session, cache, M)
            for b in baselines:
                time_baseline(session, cfg, b)
                bar.advance(f"{shape.id} M={M} {b}")
            for v in variants:
                for iname, factory in impl_objs.items():
                    backend = factory(v)
                    ok, why = H.check(backend, v, M, shape.N, shape.K, torch.bfloat16, session.device_info)
                    for mode in modes_of(v):
                        bar.advance(time_impl(session, cfg, v, iname, backend, mode, None if ok else why))
            for label in time_peers(session, cfg, variants, peers, peer_state,
                                    over_budget=lambda: budget_s is not None and clock() > budget_s):
                bar.advance(label)
            del cfg
    cache = None
    ratios(session.results)
    out = {
        "tool": "b12x-dual bench",
        "device": dev_rep,
        "versions": library_versions(),
        "cpu_interpreter": not gpu,
        "note": CPU_NOTE if not gpu else None,
        "ceilings": session.ceilings,
        "args": {"variants": variants, "impls": list(impl_objs), "baselines": baselines, "quick": quick,
                 "check": check, "budget_s": budget_s, "warmup_ms": warmup_ms, "rep_ms": rep_ms,
                 "graph_max_m": graph_max_m, "seed": seed, "peers": peers},
        "shapes": [{"id": s.id, "model": s.model, "layer": s.layer, "N": s.N, "K": s.K} for s in shapes],
        "baselines": session.baseline_notes,
        "peers": peer_info(peer_state),
        "results": session.results,
        "skipped": skipped,
        "seconds": round(clock(), 1),
    }
    out["targets"] = targets(out)
    return out
