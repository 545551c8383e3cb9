"""What ``b12x-dual bench`` makes of its rows: speed-ups over the baselines, the performance targets,
the printed tables (also for ``--summarize``), and the plot. The JSON is written by
``_harness.write_json``; every function here takes the result dict of ``bench_run.run_bench``
(or one read back from its JSON).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from dispatch import registry

from . import _harness as H
from .bench_plan import BASELINES, CPU_NOTE


def ratios(results: list[dict]) -> None:
    """speedup_vs[baseline] = t(baseline) / t(row) for rows of the same (shape, M)."""
    base = {(r["shape"], r["M"], r["name"]): r["us"] for r in results if r["kind"] == "baseline" and r.get("us")}
    for r in results:
        if not r.get("us"):
            continue
        r["speedup_vs"] = {b: base[(r["shape"], r["M"], b)] / r["us"] for b in BASELINES
                           if (r["shape"], r["M"], b) in base}



# ---------------------------------------------------------------------------------------------
# Performance targets: speed-up of triton over a baseline timed in the same run, square shape
# ---------------------------------------------------------------------------------------------
FP8_ACCURACY = 1e-3  # fp8_tensor prefill target: relative error budget (max |y - ref| / max |ref|)
BF16_OUTPUT_ROUNDING = 2.0 ** -9  # the bench's bf16 output: RNE error relative to the largest |y|

TARGETS = [
    # (label, variant, M, mode, baseline, threshold)
    ("fp8_tensor 8192^3 GEMM vs _scaled_mm per-tensor", "fp8_tensor", 8192, "gemm", "torch_fp8_tensor", 0.85),
    ("fp8_block 8192^3 GEMM vs _scaled_mm blockwise", "fp8_block", 8192, "gemm", "torch_fp8_block", 0.80),
    ("nvfp4 decode M=16 linear vs bf16", "nvfp4", 16, "linear", "torch_bf16", 3.0),
    ("mxfp4 decode M=16 linear vs bf16", "mxfp4", 16, "linear", "torch_bf16", 3.0),
    ("fp8_tensor decode M=16 linear vs bf16", "fp8_tensor", 16, "linear", "torch_bf16", 1.6),
    ("fp8_block decode M=16 linear vs bf16", "fp8_block", 16, "linear", "torch_bf16", 1.6),
    ("mxfp8 decode M=16 linear vs bf16", "mxfp8", 16, "linear", "torch_bf16", 1.6),
    ("mxfp8 prefill M=4096 linear vs bf16", "mxfp8", 4096, "linear", "torch_bf16", 0.4),
    ("nvfp4 prefill M=4096 linear vs bf16", "nvfp4", 4096, "linear", "torch_bf16", 0.4),
    ("mxfp4 prefill M=4096 linear vs bf16", "mxfp4", 4096, "linear", "torch_bf16", 0.4),
]
# Hopper decode and prefill targets (docs/perf_notes.md): M = 1 and 16, and M = 4096, square shape
TARGETS += [(f"[hopper] {v} decode M={m} linear vs bf16", v, m, "linear", "torch_bf16", thr)
            for m in (1, 16)
            for v, thr in (("nvfp4", 1.5), ("mxfp4", 1.5), ("mxfp4_w4a16", 1.5), ("mxfp8", 1.2),
                           ("fp8_tensor", 1.4), ("fp8_block", 1.4))]
TARGETS += [
    ("[hopper] fp8_tensor prefill M=4096 GEMM vs _scaled_mm per-tensor", "fp8_tensor", 4096, "gemm", "torch_fp8_tensor", 0.85),
    ("[hopper] fp8_block prefill M=4096 GEMM vs _scaled_mm blockwise", "fp8_block", 4096, "gemm", "torch_fp8_block", 0.8),
] + [(f"[hopper] {v} prefill M=4096 linear vs bf16", v, 4096, "linear", "torch_bf16", 0.6) for v in ("mxfp8", "nvfp4", "mxfp4")]


def targets(result: dict) -> list[dict]:
    """The performance targets (:data:`TARGETS`: hopper's speed-up, or triton's where no hopper row
    ran, over a baseline on the square
    8192 x 8192 shape, at least ``threshold``), judged from this run's rows."""
    out = []
    rows = {(r["shape"], r["M"], r["name"], r.get("variant"), r["mode"]): r for r in result["results"]}
    for label, v, M, mode, b, thr in TARGETS:
        # the production row where it ran (hopper on sm_90), else the readable kernels' row
        r = rows.get(("square", M, "hopper", v, mode)) or rows.get(("square", M, "triton", v, mode))
        t = {"target": label, "threshold": thr, "variant": v, "M": M, "mode": mode, "baseline": b}
        if r is None or not r.get("us"):
            t.update({"ratio": None, "met": None,
                      "why": "not run" if r is None else (r.get("error") or r.get("skipped") or "no time")})
        elif b not in r.get("speedup_vs", {}):
            t.update({"ratio": None, "met": None, "why": f"baseline {b} not measured"})
        else:
            t.update({"ratio": r["speedup_vs"][b], "us": r["us"], "roofline_share": r.get("roofline_share"),
                      "tile_config": r.get("tile_config"), "met": r["speedup_vs"][b] >= thr})
            if v == "fp8_tensor" and mode == "gemm" and r.get("check"):
                # the accuracy target: max |y - ref| / max |ref| within 1e-3 of the GEMM's own error
                # plus the bf16 output's rounding, which alone reaches 2^-9 of max |y| (RNE's
                # half-ulp at the largest element); an unpromoted fp8 accumulator exceeds it (4e-3..7e-3)
                t["max_rel"] = r["check"]["max_rel"]
                t["met"] = t["met"] and r["check"]["max_rel"] <= FP8_ACCURACY + BF16_OUTPUT_ROUNDING
        out.append(t)
    return out



# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _pct(v):
    return "-" if v is None else f"{100 * v:.0f}%"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def print_results(result: dict, *, plain: bool = False) -> None:
    c = result["ceilings"]
    if result["cpu_interpreter"]:
        print(CPU_NOTE)
    else:
        print(f"ceilings measured in this run: copy {H.fmt_num(c.get('copy_GBps'), '.0f')} GB/s, "
              f"bf16 {H.fmt_num(c.get('bf16_TFLOPs'), '.0f')} TFLOP/s, fp8 {H.fmt_num(c.get('fp8_TFLOPs'), '.0f')} "
              f"TFLOP/s (fast accum {H.fmt_num(c.get('fp8_TFLOPs_fast_accum'), '.0f')})")
    rows = []
    skips: dict[tuple[str, str], int] = {}
    for r in result["results"]:
        name = r["name"] if r["kind"] == "baseline" else f"{r['name']} {r['variant']}"
        if r.get("skipped"):
            skips[(r["name"], r["skipped"])] = skips.get((r["name"], r["skipped"]), 0) + 1
            continue
        if r.get("error"):
            rows.append([r["shape"], r["M"], name, r["mode"], "-", "-", "-", "-", "-", "-", "-", "-",
                         "ERROR " + r["error"][:70]])
            continue
        sv = r.get("speedup_vs", {})
        chk = r.get("check")
        rows.append([r["shape"], r["M"], name, r["mode"], H.fmt_num(r["us"], ".1f"), H.fmt_num(r["tflops"], ".1f"),
                     H.fmt_num(r["gbps"], ".0f"), _pct(r.get("roofline_share")), _x(sv.get("torch_bf16")),
                     _x(sv.get("torch_fp8_tensor")), _x(sv.get("torch_fp8_block")),
                     "-" if not chk else f"{chk['norm_rel']:.1e}{'' if chk['ok'] else ' FAIL'}",
                     r["method"].split(" (")[0] + (f" x{r['n_sets']}" if r.get("n_sets", 1) > 1 else "")])
    H.print_table(f"bench on {result['device']['name']}" + (" (CPU INTERPRETER: not performance numbers)"
                                                              if result["cpu_interpreter"] else ""),
                  ["shape", "M", "impl", "mode", "us", "TFLOP/s", "GB/s", "roof", "vs bf16", "vs fp8 T",
                   "vs fp8 B", "rel err", "timing"], rows, plain=plain)
    for (n, why), count in skips.items():
        print(f"skipped {n} in {count} rows: {why}")
    for k, v in result["baselines"].items():
        if "unsupported" in k:
            print(f"note: {k}: {v[:400]}")
    if result["skipped"]:
        print(f"note: {len(result['skipped'])} configurations skipped: {result['skipped'][0]['reason']}")
    print_targets(result, plain=plain)


