"""Repeatability on a GPU: every format's GEMM (W4A4 and W4A16 variants, the default path and the
native one where it differs) run 100 times eagerly and replayed 100 times from a CUDA graph must give
the same bits as the first run; a reload of a QuantLinear's weights into existing storage keeps
every prepared data_ptr(), and a graph captured before the reload then serves the new weights.

    python tools/h200_repeat.py [--runs 100] [--json out.json]

Prints one line per case and a table last; exit status 1 if any case differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import kernels_triton as kt  # noqa: E402  (first: sets the interpreter up where there is no GPU)
import formats as F
from dispatch import policy, registry
from dispatch.quant_linear import QuantLinear, load_quantized, save_quantized

SHAPES = [(16, 1024, 2048), (300, 1024, 2048)]  # decode (split-K tiles) and prefill (pre-pass) regimes
SMALL = [(4, 64, 256)]  # --small: a smoke run under the CPU interpreter (no CUDA graphs there)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _graph(fn):
    """(graph, its output), or (None, None) without CUDA; fn captured in a CUDA graph (after a warm-up on a side stream, as torch's docs say)."""
    if DEV != "cuda":
        return None, None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def gemm_cases(runs: int, shapes):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for variant, spec in registry.VARIANTS.items():
        fmt, a16 = spec.fmt, spec.a16
        paths = [None] if a16 else [None, "native"]
        for m, n, k in shapes:
            x = torch.randn(m, k, generator=gen).bfloat16().to(DEV)
            w = F.quantize(torch.randn(n, k, generator=gen), fmt).to(DEV)
            for path in paths:
                opts = {"a16": True} if a16 else {"path": path}
                label = f"{variant} M={m} {path or 'default'}"
                try:
                    first = kt.linear(x, w, **opts)
                except ValueError as e:  # a path this GPU/Triton cannot run: say so
                    rows.append((label, "n/a", "n/a", str(e)[:60]))
                    continue
                eager_same = all(torch.equal(kt.linear(x, w, **opts), first) for _ in range(runs))
                g, out = _graph(lambda: kt.linear(x, w, **opts))
                graph_same = g is not None or "n/a"
                for _ in range(runs if g is not None else 0):
                    g.replay()
                    graph_same &= torch.equal(out, first)
                rows.append((label, eager_same, graph_same, ""))
                print(f"{label}: {runs} runs identical={eager_same}, {runs} graph replays identical={graph_same}",
                      flush=True)
    return rows


def reload_cases(k: int, n: int):
    rows = []
    for variant in registry.VARIANTS:
        torch.manual_seed(1)
        layer = QuantLinear.from_linear(nn.Linear(k, n), variant, act_dtype=torch.bfloat16).to(DEV)
        model = nn.Sequential(layer)
        x = torch.randn(16, k, device=DEV)
        with policy.use_impl("triton"), torch.no_grad():
            y_a = layer(x)
            g, out = _graph(lambda: layer(x))
        ptrs = {name: [t.data_ptr() for t in p.tensors().values()] for name, p in layer._prepared.items()}
        torch.manual_seed(2)
        other = nn.Sequential(QuantLinear.from_linear(nn.Linear(k, n), variant, act_dtype=torch.bfloat16).to(DEV))
        with tempfile.TemporaryDirectory() as d:
            pa, pb = Path(d) / "a.safetensors", Path(d) / "b.safetensors"
            save_quantized(model, pa)
            save_quantized(other, pb)
            load_quantized(model, pb)
            same_ptrs = {n: [t.data_ptr() for t in p.tensors().values()] for n, p in layer._prepared.items()} == ptrs
            with policy.use_impl("triton"), torch.no_grad():
                y_b = other[0](x)
                graph_new = True
                if g is not None:
                    g.replay()
                    graph_new = torch.equal(out, y_b)  # the old graph serves the reloaded weights
                load_quantized(model, pa)
                back = torch.equal(layer(x), y_a)
        rows.append((f"reload {variant}", same_ptrs, graph_new and back, ""))
        print(f"reload {variant}: addresses kept={same_ptrs}, graph serves new weights={graph_new}, "
              f"reload back gives the first result={back}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--json", default=None)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU interpreter smoke run)")
    args = ap.parse_args(argv)
    shapes = SMALL if args.small else SHAPES
    rows = gemm_cases(args.runs, shapes) + reload_cases(256 if args.small else 2048, 64 if args.small else 1024)
    print(f"\n{'case':34} {'eager/addr':>10} {'graph':>6}  note")
    for r in rows:
        print(f"{r[0]:34} {str(r[1]):>10} {str(r[2]):>6}  {r[3]}")
    bad = [r for r in rows if False in (r[1], r[2])]
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (Triton interpreter)"
    print(f"{len(rows)} cases, {len(bad)} differ; device {name}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    if args.json:
        Path(args.json).write_text(json.dumps([list(map(str, r)) for r in rows], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
