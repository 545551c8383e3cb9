"""GPU sweep of the native (tl.dot_scaled) GEMMs against the float64 oracle and the portable path.

    python tools/h200_native_sweep.py [--out DIR] [--budget-s 420] [--quick]

For every format (and fp8_block with UE8M0 scales) and every cell of a large grid (M from decode to
prefill, N x K from 2048 to 8192), the same quantized operands (formats.quantize, the oracle) go
through kernels_triton's native path and portable path with fp32 output and a bias. Each result is
compared elementwise with formats.reference_linear (float64) against the fp32-summation bound
(K + 3) * 2^-24 * (|x| . |w|^T + |bias|) (both paths sum exact products in fp32); ``ratio`` is the
largest |y - ref| / bound (<= 1 passes). NVFP4's native kernel is attempted directly and its
compile error recorded where Triton cannot build it (sm_90 with Triton 3.6: triton#7549). NVFP4
W4A16 is checked the same way. Timings (triton.testing.do_bench, GEMM alone) are a note only: on
sm_90 dot_scaled is emulated (bf16 wgmma), which says nothing about SM12x speed.

Writes sweep.json and prints a table, the summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels_triton  # noqa: E402  (first: it sets TRITON_INTERPRET=1 when there is no GPU)
import torch  # noqa: E402
import triton  # noqa: E402

import formats  # noqa: E402
from formats import FORMAT_NAMES, spec  # noqa: E402
from kernels_triton import nvfp4  # noqa: E402

U = 2.0 ** -24
DEV = "cuda"
MS = (1, 16, 64, 200, 4096)
NKS = ((4096, 4096), (2112, 7168), (8192, 8192))


def bound(xq, qw, bias, k):
    xa = formats.dequantize(xq, torch.float64).abs()
    wa = formats.dequantize(qw, torch.float64).abs()
    return (k + 3) * U * (xa @ wa.T + bias.double().abs()) + 1e-30


def ratio(y, ref, b) -> float:
    y = y.double()
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return float(((y - ref).abs() / b).max())


def cases():
    out = [(f, {}) for f in FORMAT_NAMES] + [("fp8_block", {"ue8m0": True})]
    return out


def _native_tile(fmt, m, opts):
    """The native tile the triton backend passes on SM12x (kernels_triton.tuning's table)."""
    from kernels_triton import tuning

    kind = "e2m1" if spec(fmt).element == "e2m1" else ("fp8_block" if fmt == "fp8_block" and not opts else "e4m3")
    return tuning.sm12x_config(kind, m)


def run_cell(fmt, opts, m, n, k, gen, timing: bool) -> dict:
    dev = DEV
    mod = kernels_triton.module(fmt)
    w = torch.randn(n, k, generator=gen, device=dev) * 0.05
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=dev)
    qw = formats.quantize(w, fmt, **opts)
    xq = formats.quantize(x, fmt, role="activation", **opts)
    ref = formats.reference_linear(xq, qw, bias, out_dtype=torch.float64)
    b = bound(xq, qw, bias, k)
    rec = {"fmt": fmt + ("-ue8m0" if opts else ""), "M": m, "N": n, "K": k}
    yp = mod.gemm(xq, qw, bias, out_dtype=torch.float32, path="portable", **opts)
    rec["portable_ratio"] = ratio(yp, ref, b)
    try:
        if spec(fmt).scale.startswith("e4m3") and _cap()[0] != 12:
            # bypass route_path's refusal to record what Triton itself says
            yn = nvfp4._launch_gemm("native", _native_tile(fmt, m, opts), xq, qw, bias, torch.float32)
        else:
            yn = mod.gemm(xq, qw, bias, out_dtype=torch.float32, path="native", tile=_native_tile(fmt, m, opts), **opts)
        if DEV == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        rec["native_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"
        return rec
    rec["native_ratio"] = ratio(yn, ref, b)
    rec["native_vs_portable_ratio"] = float(((yn.double() - yp.double()).abs() / (2 * b)).max())
    rec["native_tile"] = str(_native_tile(fmt, m, opts))
    if timing:
        from triton.testing import do_bench

        tn = do_bench(lambda: mod.gemm(xq, qw, bias, path="native", **opts), warmup=5, rep=30)
        tp = do_bench(lambda: mod.gemm(xq, qw, bias, path="portable", **opts), warmup=5, rep=30)
        rec["native_us"], rec["portable_us"] = round(tn * 1e3, 1), round(tp * 1e3, 1)
    return rec


def w4a16_cell(fmt, m, n, k, gen) -> dict:
    dev = DEV
    mod = kernels_triton.module(fmt)
    w = torch.randn(n, k, generator=gen, device=dev) * 0.05
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=dev)
    qw = formats.quantize(w, fmt)
    ref = formats.reference_linear(x, qw, bias, a16=True, out_dtype=torch.float64)
    mag = x.double().abs() @ formats.dequantize(qw, torch.float64).abs().T + bias.double().abs()
    y = mod.gemm_w4a16(x, qw, bias, out_dtype=torch.float32)
    return {"fmt": f"{fmt}-w4a16", "M": m, "N": n, "K": k,
            "portable_ratio": ratio(y, ref, (k + 4) * U * mag + 1e-30)}


