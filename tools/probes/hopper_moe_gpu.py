"""The sm_90 MoE (kernels_triton/hopper/moe.py) on an H100/H200, before its gate is switched on: the
lead runs this once on the GPU, then sets dispatch.moe.HOPPER_MOE_GPU_RAN = True if it passes.

    python tools/probes/hopper_moe_gpu.py [--ms 1,4,16,64,512] [--bench-ms 1,4,16,128,1024] [--no-bench]
                                          [--sweep 1,16] [--profile 16]

(a) correctness: each served variant (mxfp4_w4a16 and mxfp4 at gpt-oss-20b's layer: E 32, top-4,
    H = I = 2880, SwiGLU with expert biases; nvfp4 and nvfp4_w4a16 at Qwen3-30B-A3B's: E 128, top-8,
    H 2048, I 768, silu), M in --ms, kernels_triton.hopper.moe.fused_moe against formats.reference_moe
    (float64): norm_rel (<= 1e-2, the MoE sweep's tolerance), the
    launched kernels against route() (record_launches), and the route taken (decode / prefill).
    The element-wise bound is tests/kernels_triton/hopper/test_hopper_moe.py's (run it too).
(b) speed: dispatch.apps.bench_moe at the two layers (their own variants), hopper vs triton vs the
    bf16 baseline torch_bf16_moe, with --check, through the MoE table: this process sets
    B12X_HOPPER_MOE_UNVERIFIED=1 (dispatch.moe.HOPPER_UNVERIFIED_ENV) before the table is built, the
    one purpose of that variable. The same from the shell:

        B12X_HOPPER_MOE_UNVERIFIED=1 python -m dispatch.apps.bench --shapes moe --impls hopper,triton \\
            --m 1,4,16,128,1024 --check

(c) --sweep M,..: the decode route's tiles around the default (BLOCK_N, split-K, warps, stages,
    BLOCK_K; weight-only: DECODE_A16_PLANES toggled; W4A4: DECODE_A4_PREPASS toggled), each checked
    against the oracle, then timed (off by default: each config compiles).
(d) --profile M,..: each kernel's own device time (torch.profiler, eager launches, so no overlap
    between kernels), per layer and M, for both settings of the decode route's switches.

The short tables come last. About 2-3 minutes on an H200 without --sweep (the first calls compile).
Exit status 1 if a check failed or a launch differed from its route.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ["B12X_HOPPER_MOE_UNVERIFIED"] = "1"  # before dispatch.moe builds its table
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import formats  # noqa: E402

LAYERS = [  # (layer, variant, E, top_k, H, I, activation, biases)
    ("gpt-oss-20b:moe", "mxfp4_w4a16", 32, 4, 2880, 2880, "swigluoai", True),
    ("gpt-oss-20b:moe", "mxfp4", 32, 4, 2880, 2880, "swigluoai", True),
    ("qwen3-30b-a3b:moe", "nvfp4", 128, 8, 2048, 768, "silu", False),
    ("qwen3-30b-a3b:moe", "nvfp4_w4a16", 128, 8, 2048, 768, "silu", False),
]
TOL = 1e-2


def _norm_rel(y, ref) -> float:
    y = y.double()
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return float((y - ref).norm() / ref.norm())


def check(ms: list[int], device="cuda", layers=LAYERS) -> tuple[list[list], bool]:
    """(a): a row per (layer, variant, M) and whether all passed. ``device``/``layers``: other ones for a
    dry run (the CPU under TRITON_INTERPRET=1 with tiny layers)."""
    from kernels_triton import moe as lesson
    from kernels_triton import record_launches
    from kernels_triton._common import device_capability
    from kernels_triton.hopper import moe as hmoe
    from kernels_triton.hopper._route import sm_count

    dev = torch.device(device)
    cap = device_capability(dev)
    rows, ok_all = [], True
    experts = {}
    for layer, variant, E, k, H, I, act, bias in layers:
        fmt, a16 = variant.split("_")[0], variant.endswith("_w4a16")
        g = torch.Generator(device=dev).manual_seed(1234)
        if (layer, fmt) not in experts:
            w13 = [formats.quantize(torch.randn(2 * I, H, generator=g, device=dev) / math.sqrt(H), fmt)
                   for _ in range(E)]
            w2 = [formats.quantize(torch.randn(H, I, generator=g, device=dev) / math.sqrt(I), fmt) for _ in range(E)]
            experts[(layer, fmt)] = (w13, w2, lesson.prepare_experts(w13, w2))
        w13, w2, p = experts[(layer, fmt)]
        kw = dict(activation=act)
        if bias:
            kw.update(w13_bias=torch.randn(E, 2 * I, generator=g, device=dev),
                      w2_bias=torch.randn(E, H, generator=g, device=dev).bfloat16())
        for M in ms:
            x = torch.randn(M, H, generator=g, device=dev).bfloat16()
            ids = torch.rand(M, E, generator=g, device=dev).argsort(dim=1)[:, :k].to(torch.int32)
            wt = torch.rand(M, k, generator=g, device=dev) + 0.05
            r = hmoe.route(M, E, k, H, I, fmt=fmt, a16=a16, capability=cap, sm_count=sm_count(dev) if cap else 132)
            try:
                with record_launches() as log:
                    y = hmoe.fused_moe(x, p, ids, wt, a16=a16, **kw)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                err = None
            except Exception as e:  # noqa: BLE001  (a row says what failed)
                y, log, err = None, [], f"{type(e).__name__}: {str(e)[:200]}"
            ref = formats.reference_moe(x, w13, w2, ids, wt, a16=a16, out_dtype=torch.float64, **kw)
            nr = float("inf") if y is None else _norm_rel(y, ref)
            same = tuple(log) == r.kernels
            ok = err is None and nr <= TOL and same
            ok_all &= ok
            route = "decode" if "_decode_gemm_kernel" in r.kernels else "prefill"
            rows.append([layer, variant, M, route, f"{nr:.2e}",
                         "yes" if same else f"NO: {list(log)}", "ok" if ok else (err or "FAIL")])
            print(" ".join(str(c) for c in rows[-1]), flush=True)
    return rows, ok_all


def bench(ms: list[int], budget_s: float):
    from dispatch.apps import bench_moe

    shapes = [s for s in bench_moe.MOE_SHAPES if s.default]
    return bench_moe.run_moe_bench(shapes, ms=ms, impls=["triton", "hopper"], check=True, progress=False,
                                   budget_s=budget_s)


def _layer(fmt: str, E: int, H: int, I: int, act: str, bias: bool, seed: int):
    """Random experts of one benchmark layer on the GPU: (the generator, w13, w2, the prepared experts,
    fused_moe's keyword arguments: the activation and the layer's biases)."""
    from kernels_triton import moe as lesson

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = [formats.quantize(torch.randn(2 * I, H, generator=g, device=dev) / math.sqrt(H), fmt) for _ in range(E)]
    w2 = [formats.quantize(torch.randn(H, I, generator=g, device=dev) / math.sqrt(I), fmt) for _ in range(E)]
    kw = dict(activation=act)
    if bias:
        kw.update(w13_bias=torch.randn(E, 2 * I, generator=g, device=dev),
                  w2_bias=torch.randn(E, H, generator=g, device=dev).bfloat16())
    return g, w13, w2, lesson.prepare_experts(w13, w2), kw


def sweep(ms: list[int]) -> list[list]:
    """--sweep: the decode route's tiles around the default, per benchmark layer (its own variant) and M,
    timed with bench's Timer (CUDA graphs, 4 routings rotated); every timed config is first checked
    against the oracle (norm_rel <= 1e-2). Each config compiles its kernels once (seconds each)."""
    import dataclasses

    from dispatch.apps.bench_run import Timer
    from kernels_triton.hopper import moe as hmoe
    from kernels_triton.hopper._route import sm_count

    dev = torch.device("cuda")
    timer = Timer(gpu=True, warmup_ms=10, rep_ms=40, graph_max_m=64)
    rows = []
    for layer, variant, E, k, H, I, act, bias in (LAYERS[0], LAYERS[2]):
        fmt, a16 = variant.split("_")[0], variant.endswith("_w4a16")
        g, w13, w2, p, kw = _layer(fmt, E, H, I, act, bias, seed=99)
        for M in ms:
            sets = [(torch.randn(M, H, generator=g, device=dev).bfloat16(),
                     torch.rand(M, E, generator=g, device=dev).argsort(dim=1)[:, :k].to(torch.int32),
                     torch.rand(M, k, generator=g, device=dev) + 0.05) for _ in range(4)]
            d13, d2 = hmoe.decode_tiles(M, E, k, H, I, fmt, (9, 0), sm_count(dev))
            configs = {"default": (d13, d2)}
            for bn13, bn2 in ((32, 64), (128, 128), (64, 64), (64, 256)):
                configs[f"bn {bn13}/{bn2}"] = (dataclasses.replace(d13, BLOCK_N=bn13),
                                               dataclasses.replace(d2, BLOCK_N=bn2))
            for f in (2, 4):
                configs[f"split x{f}"] = (dataclasses.replace(d13, SPLIT_K=d13.SPLIT_K * f),
                                          dataclasses.replace(d2, SPLIT_K=d2.SPLIT_K * f))
            configs["split 1"] = (dataclasses.replace(d13, SPLIT_K=1), dataclasses.replace(d2, SPLIT_K=1))
            configs["warps 8"] = (dataclasses.replace(d13, num_warps=8), dataclasses.replace(d2, num_warps=8))
            configs["stages 2"] = (dataclasses.replace(d13, num_stages=2), dataclasses.replace(d2, num_stages=2))
            configs["bk 256"] = (dataclasses.replace(d13, BLOCK_K=256), dataclasses.replace(d2, BLOCK_K=256))
            if a16:
                configs["a16 planes toggled"] = (d13, d2)  # DECODE_A16_PLANES flipped
            else:
                configs["a4 prepass toggled"] = (d13, d2)  # DECODE_A4_PREPASS flipped
            configs["bk 256, bn 128/256"] = (dataclasses.replace(d13, BLOCK_K=256, BLOCK_N=128),
                                             dataclasses.replace(d2, BLOCK_K=256, BLOCK_N=256))
            ref = formats.reference_moe(*sets[0][:1], w13, w2, *sets[0][1:], a16=a16, out_dtype=torch.float64, **kw)
            planes, prepass = hmoe.DECODE_A16_PLANES, hmoe.DECODE_A4_PREPASS
            for name, tiles in configs.items():
                hmoe.DECODE_A16_PLANES = planes != (name == "a16 planes toggled")
                hmoe.DECODE_A4_PREPASS = prepass != (name == "a4 prepass toggled")
                try:
                    nr = _norm_rel(hmoe.fused_moe(*sets[0][:1], p, *sets[0][1:], a16=a16, tiles=tiles, **kw), ref)
                    t = timer([lambda s=s: hmoe.fused_moe_unchecked(s[0], p, s[1], s[2], a16=a16, tiles=tiles, **kw)
                               for s in sets], M)
                    rows.append([layer, variant, M, name, f"W13 {tiles[0]} / W2 {tiles[1]}", f"{t['us']:.1f}",
                                 f"{nr:.1e}" + ("" if nr <= TOL else " FAIL")])
                except Exception as e:  # noqa: BLE001
                    rows.append([layer, variant, M, name, "", "-", f"{type(e).__name__}: {str(e)[:80]}"])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
            hmoe.DECODE_A16_PLANES, hmoe.DECODE_A4_PREPASS = planes, prepass
    return rows


def profile(ms: list[int], iters: int = 20) -> list[list]:
    """--profile: per (layer, M, setting of the switch that applies: DECODE_A16_PLANES for weight-only,
    DECODE_A4_PREPASS for W4A4), each kernel's mean device time per call (torch.profiler's CUDA
    activity over ``iters`` eager calls) and their sum."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from kernels_triton.hopper import moe as hmoe

    dev = torch.device("cuda")
    rows = []
    for layer, variant, E, k, H, I, act, bias in (LAYERS[0], LAYERS[2]):
        fmt, a16 = variant.split("_")[0], variant.endswith("_w4a16")
        g, w13, w2, p, kw = _layer(fmt, E, H, I, act, bias, seed=7)
        switch = "DECODE_A16_PLANES" if a16 else "DECODE_A4_PREPASS"
        old = getattr(hmoe, switch)
        for M in ms:
            x = torch.randn(M, H, generator=g, device=dev).bfloat16()
            ids = torch.rand(M, E, generator=g, device=dev).argsort(dim=1)[:, :k].to(torch.int32)
            wt = torch.rand(M, k, generator=g, device=dev) + 0.05
            for on in (True, False):
                setattr(hmoe, switch, on)
                try:
                    hmoe.fused_moe_unchecked(x, p, ids, wt, a16=a16, **kw)
                    torch.cuda.synchronize()
                    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(iters):
                            hmoe.fused_moe_unchecked(x, p, ids, wt, a16=a16, **kw)
                        torch.cuda.synchronize()
                    total = 0.0
                    for ev in prof.key_averages():
                        us = getattr(ev, "device_time_total", None)
                        us = ev.cuda_time_total if us is None else us
                        if us <= 0 or ev.count < iters:
                            continue
                        per = us / iters
                        total += per
                        rows.append([layer, variant, M, f"{switch}={on}", ev.key[:40], ev.count // iters, f"{per:.1f}"])
                    rows.append([layer, variant, M, f"{switch}={on}", "SUM", "", f"{total:.1f}"])
                except Exception as e:  # noqa: BLE001
                    rows.append([layer, variant, M, f"{switch}={on}", "-", "", f"{type(e).__name__}: {str(e)[:80]}"])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
        setattr(hmoe, switch, old)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,64,512")
    ap.add_argument("--bench-ms", default="1,4,16,128,1024")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--sweep", default="", help="also time the decode route's tiles around the default at these M "
                    "(e.g. 1,16; ~2-4 min more: each config compiles)")
    ap.add_argument("--profile", default="", help="also each kernel's device time at these M (torch.profiler)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs an sm_90 GPU (H100/H200)")
        return 2
    t0 = time.time()
    rows, ok = check([int(m) for m in args.ms.split(",")])
    table = []
    if not args.no_bench:
        res = bench([int(m) for m in args.bench_ms.split(",")], max(30.0, 200.0 - (time.time() - t0)))
        by = {}
        for r in res["results"]:
            by.setdefault((r["shape"], r["M"]), {})[r["name"]] = r
        for (shape, M), d in by.items():
            base, tri, hop = (d.get(n, {}) for n in ("torch_bf16_moe", "triton", "hopper"))
            bu, tu, hu = (r.get("us") for r in (base, tri, hop))
            chk = hop.get("check") or {}
            ok &= bool(chk.get("ok")) and hu is not None  # an error or a skipped hopper row fails too
            table.append([shape, M, f"{bu:.1f}" if bu else "-", f"{tu:.1f}" if tu else "-",
                          f"{hu:.1f}" if hu else (hop.get("error") or hop.get("skipped") or "-")[:60],
                          f"{bu / hu:.2f}" if bu and hu else "-", f"{tu / hu:.2f}" if tu and hu else "-",
                          f"{chk.get('norm_rel', float('nan')):.1e} {'ok' if chk.get('ok') else 'FAIL'}" if chk
                          else "-"])
        for k, v in res["notes"].items():
            print(f"{k}: {v}")
        if res["skipped"]:
            print("bench skipped (budget):", res["skipped"])
    print(f"\n== hopper MoE on {torch.cuda.get_device_name()} ({time.time() - t0:.0f} s) ==")
    print("(a) vs formats.reference_moe: layer | variant | M | route | norm_rel | launches == route | ok")
    for r in rows:
        print(" | ".join(str(c) for c in r))
    if table:
        print("(b) us per layer call: layer | M | torch_bf16_moe | triton | hopper | hopper x vs bf16 | "
              "hopper x vs triton | hopper check")
        for r in table:
            print(" | ".join(str(c) for c in r))
    if args.profile:
        prows = profile([int(m) for m in args.profile.split(",")])
        print("(d) kernel device times: layer | variant | M | switch | kernel | launches per call | us per call")
        for r in prows:
            print(" | ".join(str(c) for c in r))
    if args.sweep:
        srows = sweep([int(m) for m in args.sweep.split(",")])
        print("(c) decode tiles: layer | variant | M | config | tiles | us | norm_rel")
        for r in srows:
            print(" | ".join(str(c) for c in r))
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
