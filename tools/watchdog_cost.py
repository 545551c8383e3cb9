"""The numerics watchdog's cost per checked call (B12X_CHECK, dispatch.check), on this machine.

For each variant and shape: a QuantLinear served by ``--impl`` (default: what auto picks here) is
timed with the watchdog off (B12X_CHECK unset) and with every call checked (B12X_CHECK=1); the
difference is the cost of one checked call (the implementation's quantizer run again, the copies to
the host, the float64 oracle and the bound on the CPU). With a sampling rate p the average added
cost per call is p times that. Off, the hook is one module-attribute test (measured as ``off``
against the same call without the hook is below the timer's resolution; not separated here).

    python tools/watchdog_cost.py                                   # CPU: small shapes
    python tools/watchdog_cost.py --shapes 16x4096x4096,128x4096x4096 --json out/watchdog_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dispatch  # noqa: E402  (TRITON_INTERPRET before triton)
import torch  # noqa: E402

from dispatch import QuantLinear, check  # noqa: E402


def _time(fn, reps: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def measure(variant: str, M: int, N: int, K: int, impl, device: str, reps: int) -> dict:
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, dtype=torch.float32)
    q = QuantLinear.from_linear(lin, variant, impl=impl).to(device)
    q.b12x_name = f"{variant}_{M}x{N}x{K}"
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    os.environ.pop(check.ENV_CHECK, None)
    check.reload()
    off = _time(lambda: q(x), reps, sync)
    os.environ[check.ENV_CHECK] = "1"
    os.environ.setdefault(check.ENV_DIR, "/tmp/b12x_watchdog_cost")
    wd = check.reload()
    on = _time(lambda: q(x), reps, sync)
    ok = not wd.diverged
    os.environ.pop(check.ENV_CHECK, None)
    check.reload()
    return {"variant": variant, "M": M, "N": N, "K": K, "impl": q.last_impl, "device": device,
            "off_ms": off * 1e3, "checked_ms": on * 1e3, "cost_per_checked_call_ms": (on - off) * 1e3,
            "within_bound": ok, "reps": reps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="nvfp4,fp8_block,mxfp8,mxfp4_w4a16")
    p.add_argument("--shapes", default=None, help="MxNxK,... (default: 4x256x256,16x1024x1024 on the CPU, "
                   "16x4096x4096,128x4096x4096 on a GPU)")
    p.add_argument("--impl", default=None, help="pin the implementation (default: auto)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    shapes = a.shapes or ("16x4096x4096,128x4096x4096" if gpu else "4x256x256,16x1024x1024")
    reps = a.reps or (20 if gpu else 3)
    rows = []
    for v in a.variants.split(","):
        for s in shapes.split(","):
            M, N, K = (int(t) for t in s.split("x"))
            r = measure(v, M, N, K, a.impl, device, reps)
            rows.append(r)
            print(f"{v:12s} {M}x{N}x{K:<6d} {r['impl']:9s} off {r['off_ms']:9.3f} ms  every call checked "
                  f"{r['checked_ms']:9.3f} ms  cost per checked call {r['cost_per_checked_call_ms']:9.3f} ms  "
                  f"{'within bound' if r['within_bound'] else 'DIVERGED'}", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        dev = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
        Path(a.json).write_text(json.dumps({"device": dev, "versions": dispatch.library_versions(), "rows": rows},
                                           indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
