"""The MoE layers of ``b12x-dual bench --shapes``: one routed-experts layer per model, timed through
the MoE table's backends against a bf16 baseline measured in the same run.

    id                   model          experts  top_k  hidden  intermediate  activation  format
    gpt-oss-20b:moe      gpt-oss-20b    32       4      2880    2880          swigluoai   mxfp4_w4a16 (weight-only: gpt-oss keeps activations bf16)
    qwen3-30b-a3b:moe    Qwen3-30B-A3B  128      8      2048    768           silu        nvfp4
    tiny-moe             -              4        2      128     128           silu        nvfp4  (CPU smoke)

(from the models' config.json: gpt-oss-20b num_local_experts 32, experts_per_token 4,
hidden_size 2880, intermediate_size 2880, its MXFP4 experts; Qwen3-30B-A3B num_experts 128,
num_experts_per_tok 8, hidden_size 2048, moe_intermediate_size 768, and the NVFP4 checkpoints of
it.) ``--shapes`` takes these ids, the model prefixes (gpt-oss-20b, qwen3-30b-a3b), "moe" (the two
models' layers) and "all" (every dense shape and both MoE layers). ``--formats`` replaces a layer's
own format by the listed variants (those whose block divides H and I).

What is timed, per (layer, M, implementation): the layer's call on the trusted path (the MoE
backend's ``run`` after one validation, as a bound vLLM layer calls it): routing, both grouped
GEMMs, the activation quantizers and the top_k sum, x bf16 -> y bf16. The routing is drawn once
per input set (top_k distinct experts per token, uniform), and the calls rotate over input sets so
that at decode the same experts are not re-read from the L2 every call. The baseline
``torch_bf16_moe`` is the same layer in bf16: tokens sorted by expert, ``torch._grouped_mm`` for
both GEMMs (where this torch has it and it runs here; else a loop over experts with one
``F.linear`` each, which synchronizes to read the counts), the activation in torch, the weighted
top_k sum in fp32. Timing is bench's Timer (CUDA-graph replay up to --graph-max-m, do_bench above;
host timers on a CPU, which are not performance numbers). ``--check`` compares each implementation
with formats.reference_moe (float64) on the first input set: norm_rel <= the MoE sweep's 1e-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import formats
from dispatch import moe as dm
from dispatch.describe import route_text

from . import _harness as H
from .bench_plan import GRAPH_MAX_M
from .sweep_moe import TOL_NORM_MOE


@dataclass(frozen=True)
class MoEShape:
    id: str
    model: str
    variant: str
    E: int
    top_k: int
    H: int
    I: int
    activation: str
    default: bool = True

    @property
    def layer(self) -> str:
        return f"routed experts: {self.E} x top-{self.top_k}, H={self.H}, I={self.I}, {self.activation}"


MOE_SHAPES: list[MoEShape] = [
    MoEShape("gpt-oss-20b:moe", "gpt-oss-20b", "mxfp4_w4a16", 32, 4, 2880, 2880, "swigluoai"),
    MoEShape("qwen3-30b-a3b:moe", "Qwen3-30B-A3B", "nvfp4", 128, 8, 2048, 768, "silu"),
    MoEShape("tiny-moe", "-", "nvfp4", 4, 2, 128, 128, "silu", default=False),
]
MOE_SHAPE_BY_ID = {s.id: s for s in MOE_SHAPES}
MOE_BENCH_IMPLS = ("triton", "hopper", "cute")
MOE_SETS_GPU = 4  # input sets (routings) the calls rotate over on a GPU


def split_shapes(spec: Optional[str]) -> tuple[Optional[str], list[MoEShape]]:
    """--shapes -> (the dense part, or None when nothing dense is asked; the MoE layers asked). "all"
    asks for both; "moe" for the two models' MoE layers; a model prefix or an id for one."""
    if spec is None:
        return None, []
    dense, moe = [], []
    for item in [t.strip() for t in spec.split(",") if t.strip()]:
        if item == "all":
            dense.append(item)
            moe += [s for s in MOE_SHAPES if s.default]
        elif item == "moe":
            moe += [s for s in MOE_SHAPES if s.default]
        elif item in MOE_SHAPE_BY_ID:
            moe.append(MOE_SHAPE_BY_ID[item])
        elif any(s.id.startswith(item + ":") for s in MOE_SHAPES):
            moe += [s for s in MOE_SHAPES if s.id.startswith(item + ":")]
        else:
            dense.append(item)
    return (",".join(dense) if dense else None), list({s.id: s for s in moe}.values())


