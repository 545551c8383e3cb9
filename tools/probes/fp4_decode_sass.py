"""The K loop of the FP4 decode kernel (_fp4_decode) in sm_90 SASS, compiled here without a GPU.

    python tools/probes/fp4_decode_sass.py                       # every format, its default tile
    python tools/probes/fp4_decode_sass.py --fmt nvfp4 --dump    # one format, the loop's SASS printed
    PYTHONPATH=/path/to/triton-3.6 python tools/probes/fp4_decode_sass.py   # as the H200 compiles it

Per format: the instructions of the loop body (the block between the loop's backward branch and
its target) per thread, the counts of the opcodes that matter (HGMMA, the WARPGROUP.DEPBAR waits,
BAR.SYNC, the decode's PRMT / LOP3 / HMUL2 ...) and, for each DEPBAR, how many instructions of the
loop come before it and how many HGMMAs were issued since the previous wait: where the wait for
the MMAs sits against the next step's decode is what overlap is about. Compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` and disassembled with the
nvdisasm that Triton's wheel ships (``CompiledKernel.asm["sass"]``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions (kernels_triton respects a set value)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels_triton.hopper import _fp4_decode  # noqa: E402

# format -> the GEMM kernel's constexprs that launch_fp4_decode derives from it (the activation
# arrives decoded, so mxfp4 W4A4 and W4A16 compile to the same GEMM)
FORMATS = {
    "nvfp4": dict(GROUP=16, SCALE_E4M3=True, F16_DEQUANTIZE=True, DOT_DTYPE=tl.float16),
    "mxfp4": dict(GROUP=32, SCALE_E4M3=False, F16_DEQUANTIZE=False, DOT_DTYPE=tl.bfloat16),
    "mxfp4_w4a16": dict(GROUP=32, SCALE_E4M3=False, F16_DEQUANTIZE=False, DOT_DTYPE=tl.bfloat16),
    "nvfp4_w4a16": dict(GROUP=16, SCALE_E4M3=True, F16_DEQUANTIZE=False, DOT_DTYPE=tl.bfloat16, FOLD_E4M3=True),
}
KEY_OPS = ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "BAR.SYNC", "LDG", "LDGSTS", "LDS", "LDSM", "STS",
           "STSM", "PRMT", "LOP3", "HMUL2", "IMAD", "SHF", "F2FP", "HADD2", "FMUL")


def compile_kernel(fmt: str, bn: int, bk: int, split: int, warps: int, stages: int, extra: dict | None = None):
    """(the compiled fp4_decode_gemm_kernel for sm_90, its registers, its spill-store bytes)."""
    fn = _fp4_decode.fp4_decode_gemm_kernel
    const = dict(HAS_GLOBAL=fmt == "nvfp4", HAS_BIAS=False, USE_ASM=True, ROUND_BF16=False, EVEN_K=True,
                 BLOCK_N=bn, BLOCK_M=16, BLOCK_K=bk, SPLIT_K=split, USE_PDL=True)
    const.update({**FORMATS[fmt], **(extra or {})})
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif fn.params[i].is_constexpr and fn.params[i].has_default:
            const[name] = fn.params[i].default
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            dot = "*fp16" if const["F16_DEQUANTIZE"] else "*bf16"  # the decoded activation (act_planes_kernel)
            sig[name] = (dot if name == "a_ptr" else "*bf16" if name == "c_ptr"
                         else "*fp32" if name in ("ws_ptr", "bias_ptr", "gx_ptr", "gw_ptr") else "*u8")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:  # the launcher specializes strides and sizes divisible by 16 (8192 here)
            sig[name] = "i32"
            if name != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
    const = {k: v for k, v in const.items() if k in fn.arg_names}

    knobs.nvidia.dump_ptxas_log = True
    knobs.cache.dir = tempfile.mkdtemp()  # a fresh cache per build, so that ptxas runs and reports
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))
    regs = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    return k, (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop: from a label to the branch back to it. Triton's
    ``asm["sass"]`` prints one instruction a line after its control code (``--:-:1:-:7\tLDG ...;``)
    and branch targets as labels (``LBB1:``)."""
    insts, label_at = [], {}
    for line in sass.splitlines():
        lab = re.match(r"\s*([.\w]+):\s*$", line)
        if lab:
            label_at[lab.group(1)] = len(insts)
        elif ";" in line:
            insts.append(line.split("\t")[-1].strip().rstrip(";"))
    best = []
    for i, text in enumerate(insts):
        m = re.search(r"\bBRA\s+(\S+)$", text)
        if m and label_at.get(m.group(1), i + 1) <= i:
            body = insts[label_at[m.group(1)]:i + 1]
            best = body if len(body) > len(best) else best
    return best


def opcode(text: str) -> str:
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    return t.split()[0]


def report(fmt: str, body: list[str]) -> dict:
    ops = collections.Counter()
    for t in body:
        op = opcode(t)
        key = next((k for k in KEY_OPS if op == k or op.startswith(k + ".")), op.split(".")[0])
        ops[key] += 1
    waits, mma_since = [], 0
    for i, t in enumerate(body):
        op = opcode(t)
        if op.startswith("HGMMA"):
            mma_since += 1
        if op.startswith("WARPGROUP.DEPBAR"):
            waits.append(f"@{i} {t.split(None, 1)[-1] if ' ' in t else ''} after {mma_since} HGMMA")
            mma_since = 0
    return dict(fmt=fmt, loop=len(body), ops=ops, waits=waits)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fmt", default=",".join(FORMATS))
    p.add_argument("--tile", help="BLOCK_N,BLOCK_K,SPLIT_K,warps,stages (default: decode_tile's for M = 16, "
                   "N = K = 8192 on 132 SMs, per format)")
    p.add_argument("--dump", action="store_true", help="print the loop's SASS")
    p.add_argument("--const", default="", help="extra constexprs, NAME=int,...")
    args = p.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    extra = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.const.split(",") if kv}
    for fmt in args.fmt.split(","):
        if args.tile:
            bn, bk, split, warps, stages = (int(v) for v in args.tile.split(","))
        else:
            c = _fp4_decode.decode_tile(16, 8192, 8192, 132, fmt.split("_")[0], fmt.endswith("w4a16"))
            bn, bk, split, warps, stages = c.BLOCK_N, c.BLOCK_K, c.SPLIT_K, c.num_warps, c.num_stages
        k, regs, spills = compile_kernel(fmt, bn, bk, split, warps, stages, extra)
        r = report(fmt, loop_body(k.asm["sass"]))
        keys = " ".join(f"{o} {r['ops'][o]}" for o in KEY_OPS if r["ops"][o])
        print(f"{fmt} ({bn} x 16 x {bk} split {split} w{warps} s{stages}): loop {r['loop']} instructions, "
              f"regs {regs}, spill stores {spills}; {keys}")
        for w in r["waits"]:
            print(f"    wait {w}")
        if args.dump:
            print("\n".join(loop_body(k.asm["sass"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
