"""Compile the sm_90 mxfp8 decode GEMMs without a GPU and count the SASS instructions of their K
loop (docs/perf_notes.md, rows 16 and 21): per thread per 128-wide K step, by opcode.

    python tools/probes/decode_sass.py [--bn 128] [--stages 3] [--warps 4] [--maxnreg N] [--dump loop.sass]

Compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` as the launcher
specializes real shapes (pointers and integers but M divisible by 16), then disassembled with the
cuobjdump that Triton carries. The K loop is the longest block ending in a backward branch.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_kernel(fn, constexprs: dict, warps: int, stages: int, types: dict | None = None, maxnreg=None):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif fn.params[i].is_constexpr and fn.params[i].has_default:
            constexprs[name] = fn.params[i].default
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = (types or {}).get(name, "*bf16" if name == "y_ptr" else "*fp32" if name in ("ws_ptr", "bias_ptr")
                                          else "*u8")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg))


def cuobjdump(kernel, flag: str) -> str:
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([exe, flag, f.name], capture_output=True, text=True, check=True).stdout


def registers(kernel) -> str:
    """Registers per thread and, when ptxas spilled, the local memory per thread."""
    text = cuobjdump(kernel, "-res-usage")
    reg, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    spill = f" (LOCAL {local.group(1)} B: spills)" if local and int(local.group(1)) else ""
    return (reg.group(1) if reg else "?") + spill


def loop_sass(kernel) -> list[str]:
    """The instructions of the longest loop (a backward BRA) in the kernel's SASS."""
    text = cuobjdump(kernel, "-sass")
    ins = []  # (address, text)
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = []
    for i, (addr, t) in enumerate(ins):
        m = re.search(r"0x([0-9a-f]+)", t) if "BRA" in t else None
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            body = [x for a, x in ins if start <= a <= addr]
            if len(body) > len(best):
                best = body
    return best


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    return ins.split()[0].split(".")[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bn", type=int, default=128)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--maxnreg", type=int)
    p.add_argument("--dump")
    args = p.parse_args()
    from kernels_triton.hopper import _e4m3_decode, _fp8_decode

    rows = []
    k = compile_kernel(_e4m3_decode.e4m3_decode_gemm_kernel,
                       dict(HAS_BIAS=False, USE_ASM=True, DOT_DTYPE=tl.bfloat16, ROUND_BF16=False, EVEN_K=True,
                            BLOCK_N=args.bn, BLOCK_M=16, BLOCK_K=128, SPLIT_K=8), args.warps, args.stages,
                       maxnreg=args.maxnreg)
    rows.append((f"bf16 operands (_e4m3_decode, {args.warps} warps)", k, args.bn * 4 // args.warps))
    kd = compile_kernel(_e4m3_decode.e4m3_decode_gemm_kernel,
                        dict(HAS_BIAS=False, USE_ASM=True, DOT_DTYPE=tl.bfloat16, ROUND_BF16=False, EVEN_K=True,
                             BLOCK_N=args.bn, BLOCK_M=16, BLOCK_K=128, SPLIT_K=8, X_DECODED=True), args.warps,
                        args.stages, types={"x_ptr": "*bf16"}, maxnreg=args.maxnreg)
    rows.append((f"bf16 operands, activation dequantized by its quantizer (X_DECODED, {args.warps} warps)", kd,
                 args.bn * 4 // args.warps))
    k2 = compile_kernel(_fp8_decode.fp8_decode_gemm_kernel,
                        dict(HAS_BIAS=False, IMPRECISE_ACC=32, SCALE_K=32, BLOCK_N=128, BLOCK_M=16, BLOCK_K=128,
                             SPLIT_K=4, DOT_FP8=True, ROUND_BF16=False),
                        4, 4, types={"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sx_ptr": "*i32", "sw_ptr": "*i32"})
    rows.append(("fp8 partials (_fp8_decode, MX)", k2, 128))
    from kernels_triton.hopper import _fp4_decode
    k3 = compile_kernel(_fp4_decode.fp4_decode_gemm_kernel,
                        dict(GROUP=32, SCALE_E4M3=False, HAS_GLOBAL=False, HAS_BIAS=False, F16_DEQUANTIZE=False,
                             USE_ASM=True, DOT_DTYPE=tl.bfloat16, ROUND_BF16=False, EVEN_K=True, BLOCK_N=128,
                             BLOCK_M=16, BLOCK_K=128, SPLIT_K=8), 4, 3, types={"a_ptr": "*bf16", "c_ptr": "*bf16"})
    rows.append(("reference: mxfp4 W4A16 planes (_fp4_decode)", k3, 128))
    for name, kern, bn in rows:
        body = loop_sass(kern)
        n = collections.Counter(opcode(x) for x in body)
        regs = registers(kern)
        print(f"{name}: {len(body)} loop instructions per 128-K step per thread, {len(body) / bn:.2f} per weight "
              f"element ({bn} weight rows per 4 warps), {regs} registers, {kern.metadata.shared} B shared")
        print("   ", ", ".join(f"{op} {c}" for op, c in n.most_common()))
        mmas = 0  # the MMA waits: after how many HGMMAs each WARPGROUP.DEPBAR waits, and for what
        for i, x in enumerate(body):
            mmas += "HGMMA" in x
            if "WARPGROUP.DEPBAR" in x:
                print(f"    wait @{i}: {x.split('DEPBAR', 1)[1].strip()} after {mmas} HGMMA")
                mmas = 0
        if args.dump and kern is rows[0][1]:
            with open(args.dump, "w") as f:
                f.write("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
