"""``b12x-dual sweep``: the diff matrix on this device.

formats x implementations available here x a shape grid x output dtypes. Rows are the variants of
dispatch.registry.VARIANTS: the six formats and the weight-only ones (``nvfp4_w4a16``,
``mxfp4_w4a16``: 4-bit weights; ``mxfp8_w8a16``: 8-bit weights; bf16/fp16 activations). Implementations are registry backends:
reference (formats/ oracle, float64 output), triton (the readable kernels_triton), hopper
(kernels_triton.hopper, sm_90 only), cute (kernels_cute, SM12x only); one that ``registry.verdict``
says cannot run a cell on this device is skipped there with the registry's reason. Each cell records
the route every implementation took (``Backend.route``: kernels, tile, split-K, why; ``--verbose``
prints them).
Every cell draws fresh random inputs (normal values, outliers, all-zero blocks; a fresh weight
quantized by the oracle) and gives every implementation the same ones.

Per cell:
  * activation bit-exactness: each implementation's quantize_activation(x) against
    formats.quantize(x, fmt, role="activation"): codes, scales (unswizzled) and global scale compared
    as bytes. Not applicable to W4A16.
  * output agreement between every pair of implementations: norm_rel = ||a - b|| / ||b||, max_rel,
    mean_rel and cosine (dispatch.apps._harness.compare_outputs), b the earlier one in the order
    reference, triton, hopper, cute (so reference is the denominator whenever it is in the pair).

Tolerances: norm_rel <= 4e-3 for bf16 output, <= 1e-3 for fp16; for cute vs triton or hopper
on fp8_block (b12x's split-K with bf16 atomics) norm_rel <= 3e-3 and cosine >= 0.99999 (the wider
of the two norm bounds applies). NaN or Inf never passes. An implementation that raises on a cell it
claimed to support fails the cell.

Grids (--grid):
  small  M in {1, 3, 16}, (N, K) in {(40, 128), (64, 256)}: the CPU interpreter runs the whole matrix
         in well under a minute.
  large  M in {1, 16, 128, 4096}, (N, K) in {4096, 8192}^2: for the GPU.

Exit status: 0 when every cell agrees and at least one comparison was made; 1 when any cell
disagrees, an implementation raised, or nothing was compared (every implementation asked for was
skipped here, or the one that ran has no activation quantizer to check against the oracle); 2 for
bad arguments (a ``--json`` path that cannot be written is refused before the run). ``--json PATH``
writes every cell; the table gives one line per (variant, out dtype, pair) with the worst cell (a
cell without a pair says what ran: "(triton alone)", "(nothing ran)"), and every failing cell.

MoE (dispatch.apps.sweep_moe): with ``--moe``, or by default when ``--formats`` is not given
(``--no-moe`` leaves it out), the MoE matrix runs after the dense one: every MoE implementation that
runs here (the MoE table's triton, hopper, cute cells) against formats.reference_moe, norm_rel <= 1e-2;
its cells count in the exit status and go under "moe" in the JSON.

    b12x-dual sweep --grid small
    python -m dispatch.apps.sweep --grid large --json out/sweep.json      (no console script needed)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import traceback
from typing import Any, Optional

import torch

import formats

from dispatch.api import library_versions
from dispatch.devices import interpreting
from dispatch.registry import VARIANTS

from . import _harness as H
from . import argtypes as A

GRIDS: dict[str, dict[str, list]] = {
    "small": {"m": [1, 3, 16], "nk": [(40, 128), (64, 256)]},
    "large": {"m": [1, 16, 128, 4096], "nk": [(4096, 4096), (4096, 8192), (8192, 4096), (8192, 8192)]},
}
IMPL_ORDER = ("reference", "triton", "hopper", "cute")

TOL_NORM = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
SPLITK_NORM, SPLITK_COSINE = 3e-3, 0.99999


def tolerance(fmt: str, out_dtype: torch.dtype, a: str, b: str) -> dict[str, Optional[float]]:
    """{"norm_rel": bound, "cosine": bound or None} for the pair (a, b) of implementations."""
    tol: dict[str, Optional[float]] = {"norm_rel": TOL_NORM.get(out_dtype, 1e-3), "cosine": None}
    if fmt == "fp8_block" and {a, b} in ({"cute", "triton"}, {"cute", "hopper"}):  # b12x's bf16-atomic split-K
        tol = {"norm_rel": max(tol["norm_rel"], SPLITK_NORM), "cosine": SPLITK_COSINE}
    return tol


def run_cell(variant: str, M: int, N: int, K: int, dtype: torch.dtype, impls: dict[str, H.BackendFactory], *,
             seed: int, device: str) -> dict[str, Any]:
    """One cell of the matrix: fresh inputs, every implementation (``impls``: name -> factory of its
    registry backend per variant) that the registry says can run it on ``device``, the comparisons."""
    fmt, a16 = H.split(variant)
    dev_info = H.running_device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = H.make_input((M, K), dtype, gen, device)
    w = H.make_weight(N, K, gen, device)
    bias = torch.randn(N, generator=gen, device=device).to(dtype)
    qweight = formats.quantize(w, fmt, role="weight")
    cell: dict[str, Any] = {
        "variant": variant, "fmt": fmt, "a16": a16, "M": M, "N": N, "K": K,
        "out_dtype": H.DTYPE_NAMES[dtype], "seed": seed,
        "ran": [], "skipped": {}, "errors": {}, "quant": {}, "pairs": [], "routes": {},
    }
    outs: dict[str, torch.Tensor] = {}
    backends = {}
    for name, factory in impls.items():
        entry = factory(variant)
        ok, why = H.check(entry, variant, M, N, K, dtype, dev_info)
        if not ok:
            cell["skipped"][name] = why
            continue
        backends[name] = entry
        cell["routes"][name] = H.route_record(entry, variant, M, N, K, dev_info, dtype)
        # the oracle in float64: the exact product of the quantized operands, rounded once
        opts = {"out_dtype": torch.float64} if name == "reference" else {}
        try:
            prepared = entry.prepare(qweight)
            y = entry.apply(x, prepared, bias, **opts)
            outs[name] = y.detach()
            cell["ran"].append(name)
        except Exception as e:
            cell["errors"][name] = f"linear: {type(e).__name__}: {e}"
            cell["traceback_" + name] = traceback.format_exc(limit=4)

    # activation bit-exactness against the oracle (compare_quantized unswizzles 128x4 scales)
    if not a16:
        ref_q = formats.quantize(x, fmt, role="activation")
        for name in cell["ran"]:
            backend = backends[name]
            if name == "reference" or not H.has_quantizer(backend):
                continue
            try:
                cell["quant"][name] = H.compare_quantized(backend.quantize_activation(x), ref_q)
            except Exception as e:
                cell["quant"][name] = {"ok": False, "detail": f"quantize_activation: {type(e).__name__}: {e}"}

    # every pair, the earlier implementation as the denominator
    for a, b in itertools.combinations(cell["ran"], 2):
        m = H.compare_outputs(outs[b], outs[a])
        tol = tolerance(fmt, dtype, a, b)
        ok = m["norm_rel"] <= tol["norm_rel"] and (tol["cosine"] is None or m["cosine"] >= tol["cosine"])
        cell["pairs"].append({"a": b, "b": a, **m, "tol_norm_rel": tol["norm_rel"],
                              "tol_cosine": tol["cosine"], "ok": bool(ok)})

    quant_ok = all(q.get("ok") is not False for q in cell["quant"].values())
    cell["ok"] = bool(not cell["errors"] and quant_ok and all(p["ok"] for p in cell["pairs"]))
    cell["status"] = "ok" if cell["ok"] else "FAIL"
    if cell["ok"] and not cell["pairs"] and not cell["quant"]:
        cell["status"] = "nothing ran" if not cell["ran"] else "nothing compared"
    return cell


def run_sweep(*, variants: Optional[list[str]] = None, impls: Optional[list[str]] = None, grid: str = "small",
              dtypes: Optional[list[str]] = None, ms: Optional[list[int]] = None,
              nk: Optional[list[tuple[int, int]]] = None, seed: int = 0,
              extra_backends: Optional[dict[str, H.BackendFactory]] = None, progress: bool = True,
              device: Optional[str] = None, budget_s: Optional[float] = None) -> dict[str, Any]:
    """Run the matrix and return the JSON-able result (see the module docstring for the fields).

    ``extra_backends`` adds implementations (name -> factory(variant) -> registry.Backend), e.g. a
    deliberately broken one in the tests. ValueError for an unknown implementation name."""
    device = device or H.default_device()
    variants = H.variants_from_formats(variants)
    dtypes = dtypes or ["bf16", "fp16"]
    g = GRIDS[grid]
    ms = ms or g["m"]
    nk = nk or g["nk"]
    impl_objs = H.implementations(impls, IMPL_ORDER, extra_backends)
    clock = H.Stopwatch()
    cells = []
    # variants innermost: a time budget then cuts the last shapes of every variant, not whole variants
    combos = [(v, dt, M, N, K) for dt in dtypes for (N, K) in nk for M in ms for v in variants]
    skipped = []
    with H.Progress(len(combos), "sweep", enabled=progress) as bar:
        for i, (v, dt, M, N, K) in enumerate(combos):
            if budget_s is not None and clock() > budget_s:
                skipped.append({"variant": v, "out_dtype": dt, "M": M, "N": N, "K": K,
                                "reason": f"time budget ({budget_s:g} s) spent"})
                bar.advance(f"{v} {dt} M={M} N={N} K={K} skipped (budget)")
                continue
            t0 = clock()
            cell = run_cell(v, M, N, K, H.DTYPES[dt], impl_objs, seed=seed * 100003 + i, device=device)
            cell["seconds"] = round(clock() - t0, 3)
            cells.append(cell)
            bar.advance(f"{v} {dt} M={M} N={N} K={K} {cell['status']}")
    failed = [c for c in cells if not c["ok"]]
    compared = sum(1 for c in cells if c["pairs"] or c["quant"])
    outputs = sum(1 for c in cells if c["pairs"])
    activations = sum(1 for c in cells if c["quant"])
    return {
        "tool": "b12x-dual sweep",
        "device": H.device_report(),
        "versions": library_versions(),
        "interpreter": interpreting(),
        "grid": grid,
        "args": {"variants": variants, "impls": list(impl_objs), "dtypes": dtypes, "m": ms,
                 "nk": [list(t) for t in nk], "seed": seed},
        "impls": {n: {"note": "" if n in (extra_backends or {}) else H.impl_note(n)} for n in impl_objs},
        "tolerances": {"norm_rel": {H.DTYPE_NAMES[k]: v for k, v in TOL_NORM.items()},
                       "cute_vs_triton_fp8_block": {"norm_rel": SPLITK_NORM, "cosine": SPLITK_COSINE}},
        "cells": cells,
        "skipped": skipped,
        "summary": {"cells": len(cells), "failed": len(failed), "compared": compared,
                    "compared_outputs": outputs, "checked_activations": activations,
                    "nothing_compared": len(cells) - compared, "skipped_for_time": len(skipped),
                    "ok": not failed and compared > 0, "seconds": round(clock(), 2)},
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _pair_label(cell) -> str:
    """What a cell without an output pair ran: '(triton alone)', '(nothing ran)'."""
    ran = cell["ran"]
    return "(nothing ran)" if not ran else f"({ran[0]} alone)" if len(ran) == 1 else "(no pair)"


def _quant_str(cells) -> str:
    res = [q.get("ok") for c in cells for q in c["quant"].values()]
    res = [r for r in res if r is not None]
    if not res:
        return "-"
    return f"{sum(res)}/{len(res)} exact"


def summarize(result: dict[str, Any], *, verbose: bool = False, plain: bool = False) -> None:
    """Print the per-(variant, dtype, pair) table, the failing cells and the skip reasons."""
    cells = result["cells"]
    rows = []
    groups: dict[tuple, list] = {}
    for c in cells:
        for p in c["pairs"] or [None]:
            key = (c["variant"], c["out_dtype"], _pair_label(c) if p is None else f"{p['a']} vs {p['b']}")
            groups.setdefault(key, []).append((c, p))
    for (variant, dt, pair), items in groups.items():
        pcs = [(c, p) for c, p in items if p is not None]
        cs = list({id(c): c for c, _ in items}.values())
        if pcs:
            worst_c, worst = max(pcs, key=lambda cp: cp[1]["norm_rel"])
            shape = f"{worst_c['M']}x{worst_c['N']}x{worst_c['K']}"
            nfail = sum(1 for _, p in pcs if not p["ok"])
            rows.append([variant, dt, pair, len(pcs), _quant_str(cs), H.fmt_num(worst["norm_rel"]),
                         H.fmt_num(worst["max_rel"]), H.fmt_num(worst["mean_rel"]),
                         H.fmt_num(min(p["cosine"] for _, p in pcs), ".7f"), shape,
                         H.fmt_num(worst["tol_norm_rel"]), "ok" if nfail == 0 else f"FAIL x{nfail}"])
        else:
            status = "FAIL" if not all(c["ok"] for c in cs) else (
                "ok" if any(c["quant"] for c in cs) else cs[0]["status"])
            rows.append([variant, dt, pair, len(cs), _quant_str(cs), "-", "-", "-", "-", "-", "-", status])
    title = (f"sweep on {result['device']['name']} ({'interpreter' if result['interpreter'] else 'GPU'}), "
             f"grid {result['grid']}: worst cell per variant / out dtype / pair")
    H.print_table(title, ["variant", "out", "pair", "cells", "act. bits", "norm rel", "max rel", "mean rel",
                          "min cosine", "worst M x N x K", "tol", "status"], rows, plain=plain)

    if verbose:
        rows = []
        for c in cells:
            for p in c["pairs"] or [None]:
                rows.append([c["variant"], c["out_dtype"], c["M"], c["N"], c["K"],
                             _pair_label(c) if p is None else f"{p['a']} vs {p['b']}", _quant_str([c]),
                             "-" if p is None else H.fmt_num(p["norm_rel"]),
                             "-" if p is None else H.fmt_num(p["cosine"], ".7f"), c["status"],
                             "; ".join(f"{n}: {r['text']}" for n, r in c.get("routes", {}).items() if r)[:400]])
        H.print_table("every cell", ["variant", "out", "M", "N", "K", "pair", "act. bits", "norm rel",
                                     "cosine", "status", "routes"], rows, plain=plain)

    bad = [c for c in cells if not c["ok"]]
    if bad:
        rows = []
        for c in bad:
            why = [f"{n}: {e}" for n, e in c["errors"].items()]
            why += [f"{n} activation: {q['detail']}" for n, q in c["quant"].items() if q.get("ok") is False]
            why += [f"{p['a']} vs {p['b']}: norm_rel {H.fmt_num(p['norm_rel'])} > {p['tol_norm_rel']:g}"
                    + (f" or cosine {p['cosine']:.7f} < {p['tol_cosine']}" if p["tol_cosine"] else "")
                    for p in c["pairs"] if not p["ok"]]
            rows.append([c["variant"], c["out_dtype"], f"{c['M']}x{c['N']}x{c['K']}", "; ".join(why)[:300]])
        H.print_table(f"FAILING cells ({len(bad)})", ["variant", "out", "M x N x K", "why"], rows, plain=plain)

    skipped = {}
    for c in cells:
        for n, why in c["skipped"].items():
            skipped.setdefault((n, why), 0)
            skipped[(n, why)] += 1
    for (n, why), count in skipped.items():
        print(f"skipped {n} in {count} cells: {why}")
    s = result["summary"]
    outputs = sum(1 for c in cells if c["pairs"])
    activations = sum(1 for c in cells if c["quant"])
    nothing = sum(1 for c in cells if not c["pairs"] and not c["quant"])
    if s["failed"]:
        verdict = f"{s['failed']} of {s['cells']} cells DISAGREE"
    elif s["compared"] == 0:
        verdict = ("NOTHING COMPARED: no cell ran two implementations or an activation quantizer "
                   "(see the skip reasons above)")
    else:
        verdict = "all compared cells agree"
    if s.get("skipped_for_time"):
        verdict += f"; {s['skipped_for_time']} cells NOT RUN (time budget)"
    counts = (f"{outputs} compared two implementations' outputs, {activations} checked activation bits "
              f"against the oracle" + (f", {nothing} compared nothing" if nothing else ""))
    print(f"sweep: {s['cells']} cells: {counts}; {verdict} ({s['seconds']} s)")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="diff matrix: formats x implementations x shapes on this device",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", choices=list(GRIDS), default=None,
                   help="shape grid (default: small without a GPU, large with one)")
    p.add_argument("--formats", type=A.choice_list(VARIANTS, "format"), default=None,
                   help=f"comma list from {list(VARIANTS)} (default: all)")
    p.add_argument("--impls", type=A.choice_list(IMPL_ORDER, "implementation"), default=None,
                   help="comma list from reference,triton,cute (default: all)")
    p.add_argument("--dtypes", type=A.choice_list(H.DTYPES, "dtype"), default="bf16,fp16",
                   help="activation/output dtypes: bf16,fp16")
    p.add_argument("--m", type=A.int_list, default=None, help="comma list of M overriding the grid's")
    p.add_argument("--seed", type=A.nonnegative_int, default=0)
    p.add_argument("--budget-s", type=A.nonnegative_float, default=None,
                   help="start no new cell after this many seconds (the rest are listed as not run)")
    p.add_argument("--json", type=A.output_path, default=None, metavar="PATH", help="write every cell as JSON")
    p.add_argument("--moe", dest="moe", action="store_true", default=None,
                   help="also diff every MoE implementation against formats.reference_moe (default: on when "
                        "--formats is not given)")
    p.add_argument("--no-moe", dest="moe", action="store_false", help="leave the MoE matrix out")
    p.add_argument("--verbose", action="store_true", help="print every cell, not only the worst per group")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")


def run(args, *, extra_backends: Optional[dict[str, H.BackendFactory]] = None) -> int:
    """The sweep with the parsed options (every value already checked by its ``type=``); 0 when every
    cell agrees, 1 otherwise."""
    grid = args.grid or ("large" if H.on_gpu() else "small")
    result = run_sweep(variants=args.formats, impls=args.impls, grid=grid, dtypes=args.dtypes, ms=args.m,
                       seed=args.seed, extra_backends=extra_backends, progress=not args.no_progress,
                       budget_s=args.budget_s)
    summarize(result, verbose=args.verbose, plain=args.plain)
    ok = result["summary"]["ok"]
    if args.moe or (args.moe is None and args.formats is None):
        from . import sweep_moe

        moe = sweep_moe.run_moe_sweep(variants=args.formats, impls=args.impls, grid=grid, dtypes=args.dtypes,
                                      ms=args.m, seed=args.seed, progress=not args.no_progress,
                                      budget_s=args.budget_s)
        sweep_moe.summarize_moe(moe, plain=args.plain)
        result["moe"] = moe
        ok = ok and moe["summary"]["ok"]
    if args.json:
        H.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0 if ok else 1


def main(argv=None, *, extra_backends: Optional[dict[str, H.BackendFactory]] = None) -> int:
    p = argparse.ArgumentParser(prog="b12x-dual sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv), extra_backends=extra_backends)


if __name__ == "__main__":
    sys.exit(main())
