"""The MoE part of ``b12x-dual sweep``: every MoE implementation that runs here against the float64
oracle ``formats.reference_moe``.

Rows are the variants of dispatch.registry.VARIANTS; implementations are the MoE table's cells
(dispatch.moe.entries(): triton, hopper, cute; the reference cell is the oracle itself and is not
diffed against itself). A cell that ``dispatch.moe.verdict`` says cannot run here is skipped with
the registry's reason (hopper: no sm_90 MoE kernels yet; cute off SM12x or before kernels_cute.moe
lands; a variant the lesson does not serve). Every cell draws fresh inputs (x with outliers and
zero blocks, E experts quantized by the oracle, top_k distinct experts per token, positive router
weights) and each implementation runs the same ones through its ``apply`` (validated path).

Per cell and implementation: norm_rel, max_rel, mean_rel, cosine of y against the oracle's float64
output (dispatch.apps._harness.compare_outputs). Tolerance: norm_rel <= 1e-2. Where it comes from:
the dense sweep's 4e-3 (bf16 output rounding, 2^-9 relative, plus fp32 sums) covers each GEMM; an
MoE call adds the requantized intermediate, where a value within the kernel's fp32 error of a code
boundary takes the neighbouring code (one FP4 step is up to 1/3 of the value), and, weight-only, the
bf16 intermediate (2^-9 relative per element). Measured on the CPU (small grid, every variant):
1.7e-3 to 3.0e-3 with bf16 output (weight-only the largest: two bf16 roundings), 1.8e-4 to 2.0e-3
with fp16; 1e-2 leaves a 3x margin and still fails a wrong activation, gate/up order, expert or
router weight (errors of order 1).
NaN or Inf never passes.

Grids: small (the CPU interpreter): M in {1, 5}, E=4 experts, top_k=2, H=I=128 (fp8_block's
128-wide group fits), the activation cycled over the variants; large (a GPU): M in {1, 16, 128,
4096} on (E=32, top_k=4, H=2048, I=2048, swigluoai) and (E=128, top_k=8, H=2048, I=768, silu).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

import formats
from dispatch import moe as dm
from dispatch.describe import route_text
from dispatch.registry import VARIANTS

from . import _harness as H

MOE_GRIDS: dict[str, dict[str, list]] = {
    "small": {"m": [1, 5], "shapes": [(4, 2, 128, 128, None)]},
    "large": {"m": [1, 16, 128, 4096], "shapes": [(32, 4, 2048, 2048, "swigluoai"), (128, 8, 2048, 768, "silu")]},
}
"""(E, top_k, H, I, activation or None: cycled over formats.MOE_ACTIVATIONS by variant) per grid."""
MOE_IMPLS = ("triton", "hopper", "cute")
TOL_NORM_MOE = 1e-2


def moe_inputs(variant: str, M: int, E: int, top_k: int, Hd: int, I: int, dtype: torch.dtype,
               gen: torch.Generator, device) -> tuple:
    """(x [M, H] of dtype, w13, w2 (E oracle-quantized experts each), topk_ids int32 [M, top_k] distinct
    per token, topk_weights float32 [M, top_k] in [0.05, 1.05)), drawn with ``gen`` on ``device``."""
    fmt = dm.variant(variant).fmt
    x = H.make_input((M, Hd), dtype, gen, device)
    w13 = [formats.quantize(torch.randn(2 * I, Hd, generator=gen, device=device) / math.sqrt(Hd), fmt)
           for _ in range(E)]
    w2 = [formats.quantize(torch.randn(Hd, I, generator=gen, device=device) / math.sqrt(I), fmt) for _ in range(E)]
    ids = torch.rand(M, E, generator=gen, device=device).argsort(dim=1)[:, :top_k].to(torch.int32)
    wt = torch.rand(M, top_k, generator=gen, device=device) + 0.05
    return x, w13, w2, ids, wt


def run_moe_cell(variant: str, M: int, E: int, top_k: int, Hd: int, I: int, activation: str, dtype: torch.dtype,
                 impls: tuple[str, ...], *, seed: int, device: str) -> dict[str, Any]:
    """One MoE cell: fresh inputs, the oracle in float64, every implementation of ``impls`` that the
    MoE table says can run it on ``device``, each diffed against the oracle."""
    dev_info = H.running_device(device)
    a16 = dm.variant(variant).a16
    cell: dict[str, Any] = {"variant": variant, "M": M, "E": E, "top_k": top_k, "H": Hd, "I": I,
                            "activation": activation, "out_dtype": H.DTYPE_NAMES[dtype], "seed": seed,
                            "ran": [], "skipped": {}, "errors": {}, "diffs": {}, "routes": {}}
    problem = dm.MoEProblem(variant, E, top_k, Hd, I, M, activation, dtype)
    table = dm.entries()
    todo = {}
    for name in impls:
        ok, why = dm.verdict(table[(name, variant)], problem, dev_info)
        if ok:
            todo[name] = table[(name, variant)]
        else:
            cell["skipped"][name] = why
    ok_ref, why_ref = dm.verdict(table[("reference", variant)], problem, dev_info)
    if not ok_ref:  # a shape the format cannot hold (H or I not a multiple of its block)
        cell["skipped"]["oracle"] = why_ref
        todo = {}
    if todo:
        gen = torch.Generator(device=device).manual_seed(seed)
        x, w13, w2, ids, wt = moe_inputs(variant, M, E, top_k, Hd, I, dtype, gen, device)
        ref = formats.reference_moe(x, w13, w2, ids, wt, activation=activation, a16=a16, out_dtype=torch.float64)
        for name, backend in todo.items():
            try:
                cell["routes"][name] = route_text(backend.route(problem, dev_info))
                y = backend.apply(x, backend.prepare(w13, w2, activation=activation), ids, wt, activation=activation)
            except Exception as e:  # noqa: BLE001  (a cell records what an implementation raised)
                cell["errors"][name] = f"{type(e).__name__}: {e}"
                continue
            m = H.compare_outputs(y, ref)
            cell["diffs"][name] = {**m, "tol_norm_rel": TOL_NORM_MOE, "ok": bool(m["norm_rel"] <= TOL_NORM_MOE)}
            cell["ran"].append(name)
    cell["ok"] = bool(not cell["errors"] and all(d["ok"] for d in cell["diffs"].values()))
    cell["status"] = ("ok" if cell["diffs"] else "nothing ran") if cell["ok"] else "FAIL"
    return cell


def run_moe_sweep(*, variants: Optional[list[str]] = None, impls: Optional[list[str]] = None, grid: str = "small",
                  dtypes: Optional[list[str]] = None, ms: Optional[list[int]] = None, seed: int = 0,
                  progress: bool = True, device: Optional[str] = None,
                  budget_s: Optional[float] = None) -> dict[str, Any]:
    """The MoE matrix: {"cells": [...], "skipped": [cells not run for the time budget], "summary": {...},
    "tolerance": ...}; ``budget_s``: start no new cell after this many seconds."""
    device = device or H.default_device()
    variants = list(VARIANTS) if variants is None else variants
    impls = tuple(MOE_IMPLS if impls is None else [i for i in MOE_IMPLS if i in impls])
    g = MOE_GRIDS[grid]
    ms = ms or g["m"]
    acts = formats.MOE_ACTIVATIONS
    combos = [(v, dt, M, s) for dt in (dtypes or ["bf16"]) for s in g["shapes"] for M in ms for v in variants]
    clock = H.Stopwatch()
    cells, not_run = [], []
    with H.Progress(len(combos), "sweep MoE", enabled=progress) as bar:
        for i, (v, dt, M, (E, k, Hd, I, act)) in enumerate(combos):
            act = act or acts[list(VARIANTS).index(v) % len(acts)]
            if budget_s is not None and clock() > budget_s:
                not_run.append({"variant": v, "out_dtype": dt, "M": M, "E": E,
                                "reason": f"time budget ({budget_s:g} s)"})
                bar.advance(f"MoE {v} {dt} M={M} E={E} skipped (budget)")
                continue
            cell = run_moe_cell(v, M, E, k, Hd, I, act, H.DTYPES[dt], impls, seed=seed * 100003 + 7919 + i,
                                device=device)
            cells.append(cell)
            bar.advance(f"MoE {v} {dt} M={M} E={E} {cell['status']}")
    failed = [c for c in cells if not c["ok"]]
    compared = sum(1 for c in cells if c["diffs"])
    return {"grid": grid, "tolerance": {"norm_rel": TOL_NORM_MOE}, "cells": cells, "skipped": not_run,
            "summary": {"cells": len(cells), "failed": len(failed), "compared": compared,
                        "skipped_for_time": len(not_run),
                        "ok": not failed and compared > 0, "seconds": round(clock(), 2)}}


def summarize_moe(result: dict[str, Any], *, plain: bool = False) -> None:
    """Print one line per (variant, out dtype, implementation) with the worst cell, then the skips."""
    groups: dict[tuple, list] = {}
    for c in result["cells"]:
        for name, d in c["diffs"].items():
            groups.setdefault((c["variant"], c["out_dtype"], name), []).append((c, d))
        for name, e in c["errors"].items():
            groups.setdefault((c["variant"], c["out_dtype"], name), []).append((c, None))
    rows = []
    for (v, dt, name), items in groups.items():
        ds = [(c, d) for c, d in items if d is not None]
        nerr = len(items) - len(ds)
        if ds:
            wc, w = max(ds, key=lambda cd: cd[1]["norm_rel"])
            shape = f"M={wc['M']} E={wc['E']} k={wc['top_k']} H={wc['H']} I={wc['I']} {wc['activation']}"
            nfail = sum(1 for _, d in ds if not d["ok"]) + nerr
            rows.append([v, dt, f"{name} vs oracle", len(items), H.fmt_num(w["norm_rel"]), H.fmt_num(w["max_rel"]),
                         H.fmt_num(w["cosine"], ".7f"), shape, H.fmt_num(w["tol_norm_rel"]),
                         "ok" if nfail == 0 else f"FAIL x{nfail}"])
        else:
            rows.append([v, dt, f"{name} vs oracle", len(items), "-", "-", "-", "-", "-", f"FAIL x{nerr} (raised)"])
    H.print_table(f"MoE sweep, grid {result['grid']}: worst cell per variant / out dtype / implementation",
                  ["variant", "out", "pair", "cells", "norm rel", "max rel", "min cosine", "worst shape", "tol",
                   "status"], rows, plain=plain)
    for c in result["cells"]:
        for name, e in c["errors"].items():
            print(f"MoE {c['variant']} M={c['M']} {name} raised: {e[:300]}")
    skipped: dict[tuple, int] = {}
    for c in result["cells"]:
        for n, why in c["skipped"].items():
            skipped[(n, why)] = skipped.get((n, why), 0) + 1
    for (n, why), count in skipped.items():
        print(f"MoE: skipped {n} in {count} cells: {why}")
    s = result["summary"]
    verdict = (f"{s['failed']} of {s['cells']} cells DISAGREE" if s["failed"] else
               "NOTHING COMPARED" if not s["compared"] else "all compared cells agree with the oracle")
    if s.get("skipped_for_time"):
        verdict += f"; {s['skipped_for_time']} cells NOT RUN (time budget)"
    print(f"sweep MoE: {s['cells']} cells, {s['compared']} compared an implementation with formats.reference_moe; "
          f"{verdict} ({s['seconds']} s)")
