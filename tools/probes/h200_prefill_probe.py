"""Issue 13 prefill probe: the TMA prefill kernel (_fp8_prefill) of fp8_tensor and fp8_block against
their current route (the lesson kernels' pointer loads) and torch._scaled_mm, on an sm_90 GPU.

GEMM alone on operands quantized beforehand (formats.quantize), N = K = 8192, bf16 output, no bias;
M = 4096 (then 8192 while the budget lasts). do_bench medians with the L2 flushed between calls (its
default), every variant compiled and checked first (max |diff| / max |before|, against the
"before" row: the route gemm took before this kernel), then timed. ``--wait-pid`` holds the timing
until that process ends, or three quarters of ``--budget-s`` have passed (a test run sharing the
GPU during the compile phase).

``--compile`` (no GPU needed): builds the shipped prefill tiles for sm_90 and reports, per tile,
the TMA copies in the PTX, shared memory, and registers / stack / local memory from the cubin's
resource usage (Triton's cuobjdump); tests/kernels_triton/hopper/test_fp8_prefill.py checks them.

    PYTHONPATH=. python3 tools/probes/h200_prefill_probe.py --json $OUT/prefill.json [--budget-s 70]
    TRITON_INTERPRET=0 PYTHONPATH=. python3 tools/probes/h200_prefill_probe.py --compile --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time

N = K = 8192


def _resource_usage(cubin: bytes) -> dict:
    import triton  # noqa: PLC0415

    cob = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cob, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    get = lambda key: int(re.search(rf"{key}:(\d+)", out).group(1))  # noqa: E731
    return {"registers": get("REG"), "stack_bytes": get("STACK"), "local_bytes": get("LOCAL")}


def compile_rows() -> list[dict]:
    """The shipped tiles built for sm_90 (module docstring)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from kernels_triton.hopper import _fp8_prefill as P  # noqa: PLC0415

    rows = []
    for fmt, scale_k, cfg in (("fp8_tensor", 0, P.TENSOR_PREFILL_TILE), ("fp8_block", 128, P.BLOCK_PREFILL_TILE)):
        sig = {"x_desc": f"tensordesc<fp8e4nv[{cfg.BLOCK_M}, {cfg.BLOCK_K}]>",
               "w_desc": f"tensordesc<fp8e4nv[{cfg.BLOCK_N}, {cfg.BLOCK_K}]>",
               "sx_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16",
               **{n: "i32" for n in "M N K stride_ym stride_sxm stride_sxk stride_swn stride_swk".split()}}
        ce = dict(HAS_BIAS=True, SCALE_K=scale_k, IMPRECISE_ACC=128, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                  BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, DOT_FP8=True, ROUND_BF16=False,
                  CHANNEL=False)
        sig.update({k: "constexpr" for k in ce})
        k = triton.compile(ASTSource(fn=P.fp8_prefill_kernel, signature=sig, constexprs=ce),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        rows.append({"tile": f"{fmt} {cfg}", "tma_copies": k.asm["ptx"].count("cp.async.bulk.tensor"),
                     "shared_bytes": k.metadata.shared, **_resource_usage(k.asm["cubin"])})
    return rows


def timing_rows(budget_s: float, wait_pid: int | None, ms: list[int]) -> list[dict]:
    import torch  # noqa: PLC0415

    import formats  # noqa: PLC0415
    from kernels_triton import hopper  # noqa: PLC0415 (before triton: it sets the interpreter)
    from kernels_triton._common import TileConfig as T  # noqa: PLC0415
    from kernels_triton.hopper._fp8_prefill import launch_fp8_prefill  # noqa: PLC0415
    import triton.testing  # noqa: PLC0415

    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w0 = torch.randn(N, K, generator=gen, device="cuda") * 0.05
    jobs = []  # (fmt, M, name, fn, ref_index)
    for M in ms:
        x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
        for fmt in ("fp8_tensor", "fp8_block"):
            w = formats.quantize(w0, fmt, role="weight")
            xq = formats.quantize(x, fmt, role="activation")
            out = lambda M=M: torch.empty(M, N, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            sk = 128 if fmt == "fp8_block" else 0
            mod = hopper.module(fmt)
            before = T(128, 128, 128, 8, 8, 3 if sk else 4)
            rows = [(f"before: pointer {before}", lambda xq=xq, w=w, c=before, mod=mod, out=out:
                     mod._run_gemm("portable", c, xq, w, None, out()))]
            descs = ([T(64, 128, 128, 8, 4, 3), T(64, 128, 128, 8, 4, 4), T(128, 128, 128, 8, 4, 3),
                      T(128, 128, 128, 8, 8, 3)] if sk else
                     [T(128, 128, 128, 8, 4, 3), T(128, 128, 128, 8, 4, 4), T(128, 128, 128, 8, 8, 3)])
            for c in descs:
                rows.append((f"TMA {c}", lambda xq=xq, w=w, c=c, sk=sk, out=out: launch_fp8_prefill(
                    xq.data, w.data, xq.scale, w.scale, None, out(), scale_k=sk, config=c)))
            if sk:
                for c in (T(64, 128, 128, 8, 4, 3), T(64, 128, 128, 8, 4, 4)):
                    rows.append((f"pointer {c}", lambda xq=xq, w=w, c=c, out=out:
                                 mod._run_gemm("portable", c, xq, w, None, out())))
            rows.append((f"gemm (ships: {mod.tile_config(M, N, K)})",
                         lambda xq=xq, w=w, mod=mod: mod.gemm(xq, w, None, torch.bfloat16)))
            if sk:  # cuBLAS blockwise wants the activation scales outer-dim-major, as the bench
                sa = xq.scale.t().contiguous().t()
                rows.append(("torch._scaled_mm blockwise", lambda xq=xq, w=w, sa=sa: torch._scaled_mm(
                    xq.data, w.data.t(), sa, w.scale.t(), out_dtype=torch.bfloat16, use_fast_accum=False)))
            else:
                rows.append(("torch._scaled_mm per-tensor", lambda xq=xq, w=w: torch._scaled_mm(
                    xq.data, w.data.t(), xq.scale.float(), w.scale.float(), out_dtype=torch.bfloat16,
                    use_fast_accum=False)))
            jobs.append((fmt, M, rows))

    results, ready = [], []
    for fmt, M, rows in jobs:  # compile and check everything first
        ref = None
        for name, fn in rows:
            r = {"fmt": fmt, "M": M, "variant": name}
            try:
                y = fn()
                torch.cuda.synchronize()
                ref = y if ref is None else ref
                r["rel_vs_before"] = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                ready.append((r, fn))
            except Exception as e:  # noqa: BLE001 - a row says why
                r["error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
            results.append(r)
            print(r, flush=True)
    while wait_pid and time.time() - t0 < 0.75 * budget_s:  # the rest of the budget is for timing
        try:
            os.kill(wait_pid, 0)
        except OSError:
            break
        time.sleep(0.5)
    print(f"timing from {time.time() - t0:.0f} s", flush=True)
    for r, fn in ready:
        if time.time() - t0 > budget_s:
            r["error"] = "probe budget spent"
            continue
        r["us"] = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
        r["tflops"] = 2 * r["M"] * N * K / r["us"] * 1e-6
        print(r, flush=True)
        del fn
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--compile", action="store_true", help="build the shipped tiles for sm_90 only (no GPU)")
    p.add_argument("--budget-s", type=float, default=70)
    p.add_argument("--wait-pid", type=int, default=None)
    p.add_argument("--m", default="4096,8192")
    args = p.parse_args()
    if args.compile:
        rows = compile_rows()
        for r in rows:
            print(r)
    else:
        rows = timing_rows(args.budget_s, args.wait_pid, [int(m) for m in args.m.split(",")])
        print("\n| fmt | M | variant | us | TF/s | max diff / max before |")
        for r in rows:
            print(f"| {r['fmt']} | {r['M']} | {r['variant']} | {r.get('us', float('nan')):.1f} | "
                  f"{r.get('tflops', float('nan')):.0f} | {r.get('rel_vs_before', float('nan')):.1e} | "
                  f"{r.get('error', '')[:60]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
