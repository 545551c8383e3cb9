"""Serve one quantized model twice on an SM120/SM121 GPU and compare: the b12x-dual plugin vs
vLLM's in-tree B12X backend, same prompts, greedy decoding.

    python tools/vllm_serve_compare.py <model dir or HF id> [--max-tokens 64] [--concurrency 16]

Both runs use ``vllm serve <model> --linear-backend b12x``; the plugin run allow-lists our entry
point (VLLM_PLUGINS=b12x_dual), the in-tree run loads no plugin (VLLM_PLUGINS=none). Prints each
prompt's two completions, how many match exactly, and tokens/s (completion tokens over the wall
time of all prompts sent concurrently). Exits 0 with a message naming the device when it is not
SM120/SM121 (nothing to compare there).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "The capital of France is",
    "Write a haiku about a GPU:",
    "def fibonacci(n):",
    "Explain block-scaled FP4 quantization in one sentence:",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
    "A quick brown fox",
    "Translate to German: Good morning, how are you?",
]


def device() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    cap = torch.cuda.get_device_capability()
    name = f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})"
    return cap in ((12, 0), (12, 1)), name


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _wait(port: int, proc: subprocess.Popen, timeout: float = 1800) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            time.sleep(5)
    raise TimeoutError("vllm serve did not come up")


def run(model: str, plugins: str, port: int, max_tokens: int, concurrency: int, log) -> dict:
    env = {**os.environ, "VLLM_PLUGINS": plugins}
    cmd = ["vllm", "serve", model, "--linear-backend", "b12x", "--port", str(port), "--seed", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(port, proc)
        body = lambda p: {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0}  # noqa: E731
        _post(port, body(PROMPTS[0]))  # first request outside the timing
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
            outs = list(ex.map(lambda p: _post(port, body(p)), PROMPTS))
        dt = time.perf_counter() - t0
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        return {"texts": [o["choices"][0]["text"] for o in outs], "tokens": tokens, "tok_per_s": tokens / dt}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--log", default="vllm_serve_compare.log", help="both servers' output")
    args = ap.parse_args(argv)
    ok, name = device()
    if not ok:
        print(f"skipped: needs an SM120/SM121 GPU (RTX PRO 6000, RTX 5090, DGX Spark); found {name}")
        return 0
    with open(args.log, "w") as log:
        ours = run(args.model, "b12x_dual", args.port, args.max_tokens, args.concurrency, log)
        theirs = run(args.model, "none", args.port, args.max_tokens, args.concurrency, log)
    same = sum(a == b for a, b in zip(ours["texts"], theirs["texts"]))
    for p, a, b in zip(PROMPTS, ours["texts"], theirs["texts"]):
        print(f"--- {p!r}\n  b12x-dual: {a!r}\n  in-tree:   {b!r}")
    print(f"\ndevice: {name}\nexact matches: {same}/{len(PROMPTS)}")
    print(f"tokens/s  b12x-dual {ours['tok_per_s']:.1f}  in-tree B12X {theirs['tok_per_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
