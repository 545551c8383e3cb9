"""Where a call's time goes on a GPU: each kernel's device time (torch.profiler) against the host's
wall time per call, eager and replayed from a CUDA graph, for one hopper format module's ``linear``.

A large gap between "eager wall" and "graph replay" with small kernel times means host overhead
(Python, launches, allocation); kernel times near the wall mean the kernels themselves are slow.

    PYTHONPATH=. python3 tools/probes/launch_profile.py --format fp8_channel --shapes 4096x4096,6144x4096 \
        --m 128,4096 [--json out.json]

Prints one table last: shape, M, eager wall (us per call, host timer around 50 calls with a
synchronize), graph replay (us per call), and the profiler's per-kernel mean device time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections import defaultdict

import torch


def _weight(fmt: str, N: int, K: int, seed: int):
    import formats  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    return formats.quantize(w, fmt, role="weight").to("cuda")


def profile_one(mod, qw, M: int, K: int, reps: int = 50) -> dict:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        mod.linear(x, qw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        mod.linear(x, qw)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / reps * 1e6
    graph_us = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mod.linear(x, qw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mod.linear(x, qw)
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        graph_us = (time.perf_counter() - t0) / reps * 1e6
    except Exception as e:  # noqa: BLE001  (a route that cannot be captured is a finding, not a crash)
        graph_us = f"{type(e).__name__}: {str(e)[:80]}"
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            mod.linear(x, qw)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            kernels[ev.name[:48]].append(ev.device_time if hasattr(ev, "device_time") else ev.cuda_time)
    kt = {k: sum(v) / 10 for k, v in kernels.items()}
    return {"eager_us": eager, "graph_us": graph_us, "kernels_us": kt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="fp8_channel")
    p.add_argument("--shapes", default="4096x4096,6144x4096", help="NxK,...")
    p.add_argument("--m", default="128,4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--cprofile", type=int, default=0, help="print the top N host functions (cProfile, 50 calls)")
    a = p.parse_args()
    mod = importlib.import_module(f"kernels_triton.hopper.{a.format}")
    rows = []
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        qw = _weight(a.format, N, K, a.seed)
        for M in (int(v) for v in a.m.split(",")):
            r = profile_one(mod, qw, M, K)
            r.update(shape=shape, M=M, route=mod.route(M, N, K, capability=(9, 0),
                                                       sm_count=torch.cuda.get_device_properties(0).multi_processor_count).why)
            rows.append(r)
    if a.cprofile:
        import cProfile  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        N, K = (int(v) for v in a.shapes.split(",")[0].split("x"))
        qw = _weight(a.format, N, K, a.seed)
        x = torch.randn(int(a.m.split(",")[0]), K, device="cuda", dtype=torch.bfloat16)
        mod.linear(x, qw)
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            mod.linear(x, qw)
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(a.cprofile)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print(f"{'shape':<12} {'M':>5} {'eager us':>9} {'graph us':>9}  kernels (mean device us per call)")
    for r in rows:
        g = r["graph_us"]
        gs = f"{g:9.1f}" if isinstance(g, float) else str(g)[:40]
        ks = ", ".join(f"{k}={v:.1f}" for k, v in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1]))
        print(f"{r['shape']:<12} {r['M']:>5} {r['eager_us']:9.1f} {gs}  {ks}")


if __name__ == "__main__":
    main()