# ---------------------------------------------------------------------------------------------
# The bf16 baseline
# ---------------------------------------------------------------------------------------------
def _grouped_mm_runs(device) -> Optional[str]:
    """None when torch._grouped_mm runs here on bf16 (a tiny probe), else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        a = torch.ones(32, 16, dtype=torch.bfloat16, device=device)  # 32 tokens, K = 16
        b = torch.ones(2, 8, 16, dtype=torch.bfloat16, device=device).transpose(1, 2)  # 2 experts [K, N = 8]
        torch._grouped_mm(a, b, offs=torch.tensor([16, 32], dtype=torch.int32, device=device))
    except Exception as e:  # noqa: BLE001  (any failure means: use the loop, and say why)
        return f"torch._grouped_mm does not run here: {type(e).__name__}: {str(e)[:160]}"
    return None


def bf16_moe(x, w13, w2, ids, wt, activation: str, grouped: bool) -> torch.Tensor:
    """The layer in bf16: x [M, H] bf16, w13 [E, 2I, H] and w2 [E, H, I] bf16, ids [M, k], wt [M, k] ->
    y [M, H] bf16 (fp32 top_k sum). ``grouped``: torch._grouped_mm, else a loop over experts."""
    M, k = ids.shape
    E = w13.shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    xs = x[tok]
    counts = torch.bincount(flat, minlength=E)
    if grouped:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        a = formats.moe_activation(h, activation)
        o = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    else:
        o = torch.empty(xs.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                h = torch.nn.functional.linear(xs[start:start + n], w13[e])
                o[start:start + n] = torch.nn.functional.linear(formats.moe_activation(h, activation), w2[e])
            start += n
    y = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    y.index_add_(0, tok, o.float() * wt.reshape(-1)[order].float().unsqueeze(1))
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def _variants_for(shape: MoEShape, variants: Optional[list[str]]) -> list[str]:
    if variants is None:
        return [shape.variant]
    mult = lambda v: formats.spec(dm.variant(v).fmt).k_multiple  # noqa: E731
    return [v for v in variants if shape.H % mult(v) == 0 and shape.I % mult(v) == 0]


def _layer(shape: MoEShape, gen: torch.Generator, device, fmts: set[str]):
    """{fmt: (w13, w2) oracle-quantized experts}, and the bf16 weights stacked [E, 2I, H], [E, H, I]."""
    q: dict[str, tuple[list, list]] = {f: ([], []) for f in fmts}
    b13 = torch.empty(shape.E, 2 * shape.I, shape.H, dtype=torch.bfloat16, device=device)
    b2 = torch.empty(shape.E, shape.H, shape.I, dtype=torch.bfloat16, device=device)
    for e in range(shape.E):
        w13 = torch.randn(2 * shape.I, shape.H, generator=gen, device=device) / math.sqrt(shape.H)
        w2 = torch.randn(shape.H, shape.I, generator=gen, device=device) / math.sqrt(shape.I)
        b13[e], b2[e] = w13, w2
        for f in fmts:
            q[f][0].append(formats.quantize(w13, f, role="weight"))
            q[f][1].append(formats.quantize(w2, f, role="weight"))
    return q, b13, b2


def run_moe_bench(shapes: list[MoEShape], *, ms: Optional[list[int]] = None, variants: Optional[list[str]] = None,
                  impls: Optional[list[str]] = None, check: bool = False, timer=None, seed: int = 0,
                  budget_s: Optional[float] = None, progress: bool = True) -> dict[str, Any]:
    """Time every (MoE layer, M) x implementation and the bf16 baseline; the JSON-able result:
    {"shapes", "results": rows (kind "moe_baseline" or "moe_impl": shape, variant, impl, M, us, method,
    vs_bf16, route, check, skipped / error), "notes", "skipped" (budget)}. ``timer``: bench_run.Timer
    (default: one for this device)."""
    from .bench_run import Timer

    gpu = H.on_gpu()
    device = H.default_device()
    dev_info = H.running_device(device)
    timer = timer or Timer(gpu=gpu, warmup_ms=10, rep_ms=50, graph_max_m=GRAPH_MAX_M)
    ms = ms or ([1, 16, 64, 512, 4096] if gpu else [1])
    impls = [i for i in MOE_BENCH_IMPLS if impls is None or i in impls]
    grouped_why = _grouped_mm_runs(device)
    notes = {"torch_bf16_moe": "bf16 layer: tokens sorted by expert, " + (
        "torch._grouped_mm for both GEMMs" if grouped_why is None else f"a loop over experts ({grouped_why})")}
    clock = H.Stopwatch()
    results, skipped = [], []
    total = sum(len(ms) * (1 + len(_variants_for(s, variants)) * len(impls)) for s in shapes)
    with H.Progress(total, "bench MoE", enabled=progress) as bar:
        for si, shape in enumerate(shapes):
            vs = _variants_for(shape, variants)
            gen = torch.Generator(device=device).manual_seed(seed * 7919 + 104729 + si)
            q, b13, b2 = _layer(shape, gen, device, {dm.variant(v).fmt for v in vs})
            for M in ms:
                if budget_s is not None and clock() > budget_s:
                    skipped.append({"shape": shape.id, "M": M, "reason": f"time budget ({budget_s:g} s) spent"})
                    bar.advance(f"{shape.id} M={M} skipped (budget)", 1 + len(vs) * len(impls))
                    continue
                n_sets = MOE_SETS_GPU if gpu else 1
                xs = [(H.make_input((M, shape.H), torch.bfloat16, gen, device),
                       torch.rand(M, shape.E, generator=gen, device=device).argsort(dim=1)[:, :shape.top_k]
                       .to(torch.int32), torch.rand(M, shape.top_k, generator=gen, device=device) + 0.05)
                      for _ in range(n_sets)]
                common = {"shape": shape.id, "model": shape.model, "layer": shape.layer, "M": M, "E": shape.E,
                          "top_k": shape.top_k, "H": shape.H, "I": shape.I, "activation": shape.activation,
                          "n_sets": n_sets}
                base = {"kind": "moe_baseline", "name": "torch_bf16_moe", "variant": None, **common}
                _time(base, timer, M, [(lambda s=s: bf16_moe(*s[:1], b13, b2, *s[1:], shape.activation,
                                                              grouped_why is None)) for s in xs])
                results.append(base)
                bar.advance(f"{shape.id} M={M} torch_bf16_moe")
                for v in vs:
                    w13, w2 = q[dm.variant(v).fmt]
                    for name in impls:
                        row = {"kind": "moe_impl", "name": name, "variant": v, **common}
                        results.append(row)
                        bar.advance(f"{shape.id} M={M} {v} {name}")
                        p = dm.MoEProblem(v, shape.E, shape.top_k, shape.H, shape.I, M, shape.activation)
                        ok, why = dm.verdict(dm.entries()[(name, v)], p, dev_info)
                        if not ok:
                            row.update({"skipped": why, "us": None})
                            continue
                        backend = dm.get(name, v)
                        try:
                            row["route"] = route_text(backend.route(p, dev_info))
                            prepared = backend.prepare(w13, w2, activation=shape.activation)
                            dm.validate_call(*xs[0], shape.E, shape.H, backend.act_dtypes)
                            fns = [(lambda s=s: backend.run(*s[:1], prepared, *s[1:], activation=shape.activation))
                                   for s in xs]
                            _time(row, timer, M, fns)
                            if base.get("us") and row.get("us"):
                                row["vs_bf16"] = base["us"] / row["us"]
                            if check:
                                ref = formats.reference_moe(xs[0][0], w13, w2, xs[0][1], xs[0][2],
                                                            activation=shape.activation, a16=p.a16,
                                                            out_dtype=torch.float64)
                                m = H.compare_outputs(fns[0](), ref)
                                row["check"] = {**m, "tol_norm_rel": TOL_NORM_MOE,
                                                "ok": bool(m["norm_rel"] <= TOL_NORM_MOE)}
                        except Exception as e:  # noqa: BLE001  (a row records what an implementation raised)
                            row.update({"error": f"{type(e).__name__}: {str(e)[:300]}", "us": None})
            del q, b13, b2
    return {"shapes": [{"id": s.id, "model": s.model, "layer": s.layer, "variant": s.variant} for s in shapes],
            "results": results, "notes": notes, "skipped": skipped, "seconds": round(clock(), 1)}


def _time(row: dict, timer, M: int, fns: list[Callable]) -> None:
    try:
        row.update(timer(fns, M))
    except Exception as e:  # noqa: BLE001
        row.update({"error": f"{type(e).__name__}: {str(e)[:300]}", "us": None})


def print_moe_results(result: dict[str, Any], *, plain: bool = False) -> None:
    """One table: per (layer, M) the baseline and every implementation row (us, x vs bf16, check)."""
    rows = []
    for r in result["results"]:
        name = r["name"] if r["kind"] == "moe_baseline" else f"{r['name']}:{r['variant']}"
        status = r.get("skipped") or r.get("error") or ""
        chk = r.get("check")
        rows.append([r["shape"], r["M"], name, H.fmt_num(r.get("us")), H.fmt_num(r.get("vs_bf16"), ".2f"),
                     "-" if chk is None else f"{H.fmt_num(chk['norm_rel'])} {'ok' if chk['ok'] else 'FAIL'}",
                     r.get("method", ""), status[:120]])
    H.print_table("MoE layers (us per call; x vs bf16 = bf16 time / this time)",
                  ["layer", "M", "implementation", "us", "x vs bf16", "check", "method", "skipped / error"], rows,
                  plain=plain)
    for k, v in result["notes"].items():
        print(f"{k}: {v}")
    if not H.on_gpu():
        print("MoE: CPU, Triton's interpreter and host timers: these timings are NOT performance numbers.")