def _cap():
    return torch.cuda.get_device_capability() if DEV == "cuda" else (0, 0)


def main(argv=None) -> int:
    global DEV
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for sweep.json")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cells after this")
    p.add_argument("--quick", action="store_true", help="two cells per format (smoke)")
    p.add_argument("--cpu-smoke", action="store_true", help="one tiny cell per format under the interpreter")
    args = p.parse_args(argv)
    t0 = time.time()
    if args.cpu_smoke:
        DEV = "cpu"
    cap = _cap()
    head = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "CPU (interpreter)",
            "capability": f"sm_{cap[0]}{cap[1]}",
            "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print(json.dumps(head))
    for fmt in FORMAT_NAMES:
        print(f"gemm_path({fmt}) = {kernels_triton.gemm_path(fmt, cap)}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    grid = [(m, n, k) for (n, k) in NKS for m in MS]
    if args.quick:
        grid = [(16, 2112, 7168), (200, 4096, 4096)]
    if args.cpu_smoke:
        grid = [(5, 72, 256)]
    recs, skipped = [], 0
    for fmt, opts in cases():
        for (m, n, k) in grid:
            if time.time() - t0 > args.budget_s:
                skipped += 1
                continue
            timing = (n, k) == (8192, 8192) and m in (16, 4096) and DEV == "cuda"
            try:
                rec = run_cell(fmt, opts, m, n, k, gen, timing)
            except Exception as e:  # noqa: BLE001
                rec = {"fmt": fmt, "M": m, "N": n, "K": k, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            recs.append(rec)
            print(json.dumps(rec), flush=True)
    for fmt in kernels_triton._common.A16_FORMATS:
        for (m, n, k) in (grid[:1] if args.quick or args.cpu_smoke else [(1, 4096, 4096), (200, 2112, 7168), (4096, 8192, 8192)]):
            if time.time() - t0 <= args.budget_s:
                recs.append(w4a16_cell(fmt, m, n, k, gen))
                print(json.dumps(recs[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"head": head, "cells": recs, "skipped_for_time": skipped}, f, indent=1)
    # summary: per format, cells, worst ratios, errors
    print("\n| format | cells | native max ratio | portable max ratio | native vs portable | native errors |")
    print("|---|---|---|---|---|---|")
    by = {}
    for r in recs:
        by.setdefault(r["fmt"], []).append(r)
    for f, rs in by.items():
        def mx(key):
            v = [r[key] for r in rs if key in r]
            return f"{max(v):.3g}" if v else "-"
        errs = sorted({r.get("native_error", r.get("error", "")) for r in rs} - {""})
        print(f"| {f} | {len(rs)} | {mx('native_ratio')} | {mx('portable_ratio')} | {mx('native_vs_portable_ratio')} "
              f"| {'; '.join(errs)[:120] or 'none'} |")
    timed = [r for r in recs if "native_us" in r]
    if timed:
        print("\ntiming note (emulated dot_scaled on this GPU; GEMM alone, bf16 out, us): " + ", ".join(
            f"{r['fmt']} M={r['M']}: native {r['native_us']} / portable {r['portable_us']}" for r in timed))
    print(f"\n{len(recs)} cells in {time.time() - t0:.0f} s; {skipped} skipped for time")
    bad = [r for r in recs if r.get("native_ratio", 0) > 1 or r.get("portable_ratio", 0) > 1 or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