def print_compact(result: dict, *, shape: str = "square", ms=(16, 4096, 8192), plain: bool = False) -> None:
    """The rows of one shape at the targets' M values (the short table of a summary)."""
    c = result["ceilings"]
    if not result["cpu_interpreter"]:
        print(f"ceilings: copy {H.fmt_num(c.get('copy_GBps'), '.0f')} GB/s, bf16 {H.fmt_num(c.get('bf16_TFLOPs'), '.0f')}"
              f" TFLOP/s, fp8 {H.fmt_num(c.get('fp8_TFLOPs'), '.0f')} TFLOP/s")
    rows = []
    for r in result["results"]:
        if r["shape"] != shape or r["M"] not in ms or r.get("skipped"):
            continue
        name = r["name"] if r["kind"] == "baseline" else f"{r['name']} {r['variant']}"
        if r.get("error"):
            rows.append([r["M"], name, r["mode"], "ERROR " + r["error"][:50], "", "", "", "", "", ""])
            continue
        sv = r.get("speedup_vs", {})
        chk = r.get("check")
        rows.append([r["M"], name, r["mode"], H.fmt_num(r["us"], ".1f"), H.fmt_num(r["tflops"], ".0f"),
                     H.fmt_num(r["gbps"], ".0f"), _pct(r.get("roofline_share")), _x(sv.get("torch_bf16")),
                     _x(sv.get("torch_fp8_tensor")) + " / " + _x(sv.get("torch_fp8_block")),
                     "-" if not chk else f"{chk['norm_rel']:.1e}"])
    if rows:
        H.print_table(f"{shape}: M in {list(ms)}", ["M", "impl", "mode", "us", "TF/s", "GB/s", "roof", "vs bf16",
                                                    "vs fp8 T / B", "rel err"], rows, plain=plain)


def print_targets(result: dict, *, plain: bool = False) -> None:
    """The targets table: only the targets this run measured something for; one line for those it
    did not run (their square-shape rows are not in the run), and one line instead of the table on
    the CPU interpreter (the targets are GPU timings)."""
    ts = result.get("targets", [])
    if result["cpu_interpreter"]:
        print(f"performance targets: {len(ts)} defined, none judged here (they are GPU timings of the square "
              "8192 x 8192 shape; this run used the CPU interpreter)")
        return
    shown = [t for t in ts if t.get("why") != "not run"]
    rows = []
    for t in shown:
        met = {True: "MET", False: "missed", None: "n/a"}[t["met"]]
        extra = f" max_rel {t['max_rel']:.1e}" if "max_rel" in t else ""
        rows.append([t["target"], _x(t.get("ratio")), f">= {t['threshold']}x", H.fmt_num(t.get("us"), ".1f"),
                     _pct(t.get("roofline_share")), (t.get("tile_config") or "-")[:60], met + extra
                     + (f" ({t['why']})" if t.get("why") else "")])
    if rows:
        H.print_table("performance targets (square 8192 x 8192; hopper rows where they ran, else triton)",
                      ["target", "ratio", "need", "us", "roof", "tile", "status"], rows, plain=plain)
    if len(shown) < len(ts):
        missing = sorted({t["M"] for t in ts if t.get("why") == "not run"})
        print(f"performance targets: {len(ts) - len(shown)} of {len(ts)} not run (this run has no hopper or triton row of "
              f"the square 8192 x 8192 shape at M in {missing}; run with --shapes square)")


