"""Issue 13 knob probe on the H200 (one device call): the decode-sized FP4 kernel (_fp4_decode) and
the swapped FP8 kernel (_fp8_decode, per-tensor, block and MX scales) against the lesson kernels,
and the fp8_tensor prefill knobs.

GEMM alone on operands quantized beforehand, N = K = 8192, bf16 output. Decode rows: CUDA-graph
replay over 5 distinct weights (from HBM, as the bench); prefill rows: do_bench with the L2
flushed. Each variant is checked against the lesson kernel's output (max |diff| / max |lesson|).
fp8_block and mxfp8 also time the whole linear (quantization + GEMM) and bf16 cuBLAS on the same
shapes.

    PYTHONPATH=. python3 tools/h200_decode_probe.py --json $OUT/probe.json [--only fp8_block,mxfp8]
    PYTHONPATH=. python3 tools/h200_decode_probe.py --json $OUT/planes.json --only fp4
    PYTHONPATH=. python3 tools/h200_decode_probe.py --json $OUT/mx8.json --only mxfp8_bf16
    PYTHONPATH=. python3 tools/h200_decode_probe.py --only fp4ovl --before /path/to/older/kernels_triton
    PYTHONPATH=. python3 tools/h200_decode_probe.py --only actfold --before /path/to/older/kernels_triton

The actfold job (perf_notes row 24) times the whole decode linear of mxfp8, nvfp4 and mxfp4 W4A4
against ``--before`` (the activation decoded by its quantizer here), and mxfp8's GEMM alone.

The fp4ovl job (perf_notes row 22) times the FP4 decode GEMM and linear of this tree against an
older copy of the kernels_triton package (``--before``, imported as ``kt_before`` in the same
process), plus tiles and the nvfp4 W4A16 scale fold of this tree.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

import formats
from kernels_triton import _fp4_gemm, fp8_block, fp8_tensor, mxfp4, mxfp8, nvfp4
from kernels_triton.hopper import _e4m3_decode, _fp4_decode, _fp8_decode
from kernels_triton._common import TileConfig
from kernels_triton._e4m3_gemm import gemm_config

N = K = 8192
SETS = 5
DEADLINE = float("inf")  # time.time() after which the fp4 job skips its remaining rows (main sets it)


def capture(fns):
    """(a CUDA graph of fns, their outputs); each fn runs once before on a side stream, so nothing
    compiles inside the capture, and the graph is replayed 3 times before it is returned."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [f() for f in fns]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return g, outs


def graph_us(fns, reps=200):
    """Median µs per fn of a CUDA-graph replay of fns (capture above)."""
    g, _ = capture(fns)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(ts)


def bench_us(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60) * 1e3


