"""Where the decode linear's time above the GEMM goes, one device call on the H200.

For each W8A8/W4A4 format at M = 1 and 16, N = K = 8192, bf16 x: the activation quantizer alone,
the GEMM alone on a quantized x, and the whole linear, each as CUDA-graph replays over 5 distinct
inputs/weights (tools/h200_decode_probe.graph_us), PDL on and off; for fp8_tensor, nvfp4, mxfp8 and
mxfp4 also other quantization tiles (BLOCK_M, BLOCK_K), passed as the lessons' quant_tile= in place of
their default, with a check that the codes stay the same.

    PYTHONPATH=. python3 tools/h200_quant_probe.py --json $OUT/quant.json [--formats mxfp4 --m 1,16]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import torch

import formats

from h200_decode_probe import SETS, graph_us  # noqa: E402  (same folder)

N = K = 8192
FORMATS = ("fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "mxfp4")
TILES = {"fp8_tensor": [(32, 128), (1, 512), (1, 2048)], "mxfp8": [(32, 128)],
         "nvfp4": [(32, 128), (1, 512), (1, 2048)], "mxfp4": [(32, 128), (1, 512)]}


def rows(fmt, M, gen):
    mod = importlib.import_module(f"kernels_triton.{fmt}")
    w0 = torch.randn(N, K, generator=gen, device="cuda") * 0.05
    ws = [formats.quantize(w0 * (1 + 0.01 * i), fmt, role="weight") for i in range(SETS)]
    if fmt in ("mxfp8", "nvfp4", "mxfp4") and hasattr(mod, "prepare_weight"):
        ws = [mod.prepare_weight(w) for w in ws]
    xs = [torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(SETS)]
    xqs = [mod.quantize_activation(x) for x in xs]
    out = {}
    for pdl in ("1", "0"):
        os.environ["B12X_PDL"] = pdl
        out[f"quant pdl={pdl}"] = graph_us([lambda x=x: mod.quantize_activation(x) for x in xs])
        out[f"gemm pdl={pdl}"] = graph_us([lambda q=q, w=w: mod.gemm(q, w) for q, w in zip(xqs, ws)])
        out[f"linear pdl={pdl}"] = graph_us([lambda x=x, w=w: mod.linear(x, w) for x, w in zip(xs, ws)])
    os.environ["B12X_PDL"] = "1"
    for bm, bk in TILES.get(fmt, []):
        tile = (bm, bk)  # the lessons' quant_tile= (BLOCK_M, BLOCK_K), in place of the default
        ref = xqs[0]
        got = mod.quantize_activation(xs[0], quant_tile=tile)
        same = torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
        out[f"quant tile {bm}x{bk}"] = graph_us([lambda x=x: mod.quantize_activation(x, quant_tile=tile) for x in xs])
        out[f"linear tile {bm}x{bk}"] = graph_us([lambda x=x, w=w: mod.linear(x, w, quant_tile=tile)
                                                  for x, w in zip(xs, ws)])
        out[f"tile {bm}x{bk} same codes"] = same
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma list from " + ",".join(FORMATS))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    for fmt in args.formats.split(","):
        for M in (int(m) for m in args.m.split(",")):
            try:
                res[f"{fmt} M={M}"] = rows(fmt, M, gen)
            except Exception as e:  # a probe row, not a test: report and go on
                res[f"{fmt} M={M}"] = {"error": repr(e)[:300]}
            print(fmt, M, json.dumps(res[f"{fmt} M={M}"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("\nformat M      quant(on/off)   gemm(on/off)   linear(on/off)  us")
    for key, r in res.items():
        if "error" in r:
            print(f"{key:18s} {r['error'][:80]}")
            continue
        print(f"{key:18s} {r['quant pdl=1']:6.1f}/{r['quant pdl=0']:6.1f}  {r['gemm pdl=1']:6.1f}/{r['gemm pdl=0']:6.1f}"
              f"  {r['linear pdl=1']:6.1f}/{r['linear pdl=0']:6.1f}  "
              + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if "tile" in k))


if __name__ == "__main__":
    main()