def print_sweep_summary(sweep: dict, *, plain: bool = False) -> None:
    by: dict[str, list] = {}
    for c in sweep["cells"]:
        by.setdefault(c["variant"], []).append(c)
    rows = []
    for v, cs in by.items():
        pairs = [p for c in cs for p in c["pairs"]]
        quant = [q.get("ok") for c in cs for q in c["quant"].values() if q.get("ok") is not None]
        worst = max((p["norm_rel"] for p in pairs), default=None)
        rows.append([v, len(cs), f"{sum(quant)}/{len(quant)}" if quant else "-", H.fmt_num(worst),
                     sum(1 for c in cs if not c["ok"])])
    H.print_table(f"sweep ({sweep['grid']} grid): per variant", ["variant", "cells", "act. bit-exact",
                                                                 "worst norm rel", "failed"], rows, plain=plain)
    s = sweep["summary"]
    verdict = "OK" if s["ok"] else "DISAGREEMENT" if s["failed"] else "NOTHING COMPARED"
    print(f"sweep: {s['cells']} cells, {s['failed']} failed, {s['compared']} compared -> {verdict}")



# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------
COLORS = {v: f"C{i}" for i, v in enumerate(registry.VARIANTS)}
"""One colour per variant, in the registry's order (matplotlib's colour cycle)."""


