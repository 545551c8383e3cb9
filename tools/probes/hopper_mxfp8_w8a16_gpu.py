"""The hopper W8A16 path of mxfp8 (kernels_triton.hopper.mxfp8.linear(a16=True), the "mxfp8_w8a16"
variant) on an sm_90 GPU: checked against the float64 oracle, then timed beside the lesson
(kernels_triton.mxfp8 W8A16 through the registry's triton backend, with its tuned tiles) and torch's
bf16 F.linear (cuBLAS) in the same run. What the lead runs before flipping
dispatch.backends.MXFP8_W8A16_GPU_RAN.

Shapes: N x K = 4096 x 4096 and 14336 x 4096, M in (1, 16, 128, 4096), a bias. Check: bf16 and fp16
x, y against formats.reference_linear(x, w, bias, a16=True) computed in float64 on the GPU, element by
element within the bound of tests/conftest.gemm_bound (exact products, K 2^-24 sum |x||w| for the
fp32 sums, 6 fp32 roundings of the epilogue, one rounding of each side to the output dtype), and the
kernels launched equal route(...).kernels. Timing: bf16 x, each linear captured in a CUDA graph and
replayed under triton.testing.do_bench (median, L2 flushed between calls), µs. Under 2 minutes on
an H200; ``--budget-s`` stops timing early (the rows left are marked "-").

    PYTHONPATH=. python3 tools/probes/hopper_mxfp8_w8a16_gpu.py [--json $OUT/mxfp8_w8a16.json] [--budget-s 100]

Exit status 1 when a check fails (after the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = ((4096, 4096), (14336, 4096))
MS = (1, 16, 128, 4096)
OUT_P = {"bfloat16": 8, "float16": 11}


def _bound(x, qw, bias, ref):
    """tests/conftest.gemm_bound, on the GPU in float64 (the CPU would take minutes at these sizes)."""
    import torch  # noqa: PLC0415

    import formats  # noqa: PLC0415

    a = x.double().abs()
    b = formats.dequantize(qw, torch.float64).abs()
    r = ref.double().abs()
    spacing = 2.0 ** (1 - OUT_P[str(ref.dtype).removeprefix("torch.")])
    tiny = torch.finfo(ref.dtype).smallest_normal * spacing
    return qw.k * 2.0 ** -24 * (a @ b.T) + 6 * 2.0 ** -24 * (r + bias.double().abs()[None, :]) + spacing * r + tiny


def _check(H, x, qw, bias) -> dict:
    """y of hopper's linear(a16=True) against the oracle: the worst |y - ref| / bound (<= 1 passes),
    the launches against the route."""
    import torch  # noqa: PLC0415

    import formats  # noqa: PLC0415
    from kernels_triton import record_launches  # noqa: PLC0415
    from kernels_triton.hopper._route import sm_count  # noqa: PLC0415

    M, K = x.shape
    N = qw.shape[0]
    r = H.route(M, N, K, capability=tuple(torch.cuda.get_device_capability()), sm_count=sm_count(x.device),
                a16=True, x_dtype=x.dtype)
    with record_launches() as log:
        y = H.linear(x, qw, bias, a16=True)
    torch.cuda.synchronize()
    ref = formats.reference_linear(x, qw, bias, a16=True)
    ratio = ((y.double() - ref.double()).abs() / _bound(x, qw, bias, ref)).max().item()
    ok = bool(torch.isfinite(y).all()) and ratio <= 1.0 and log == list(r.kernels)
    return {"route": " -> ".join(r.kernels), "tile": r.tile, "err_over_bound": ratio,
            "launches_match": log == list(r.kernels), "ok": ok}


def _time_us(fn) -> float:
    """Median µs of fn replayed from a CUDA graph, L2 flushed between calls (do_bench)."""
    import torch  # noqa: PLC0415
    import triton.testing  # noqa: PLC0415

    fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return 1e3 * triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--budget-s", type=float, default=100.0, help="stop timing after this many seconds")
    args = p.parse_args()
    t0 = time.time()

    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    import formats  # noqa: PLC0415
    from kernels_triton import hopper  # noqa: PLC0415
    from dispatch import registry  # noqa: PLC0415

    if not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != (9, 0):
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        print(f"needs an sm_90 GPU (the hopper kernels); found {found}", file=sys.stderr)
        return 2
    H = hopper.module("mxfp8")
    lesson = registry.get("triton", "mxfp8_w8a16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for N, K in SHAPES:
        w = torch.randn(N, K, device="cuda", generator=gen) * 0.05
        qw = formats.quantize(w, "mxfp8")
        w_bf16 = formats.dequantize(qw, torch.bfloat16)  # the same weight for cuBLAS (exact in bf16)
        bias = torch.randn(N, device="cuda", generator=gen)
        for M in MS:
            row = {"N": N, "K": K, "M": M}
            for dt in (torch.bfloat16, torch.float16):
                x = torch.randn(M, K, device="cuda", generator=gen).to(dt)
                row[f"check_{str(dt).removeprefix('torch.')}"] = _check(H, x, qw, bias)
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            if time.time() - t0 < args.budget_s:
                prepared = lesson.prepare(qw)
                row["hopper_us"] = _time_us(lambda: H.linear(x, qw, bias, a16=True))
                row["triton_us"] = _time_us(lambda: lesson.run(x, prepared, bias))
                row["torch_bf16_us"] = _time_us(lambda: F.linear(x, w_bf16, bias.to(torch.bfloat16)))
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"  # noqa: E731
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {__import__('triton').__version__}, "
          f"{time.time() - t0:.0f} s; µs, CUDA graph replay, L2 flushed; err = max |y - ref| / bound")
    print(f"{'N x K':>12} {'M':>5} | {'err bf16':>8} {'err fp16':>8} | {'hopper':>8} {'triton':>8} {'bf16':>8} "
          f"{'vs bf16':>7} | hopper route (bf16)")
    failed = False
    for r in rows:
        cb, cf = r["check_bfloat16"], r["check_float16"]
        failed |= not (cb["ok"] and cf["ok"])
        h, t = r.get("hopper_us"), r.get("torch_bf16_us")
        speed = f"{t / h:.2f}x" if h and t else "-"
        mark = "" if cb["ok"] and cf["ok"] else "  FAILED"
        print(f"{r['N']:>6}x{r['K']:<5} {r['M']:>5} | {cb['err_over_bound']:>8.3f} {cf['err_over_bound']:>8.3f} | "
              f"{fmt(h):>8} {fmt(r.get('triton_us')):>8} {fmt(t):>8} {speed:>7} | {cb['route']}{mark}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
