"""Issue 13, programmatic dependent launch: the whole decode linear (``<fmt>.linear``: activation
quantization + GEMM + split-K reduction) with PDL on and off, in one process (one device call).

N = K = 8192, bf16 x, M = 1 and 16, CUDA-graph replay over 5 distinct weights (from HBM, as
tools/h200_decode_probe.py's graph_us), PDL toggled through B12X_PDL between captures. Off and on
are measured alternately, ROUNDS times each, and the median of the rounds is kept; the spread of
the rounds (max - min) says what a difference has to beat. Each row also checks that the on and off
graphs give the same bits.

    PYTHONPATH=. python3 tools/h200_pdl_probe.py --json $OUT/pdl.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import formats
import triton
import kernels_triton as kt
from dispatch.registry import VARIANTS
from h200_decode_probe import capture  # same folder

N = K = 8192
SETS = 5
ROUNDS = 3

# (variant, format, linear(x, w)) for every variant of the registry
LINEARS = [(v.name, v.fmt, (lambda x, w: kt.linear(x, w, a16=True)) if v.a16 else kt.linear)
           for v in VARIANTS.values()]


def replay_us(g, n_calls, reps=200):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n_calls)
    return statistics.median(ts)


def warm(name):
    """Compile one linear's kernels (both modes, both M) into Triton's on-disk cache, in a worker
    process: seven formats compile in parallel instead of one after another."""
    fmt, linear = next((f, fn) for n, f, fn in LINEARS if n == name)
    try:
        w = formats.quantize(torch.randn(N, K, device="cuda") * 0.05, fmt, role="weight")
        for M in (16, 1):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            for mode in ("0", "1"):
                os.environ["B12X_PDL"] = mode
                linear(x, w)
        torch.cuda.synchronize()
    except Exception as e:  # the timing loop reports it again, per row
        return f"{name}: {type(e).__name__}: {str(e)[:200]}"
    return name


_WEIGHTS = {}


def weights(fmt, w0):
    if fmt not in _WEIGHTS:
        _WEIGHTS[fmt] = [formats.quantize(w0 * (1 + 0.01 * i), fmt, role="weight") for i in range(SETS)]
    return _WEIGHTS[fmt]


def row(name, fmt, linear, M, w0, gen):
    ws = weights(fmt, w0)
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    fns = [lambda w=w: linear(x, w) for w in ws]
    graphs = {}
    for mode in ("0", "1"):
        os.environ["B12X_PDL"] = mode
        graphs[mode] = capture(fns)
    same = all(torch.equal(a, b) for a, b in zip(graphs["0"][1], graphs["1"][1]))
    times = {"0": [], "1": []}
    for _ in range(ROUNDS):
        for mode in ("0", "1"):
            times[mode].append(replay_us(graphs[mode][0], len(fns)))
    off, on = statistics.median(times["0"]), statistics.median(times["1"])
    r = {"fmt": name, "M": M, "off_us": off, "on_us": on, "gain_us": off - on,
         "spread_off_us": max(times["0"]) - min(times["0"]), "spread_on_us": max(times["1"]) - min(times["1"]),
         "rounds_off": times["0"], "rounds_on": times["1"], "bit_identical": same}
    del graphs
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--budget-s", type=float, default=150)
    p.add_argument("--phase", choices=("all", "compile", "time"), default="all",
                   help="compile: fill Triton's cache in parallel and stop; time: skip that step")
    args = p.parse_args()
    t0 = time.time()
    from triton.backends.nvidia.compiler import CUDAOptions
    import triton.language.extra.cuda as tlc

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
           "capability": torch.cuda.get_device_capability(), "gdc_wait": hasattr(tlc, "gdc_wait"),
           "gdc_launch_dependents": hasattr(tlc, "gdc_launch_dependents"),
           "launch_pdl_option": "launch_pdl" in CUDAOptions.__dataclass_fields__}
    print(env, flush=True)
    if args.phase != "time":
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(len(LINEARS)) as pool:
            for r in pool.imap_unordered(warm, [n for n, _, _ in LINEARS]):
                print(f"compiled {r} ({time.time() - t0:.0f} s)", flush=True)
        if args.phase == "compile":
            return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    w0 = torch.randn(N, K, generator=gen, device="cuda") * 0.05
    rows = []
    for M in (16, 1):
        for name, fmt, linear in LINEARS:
            if time.time() - t0 > args.budget_s:
                print(f"budget spent, skipping {name} M={M}", flush=True)
                continue
            try:
                rows.append(row(name, fmt, linear, M, w0, gen))
            except Exception as e:  # one failing format must not lose the others' rows
                rows.append({"fmt": name, "M": M, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    os.environ.pop("B12X_PDL", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    print("\n| linear | M | PDL off us | PDL on us | gain us | spread off/on | same bits |")
    for r in rows:
        if "error" in r:
            print(f"| {r['fmt']} | {r['M']} | {r['error'][:80]} |")
            continue
        print(f"| {r['fmt']} | {r['M']} | {r['off_us']:.1f} | {r['on_us']:.1f} | {r['gain_us']:+.1f} | "
              f"{r['spread_off_us']:.1f}/{r['spread_on_us']:.1f} | {r['bit_identical']} |")
    print(f"probe: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