def relative_luminance(rgb) -> float:
    """WCAG 2.x relative luminance of an sRGB colour (components in [0, 1]): 0 black, 1 white."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def text_color(background) -> str:
    """"black" or "white", whichever has the higher WCAG contrast ratio on ``background`` (an sRGB
    triple); the worse of the two choices is never below 4.58:1 (at luminance 0.179)."""
    lum = relative_luminance(background)
    return "black" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "white"


def plot(result: dict, path: str) -> Optional[str]:
    """Roofline (achieved TFLOP/s vs FLOP/byte, measured ceilings) and a heat map of the whole
    linear's speed-up over torch's bf16 F.linear (cuBLAS on a GPU, torch's CPU matmul on the
    interpreter), each cell labelled with its ratio in a colour readable on its background.
    Returns None, or why nothing was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib not available ({type(e).__name__}); no plot"
    rs = [r for r in result["results"] if r.get("us")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(18, 7.5), gridspec_kw={"width_ratios": [1, 1.4]})
    c = result["ceilings"]
    ai = [r["flops"] / r["bytes"] for r in rs]
    if c.get("copy_GBps") and ai:
        xs = [10 ** (i / 20) for i in range(int(20 * math.log10(max(min(ai), 0.1))) - 5,
                                            int(20 * math.log10(max(ai))) + 10)]
        for peak, lab, ls in ((c.get("bf16_TFLOPs"), "bf16", "--"), (c.get("fp8_TFLOPs"), "fp8", "-")):
            if peak:
                ax1.plot(xs, [min(peak, c["copy_GBps"] * x / 1e3) for x in xs], "k" + ls, lw=1,
                         label=f"roofline {lab}: {peak:.0f} TF/s, {c['copy_GBps']:.0f} GB/s")
    for r in rs:
        x = r["flops"] / r["bytes"]
        if r["kind"] == "baseline":
            ax1.scatter(x, r["tflops"], marker="^", color="grey", s=18, alpha=0.7)
        else:
            ax1.scatter(x, r["tflops"], marker="o" if r["mode"] == "linear" else "x",
                        color=COLORS.get(r["variant"], "k"), s=16, alpha=0.8)
    for v, col in COLORS.items():
        ax1.scatter([], [], color=col, label=v)
    ax1.scatter([], [], marker="^", color="grey", label="torch baselines")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax1.set_ylabel("TFLOP/s")
    ax1.set_title("roofline (o whole linear, x GEMM alone)")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.grid(True, which="both", alpha=0.3)

    lin = [r for r in rs if r["kind"] == "impl" and r["mode"] == "linear" and "torch_bf16" in r.get("speedup_vs", {})]
    cols = sorted({(r["shape"], r["M"]) for r in lin},
                  key=lambda t: ([s["id"] for s in result["shapes"]].index(t[0]) if t[0] in
                                 [s["id"] for s in result["shapes"]] else 99, t[1]))
    rlabels = sorted({(r["name"], r["variant"]) for r in lin}, key=lambda t: (t[0], list(COLORS).index(t[1])
                                                                              if t[1] in COLORS else 99))
    if cols and rlabels:
        import numpy as np

        grid = np.full((len(rlabels), len(cols)), np.nan)
        for r in lin:
            grid[rlabels.index((r["name"], r["variant"])), cols.index((r["shape"], r["M"]))] = r["speedup_vs"]["torch_bf16"]
        im = ax2.imshow(np.log2(grid), cmap="RdYlGn", vmin=-3, vmax=3, aspect="auto")
        texts = {(i, j): f"{grid[i, j]:.2g}x" for i in range(len(rlabels)) for j in range(len(cols))
                 if not np.isnan(grid[i, j])}
        # the largest font whose widest label fits a cell (the axes span about 650 x 500 points; a
        # character is about 0.6 em wide), written across the cell or, when that fits a larger
        # font (many narrow columns), along it; at most 12 points
        chars = max(len(t) for t in texts.values())
        cell_w, cell_h = 650 / len(cols), 500 / len(rlabels)
        across = min(cell_w / (0.6 * chars + 1), cell_h / 2)
        along = min(cell_h / (0.6 * chars + 1), cell_w / 2)
        size, rotation = (across, 0) if across >= along else (along, 90)
        size = max(4.0, min(12.0, size))
        for (i, j), text in texts.items():
            # black or white, whichever contrasts more with the cell's colour (white on the dark ends
            # of RdYlGn, black on its light middle)
            ink = text_color(im.cmap(im.norm(math.log2(grid[i, j])))[:3])
            ax2.text(j, i, text, ha="center", va="center", fontsize=size, fontweight="bold",
                     rotation=rotation, color=ink)
        ax2.set_xticks(range(len(cols)))
        ax2.set_xticklabels([f"{s} M={m}" for s, m in cols], rotation=90 if len(cols) > 6 else 0, fontsize=8)
        ax2.set_yticks(range(len(rlabels)))
        ax2.set_yticklabels([f"{n} {v}" for n, v in rlabels], fontsize=8)
        base = "torch's CPU matmul" if result["cpu_interpreter"] else "cuBLAS"
        ax2.set_title(f"whole linear: speed-up over torch bf16 F.linear ({base}); >1 is faster")
        fig.colorbar(im, ax=ax2, label="log2 speed-up")
    title = f"b12x-dual bench on {result['device']['name']}"
    if result["cpu_interpreter"]:
        title += " -- CPU INTERPRETER, NOT PERFORMANCE NUMBERS"
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------
# Summary of earlier runs' JSON
# ---------------------------------------------------------------------------------------------
def summarize(bench_json: Optional[str], sweep_json: Optional[str] = None, *, plain: bool = False) -> None:
    """``--summarize``: the sweep's per-variant summary (``sweep_json``), then the bench's counts,
    the square shape's rows and the targets (``bench_json``), read back from their JSON files."""
    if sweep_json:
        with open(sweep_json) as f:
            print_sweep_summary(json.load(f), plain=plain)
    if bench_json:
        with open(bench_json) as f:
            res = json.load(f)
        print(f"bench: {len([r for r in res['results'] if r.get('us')])} timed rows, "
              f"{len(res['skipped'])} configurations skipped (time budget), "
              f"{len([r for r in res['results'] if r.get('error')])} errors, {res['seconds']} s")
        print_compact(res, plain=plain)
        print_targets(res, plain=plain)