def relerr(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def row_adder(rows, fmt, M, ws, ref):
    """add(name, fn_of_w, what="gemm"): time fn_of_w over the weights ws (CUDA-graph replay), check
    its first output against ref, append the row (or the error) to rows and print it."""
    def add(name, fn_of_w, what="gemm"):
        try:
            fns = [lambda w=w: fn_of_w(w) for w in ws]
            y = fns[0]()
            us = graph_us(fns)
            rows.append({"fmt": f"{fmt} {what}", "M": M, "variant": name, "us": us, "rel_vs_lesson": relerr(y, ref)})
        except Exception as e:
            rows.append({"fmt": f"{fmt} {what}", "M": M, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
    return add


def bf16_row(M, x, w0):
    """bf16 cuBLAS (F.linear) on the same x and 5 bf16 weights, CUDA-graph replay: the baseline row."""
    w16 = [(w0 * (1 + 0.01 * i)).to(torch.bfloat16) for i in range(SETS)]
    try:
        us = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in w16])
        row = {"fmt": "bf16 cuBLAS linear", "M": M, "variant": "torch.nn.functional.linear", "us": us}
    except Exception as e:
        row = {"fmt": "bf16 cuBLAS linear", "M": M, "variant": "F.linear", "error": f"{type(e).__name__}: {e}"[:200]}
    print(row, flush=True)
    return row


def fp4_rows(fmt, M, a16, w0, gen):
    group = 16 if fmt == "nvfp4" else 32
    ws = [formats.quantize(w0 * (1 + 0.01 * i), fmt, role="weight") for i in range(SETS)]
    x = (torch.randn(M, K, generator=gen, device="cuda") ).to(torch.bfloat16)
    xq = None if a16 else formats.quantize(x, fmt, role="activation")
    nv = fmt == "nvfp4"
    one = torch.ones(1, device="cuda")

    def args(w):
        gx = (one if a16 else xq.global_scale.reshape(1).float()) if nv else None
        gw = w.global_scale.reshape(1).float() if nv else None
        a = x if a16 else xq.data
        sa = None if a16 else xq.scale.view(torch.uint8)
        return (a, sa, w.data, w.scale.view(torch.uint8)), dict(M=M, N=N, K=K, group=group, scale_e4m3=nv, bias=None,
                                                                   out_dtype=torch.bfloat16, gx=gx, gw=gw, a16=a16)

    rows = []
    lesson_cfg = _fp4_gemm.fp4_gemm_config(M, N, K, False)
    a0, k0 = args(ws[0])
    ref = _fp4_gemm.launch_fp4_gemm(*a0, **k0, config=lesson_cfg)

    def add(name, launch, **extra):
        try:
            fns = []
            for w in ws:
                a, k = args(w)
                fns.append(lambda a=a, k=k: launch(*a, **k, **extra))
            y = fns[0]()
            us = graph_us(fns)
            rows.append({"fmt": fmt + ("_w4a16" if a16 else ""), "M": M, "variant": name, "us": us,
                         "rel_vs_lesson": relerr(y, ref)})
        except Exception as e:
            rows.append({"fmt": fmt + ("_w4a16" if a16 else ""), "M": M, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)

    add(f"lesson {lesson_cfg}", _fp4_gemm.launch_fp4_gemm, config=lesson_cfg)
    # (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages); stages 1 gives 16-byte weight loads (with the
    # pipeliner, Triton 3.6 copies the packed bytes 4 at a time)
    variants = [(64, 128, 4, 4, 3), (64, 128, 4, 4, 1), (64, 128, 8, 4, 1), (64, 256, 4, 4, 1), (128, 128, 4, 4, 1),
                (128, 128, 8, 8, 1), (64, 128, 8, 4, 3), (64, 128, 16, 4, 1)]
    if M == 1 or a16 or not nv:
        variants = variants[:3] + variants[5:6]
    for bn, bk, split, warps, stages in variants:
        cfg = TileConfig(16, bn, bk, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)
        add(f"swap {cfg}", _fp4_decode.launch_fp4_decode, config=cfg)
        if nv and not a16 and M == 16 and (bn, bk, split, warps) == (64, 128, 4, 4):
            add(f"swap {cfg} no-asm", _fp4_decode.launch_fp4_decode, config=cfg, use_asm=False)
    return rows


def fp8_rows(M, w0, gen):
    ws = [formats.quantize(w0 * (1 + 0.01 * i), "fp8_tensor", role="weight") for i in range(SETS)]
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    xq = formats.quantize(x, "fp8_tensor", role="activation")
    rows = []
    ref = fp8_tensor.gemm(xq, ws[0], None, torch.bfloat16, path="portable")

    def add(name, fn_of_w):
        try:
            fns = [lambda w=w: fn_of_w(w) for w in ws]
            y = fns[0]()
            us = graph_us(fns) if M <= 64 else bench_us(fns[0])
            rows.append({"fmt": "fp8_tensor", "M": M, "variant": name, "us": us, "rel_vs_lesson": relerr(y, ref)})
        except Exception as e:
            rows.append({"fmt": "fp8_tensor", "M": M, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)

    # at M <= 16 on sm_90 gemm itself takes the decode kernel, so this row is the default, not the lesson
    add(f"gemm {fp8_tensor.tile_config(M, N, K, path='portable')}",
        lambda w: fp8_tensor.gemm(xq, w, None, torch.bfloat16, path="portable"))
    if M <= 16:
        for bn, bk, st, wp, ppsm, imp in [(64, 128, 4, 4, 2, 128), (64, 128, 4, 4, 4, 128), (128, 128, 4, 4, 2, 128),
                                          (64, 256, 3, 4, 2, 128), (64, 128, 6, 4, 1, 128), (128, 128, 4, 4, 1, 128),
                                          (64, 128, 4, 4, 2, 1 << 30), (64, 128, 6, 4, 0, 128), (64, 128, 8, 4, 0, 128)]:
            cfg = _fp8_decode.fp8_decode_config(M, N, K, bn=bn, bk=bk, stages=st, warps=wp, programs_per_sm=ppsm)
            add(f"swap {cfg} imprecise={imp}",
                lambda w, cfg=cfg, imp=imp: _fp8_decode.launch_fp8_decode(
                    xq.data, w.data, xq.scale, w.scale, None, torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
                    imprecise_acc=imp, config=cfg))
    else:
        orig_cfg, orig_imp = fp8_tensor.tile_config, fp8_tensor.IMPRECISE_ACC
        for cfg, imp in [(TileConfig(128, 128, 128, 8, 8, 4), 128), (TileConfig(128, 128, 128, 8, 4, 3), 128),
                         (TileConfig(128, 128, 64, 8, 4, 4), 64), (TileConfig(128, 256, 64, 8, 8, 3), 64),
                         (TileConfig(128, 128, 128, 8, 8, 3), 1 << 30), (TileConfig(128, 256, 128, 8, 8, 3), 1 << 30)]:
            fp8_tensor.tile_config = lambda *a, cfg=cfg, **k: cfg
            fp8_tensor.IMPRECISE_ACC = imp
            add(f"{cfg} imprecise={imp}", lambda w: fp8_tensor.gemm(xq, w, None, torch.bfloat16, path="portable"))
        fp8_tensor.tile_config, fp8_tensor.IMPRECISE_ACC = orig_cfg, orig_imp
    return rows


# decode configs of the swapped kernel tried per format (fp8_decode_config's keywords).
# fp8_block: programs_per_sm 0 is no split-K (one program per 64-row tile walks all of K, no
# reduction launch). mxfp8: BLOCK_K 32 (s12), 6 stages at 128 rows and 2 programs per SM were
# slower still (docs/perf_notes.md, row 16)
SWAP_CONFIGS = {
    "fp8_block": [dict(bn=bn, stages=st, programs_per_sm=ppsm) for bn, st, ppsm in
                  [(64, 6, 1), (64, 4, 2), (64, 6, 2), (128, 4, 1), (64, 6, 0), (64, 8, 0), (64, 8, 1)]],
    "mxfp8": [dict(bn=bn, bk=bk, stages=st, programs_per_sm=ppsm, warps=wp) for bn, bk, st, ppsm, wp in
              [(64, 128, 6, 1, 4), (128, 128, 4, 1, 4), (128, 128, 3, 1, 4), (256, 128, 3, 1, 4),
               (256, 128, 2, 1, 4), (256, 128, 3, 1, 8), (128, 128, 4, 1, 8), (128, 128, 3, 1, 8)]],
}


def scaled_fp8_rows(fmt, M, w0, gen):
    """fp8_block or mxfp8 at decode M: the lesson kernel, the decode configs of the swapped kernel
    (SWAP_CONFIGS; SCALE_K 128 / 32), the default gemm, then the whole linear (lesson and default)
    and bf16 cuBLAS, over 5 weights."""
    mod = fp8_block if fmt == "fp8_block" else mxfp8
    scale_k = _fp8_decode.FP8_BLOCK_SCALE if fmt == "fp8_block" else _fp8_decode.MX_SCALE
    ws = [formats.quantize(w0 * (1 + 0.01 * i), fmt, role="weight") for i in range(SETS)]
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    xq = formats.quantize(x, fmt, role="activation")
    lesson_cfg = (gemm_config(M, N, K, False, block_k=128) if fmt == "fp8_block"
                  else gemm_config(M, N, K, False, block_k=64, prepass=True))
    out = lambda: torch.empty(M, N, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    ref = mod._gemm_portable(xq, ws[0], None, out(), cfg=lesson_cfg)
    rows = []
    add = row_adder(rows, fmt, M, ws, ref)

    add(f"lesson {lesson_cfg}", lambda w: mod._gemm_portable(xq, w, None, out(), cfg=lesson_cfg))
    for kw in SWAP_CONFIGS[fmt]:
        cfg = _fp8_decode.fp8_decode_config(M, N, K, **kw)
        add(f"swap {cfg}", lambda w, cfg=cfg: _fp8_decode.launch_fp8_decode(
            xq.data, w.data, xq.scale, w.scale, None, out(), scale_k=scale_k, config=cfg))
    add(f"default {mod.tile_config(M, N, K)}", lambda w: mod.gemm(xq, w, None, torch.bfloat16))
    add(f"lesson {lesson_cfg}", lambda w: mod._gemm_portable(
        mod.quantize_activation(x), w, None, out(), cfg=lesson_cfg), "linear")
    add(f"default {mod.tile_config(M, N, K)}", lambda w: mod.linear(x, w), "linear")
    rows.append(bf16_row(M, x, w0))
    return rows


# the bf16 decode kernel's tiles tried (BLOCK_N, warps, stages, split, maxnreg); the first is
# decode_tile's at 132 SMs. The first device call (row 21) also ran 128 s4 split 8, 64 s3 split 8,
# 128 s3 split 16 and 64 s4 split 16, all slower
BF16_TILES = [(128, 4, 3, 8, None), (128, 4, 3, 4, None), (128, 8, 3, 8, None), (128, 8, 3, 4, None),
              (128, 8, 4, 8, None), (128, 8, 2, 8, None), (128, 4, 3, 8, 128), (128, 4, 2, 8, None), (64, 4, 3, 4, None)]


def mxfp8_bf16_rows(M, w0, gen):
    """mxfp8 at decode M, the two sm_90 decode kernels: _fp8_decode's 32-deep fp8 partials (its
    default tile) against _e4m3_decode's bf16 register operands (BF16_TILES), GEMM alone, checked
    against the lesson kernel; then the whole linear with mxfp8.DECODE_KERNEL "fp8" and "bf16", and
    bf16 cuBLAS, over 5 weights."""
    ws = [formats.quantize(w0 * (1 + 0.01 * i), "mxfp8", role="weight") for i in range(SETS)]
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    xq = formats.quantize(x, "mxfp8", role="activation")
    lesson_cfg = gemm_config(M, N, K, False, block_k=64, prepass=True)
    out = lambda: torch.empty(M, N, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    ref = mxfp8._gemm_portable(xq, ws[0], None, out(), cfg=lesson_cfg)
    rows = []
    add = row_adder(rows, "mxfp8", M, ws, ref)
    fp8_cfg = _fp8_decode.hopper_config(M, N, K, ws[0].data.device, scale_k=_fp8_decode.MX_SCALE)
    add(f"fp8 partials {fp8_cfg}", lambda w: _fp8_decode.launch_fp8_decode(
        xq.data, w.data, xq.scale, w.scale, None, out(), scale_k=_fp8_decode.MX_SCALE))
    for bn, warps, stages, split, regs in BF16_TILES:
        cfg = TileConfig(16, bn, 128, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)
        add(f"bf16 decode {cfg}{f' maxnreg={regs}' if regs else ''}", lambda w, cfg=cfg, regs=regs:
            _e4m3_decode.launch_e4m3_decode(xq.data, xq.scale, w.data, w.scale, None, out(), config=cfg, maxnreg=regs))
    before = mxfp8.DECODE_KERNEL
    for kern in ("fp8", "bf16"):
        mxfp8.DECODE_KERNEL = kern
        add(f"DECODE_KERNEL={kern} {mxfp8.tile_config(M, N, K)}", lambda w: mxfp8.gemm(xq, w, None, torch.bfloat16))
        add(f"DECODE_KERNEL={kern} {mxfp8.tile_config(M, N, K)}", lambda w: mxfp8.linear(x, w), "linear")
    mxfp8.DECODE_KERNEL = before
    rows.append(bf16_row(M, x, w0))
    return rows


def fp4_case(fmt, a16, M, x, w0):
    """One FP4 variant's probe inputs: (format module, is nvfp4, variant name, SETS weights, args(w) ->
    (launch_fp4_decode's positional args, its keywords)) for the bf16 activation x [M, K]."""
    nv = fmt == "nvfp4"
    ws = [formats.quantize(w0 * (1 + 0.01 * i), fmt, role="weight") for i in range(SETS)]
    xq = None if a16 else formats.quantize(x, fmt, role="activation")
    one = torch.ones(1, device="cuda")

    def args(w):
        gx = (one if a16 else xq.global_scale.reshape(1).float()) if nv else None
        gw = w.global_scale.reshape(1).float() if nv else None
        return ((x if a16 else xq.data, None if a16 else xq.scale.view(torch.uint8), w.data,
                 w.scale.view(torch.uint8)),
                dict(M=M, N=N, K=K, group=16 if nv else 32, scale_e4m3=nv, bias=None, out_dtype=torch.bfloat16,
                     gx=gx, gw=gw, a16=a16))

    return nvfp4 if nv else mxfp4, nv, fmt + ("_w4a16" if a16 else ""), ws, args


def fp4_planes_rows(M, w0, gen):
    """The FP4 decode kernel (nibble planes) against the lesson kernel: GEMM alone for nvfp4 / mxfp4,
    W4A4 / W4A16 (bf16 x), with the default tile and other tiles, then the whole linear, and bf16
    cuBLAS. perf_notes row 17's "before" figures (the joined tile, mxfp4 W4A4 on the lesson kernel)
    came from the tree before the joined path was removed: 09c449d, commit 78f5d39's (first) parent."""
    rows = []
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    for fmt, a16 in [("nvfp4", False), ("mxfp4", False), ("mxfp4", True), ("nvfp4", True)]:
        mod, nv, name, ws, args = fp4_case(fmt, a16, M, x, w0)

        lesson_cfg = _fp4_gemm.fp4_gemm_config(M, N, K, False)
        a0, k0 = args(ws[0])
        ref = _fp4_gemm.launch_fp4_gemm(*a0, **k0, config=lesson_cfg)

        def add(what, variant, fn_of_w):
            if time.time() > DEADLINE:
                rows.append({"fmt": f"{name} {what}", "M": M, "variant": variant, "error": "skipped: probe budget"})
                return
            try:
                fns = [lambda w=w: fn_of_w(w) for w in ws]
                y = fns[0]()
                rows.append({"fmt": f"{name} {what}", "M": M, "variant": variant, "us": graph_us(fns),
                             "rel_vs_lesson": relerr(y, ref)})
            except Exception as e:
                rows.append({"fmt": f"{name} {what}", "M": M, "variant": variant,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(rows[-1], flush=True)

        def gemm(w, **kw):
            a, k = args(w)
            return _fp4_decode.launch_fp4_decode(*a, **k, **kw)

        add("gemm", f"lesson {lesson_cfg}", lambda w: _fp4_gemm.launch_fp4_gemm(*args(w)[0], **args(w)[1],
                                                                                 config=lesson_cfg))
        cfg0 = _fp4_decode.decode_config(M, N, K, ws[0].data.device, fmt, a16)
        add("gemm", f"swap planes {cfg0} (default)", gemm)
        # planes with other tiles (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
        tiles = [(64, 128, 8, 4, 3), (128, 128, 16, 4, 3)]
        if M > 1:
            tiles += [(128, 128, 4, 4, 3), (128, 128, 8, 8, 3), (128, 128, 8, 4, 4), (64, 256, 8, 4, 3), (256, 128, 4, 8, 3)]
        for bn, bk, split, warps, stages in tiles:
            cfg = TileConfig(16, bn, bk, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)
            add("gemm", f"swap planes {cfg}", lambda w, cfg=cfg: gemm(w, config=cfg))
        lin = (lambda w: mod.linear(x, w, a16=True)) if a16 else (lambda w: mod.linear(x, w))
        add("linear", "planes (default)", lin)
        torch.cuda.empty_cache()
    rows.append(bf16_row(M, x, w0))
    return rows


def load_before(path):
    """The kernels_triton package at ``path`` (an older tree), imported as ``kt_before``: its
    modules import each other relatively, so both versions live in one process."""
    spec = importlib.util.spec_from_file_location("kt_before", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["kt_before"] = pkg
    spec.loader.exec_module(pkg)
    return {m: importlib.import_module(f"kt_before.{m}") for m in ("_fp4_decode", "nvfp4", "mxfp4", "mxfp8",
                                                                    "_e4m3_decode")}


def fp4_overlap_rows(M, w0, gen, before):
    """perf_notes row 22: the FP4 decode GEMM (launch_fp4_decode, default tile) and whole linear of
    this tree against ``before`` (load_before), then this tree's GEMM with split 4 / 8 / 16, 4
    stages, BLOCK_K 256, and nvfp4 W4A16 without the scale fold; bf16 cuBLAS last. Every output is
    checked against the lesson kernel."""
    rows = []
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    for fmt, a16 in [("nvfp4", False), ("mxfp4", False), ("mxfp4", True), ("nvfp4", True)]:
        mod, nv, name, ws, args = fp4_case(fmt, a16, M, x, w0)

        a0, k0 = args(ws[0])
        ref = _fp4_gemm.launch_fp4_gemm(*a0, **k0, config=_fp4_gemm.fp4_gemm_config(M, N, K, False))
        add = row_adder(rows, name, M, ws, ref)
        cfg0 = _fp4_decode.decode_config(M, N, K, ws[0].data.device, fmt, a16)

        def gemm(w, launch=_fp4_decode.launch_fp4_decode, **kw):
            a, k = args(w)
            return launch(*a, **k, **kw)

        add(f"before {before['_fp4_decode'].decode_config(M, N, K, ws[0].data.device)}",
            lambda w: gemm(w, before["_fp4_decode"].launch_fp4_decode))
        add(f"after {cfg0} (default)", gemm)
        tiles = [(128, 4, 3), (128, 8, 3), (256, 4, 3), (256, 8, 3)]
        for bk, split, stages in tiles:
            cfg = TileConfig(16, 128, bk, GROUP_M=1, num_warps=4, num_stages=stages, SPLIT_K=split)
            if cfg != cfg0:
                add(f"after {cfg}", lambda w, cfg=cfg: gemm(w, config=cfg))
        if nv and a16:
            add(f"after {cfg0} fold_scale=False", lambda w: gemm(w, fold_scale=False))
        lin, lin0 = ((lambda w: mod.linear(x, w, a16=True)), (lambda w: before[fmt].linear(x, w, a16=True))) if a16 \
            else ((lambda w: mod.linear(x, w)), (lambda w: before[fmt].linear(x, w)))
        add("before", lin0, "linear")
        add("after (default)", lin, "linear")
        torch.cuda.empty_cache()
    rows.append(bf16_row(M, x, w0))
    return rows


def actfold_rows(M, w0, gen, before):
    """perf_notes row 24: the decode linear with the activation decoded by its quantizer (mxfp8:
    act_decoded_kernel + the X_DECODED GEMM; nvfp4 / mxfp4 W4A4: quantize_planes + the FP4 GEMM)
    against ``before`` (load_before: the tree where the GEMM decodes the activation codes / a separate
    act_planes_kernel does), whole linear, then for mxfp8 the GEMM alone on the same operands; bf16
    cuBLAS last. Checked against the before tree's linear (rel diff, and "same" when bit-identical)."""
    rows = []
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    for fmt in ("mxfp8", "nvfp4", "mxfp4"):
        mod = {"mxfp8": mxfp8, "nvfp4": nvfp4, "mxfp4": mxfp4}[fmt]
        ws = [formats.quantize(w0 * (1 + 0.01 * i), fmt, role="weight") for i in range(SETS)]
        ref = before[fmt].linear(x, ws[0])
        add = row_adder(rows, fmt, M, ws, ref)
        add("before", lambda w: before[fmt].linear(x, w), "linear")
        add("after", lambda w: mod.linear(x, w), "linear")
        rows[-1]["same_as_before"] = bool(torch.equal(mod.linear(x, ws[0]), ref))
        print("bit-identical to before:", rows[-1]["same_as_before"], flush=True)
        if fmt == "mxfp8":
            xq = formats.quantize(x, fmt, role="activation")
            cfg = _e4m3_decode.decode_config(M, N, K, x.device)
            kp = -(-K // cfg.BLOCK_K) * cfg.BLOCK_K
            xd = torch.empty(M, kp, dtype=torch.bfloat16, device="cuda")
            _e4m3_decode.act_decoded_kernel[(kp // cfg.BLOCK_K,)](x, xd, M, K, x.stride(0), x.stride(1), xd.stride(0),
                                                                 FLOOR_RULE=False, BLOCK_M=16, BLOCK_K=cfg.BLOCK_K)
            y = lambda: torch.empty(M, N, dtype=torch.bfloat16, device="cuda")  # noqa: E731
            add("before (codes, decoded per program)", lambda w: before["_e4m3_decode"].launch_e4m3_decode(
                xq.data, xq.scale, w.data, w.scale, None, y()))
            add("after (X_DECODED)", lambda w: _e4m3_decode._launch_gemm(xd, w.scale, w.data, w.scale, None, y(), cfg,
                                                                        None, None, x_decoded=True))
        torch.cuda.empty_cache()
    rows.append(bf16_row(M, x, w0))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--only", default="", help="comma list of jobs, FMT or FMT:M (FMT: nvfp4, mxfp4, fp8, fp8_block, mxfp8, fp4 (planes "
                   "vs lesson), mxfp8_bf16 (the two mxfp8 decode kernels), fp4ovl, actfold (need --before); default: all)")
    p.add_argument("--before", help="fp4ovl: the older kernels_triton package directory to compare with")
    args = p.parse_args()
    before = load_before(args.before) if args.before else None
    t0 = time.time()
    global DEADLINE
    DEADLINE = t0 + args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(0)
    w0 = torch.randn(N, K, generator=gen, device="cuda") * 0.05
    rows = []
    jobs = [("nvfp4", 16, False), ("mxfp4", 16, False), ("mxfp4", 16, True), ("nvfp4", 1, False),
            ("mxfp4", 1, False), ("mxfp4", 1, True), ("fp8", 16, None), ("fp8", 1, None), ("fp8", 8192, None),
            ("fp8_block", 16, None), ("fp8_block", 1, None), ("mxfp8", 16, None), ("mxfp8", 1, None),
            ("fp4", 16, None), ("fp4", 1, None), ("mxfp8_bf16", 16, None), ("mxfp8_bf16", 1, None),
            ("fp4ovl", 16, None), ("fp4ovl", 1, None), ("actfold", 16, None), ("actfold", 1, None)]
    if args.only:
        sel = args.only.split(",")
        jobs = [j for j in jobs if j[0] in sel or f"{j[0]}:{j[1]}" in sel]
    for fmt, M, a16 in jobs:
        if time.time() - t0 > args.budget_s:
            print(f"probe budget spent, skipping {fmt} M={M}", flush=True)
            continue
        if fmt == "fp8":
            rows += fp8_rows(M, w0, gen)
        elif fmt in SWAP_CONFIGS:
            rows += scaled_fp8_rows(fmt, M, w0, gen)
        elif fmt == "fp4":
            rows += fp4_planes_rows(M, w0, gen)
        elif fmt == "mxfp8_bf16":
            rows += mxfp8_bf16_rows(M, w0, gen)
        elif fmt == "actfold":
            if before is None:
                print("actfold needs --before, skipped", flush=True)
                continue
            rows += actfold_rows(M, w0, gen, before)
        elif fmt == "fp4ovl":
            if before is None:
                print("fp4ovl needs --before, skipped", flush=True)
                continue
            rows += fp4_overlap_rows(M, w0, gen, before)
        else:
            rows += fp4_rows(fmt, M, a16, w0, gen)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| fmt | M | variant | us | rel vs lesson |")
    for r in rows:
        print(f"| {r['fmt']} | {r['M']} | {r['variant']} | {r.get('us', float('nan')):.1f} | "
              f"{r.get('rel_vs_lesson', float('nan')):.1e} | {r.get('same_as_before', '')} {r.get('error', '')[:60]}")
    print(f"probe: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
