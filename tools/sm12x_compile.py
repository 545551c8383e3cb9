"""Compile every GEMM configuration the SM12x tile tables can select, for sm_120a and sm_121a,
on a machine without a GPU, and report what ptxas made of each.

    python tools/sm12x_compile.py                 # markdown table (docs/results.md) to stdout
    python tools/sm12x_compile.py --json out.json # the full records, for tests/kernels_triton
    python tools/sm12x_compile.py --arch 120 --jobs 2

A build is one kernel with its tile (the SM12x tables of kernels_triton.tuning) and its format's constexprs. Each is
compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` in a worker
process with TRITON_INTERPRET=0 and a fresh Triton cache (so ptxas runs and its -v report is
read). Pointer arguments and every integer but M are marked divisible by 16, as Triton's launcher
specializes them for real shapes (without it the loads are not vectorized and the register counts
mean nothing); strides equal to 1 are constants, as the launcher makes them.

Per build: the mma.sync instructions in the PTX, registers, spill stores/loads, stack frame and
shared memory (Triton's allocation, metadata.shared), and ``fits``: shared <= 101,376 B, no spills,
registers * threads <= 65,536.

A kernel that takes ``USE_PDL`` (kernels_triton.hopper._pdl) is compiled as SM12x launches it, with
``USE_PDL=True`` and ``launch_pdl``, and its PTX must hold ``griddepcontrol.wait`` and
``griddepcontrol.launch_dependents``, the wait before the first global load, store or
``cp.async`` (``pdl_wait_first``). Besides the GEMMs, the rest of the decode chain is built the
same way ("chain" rows): the activation quantizers that take USE_PDL, at their decode tile.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHES = (120, 121)
SMEM_LIMIT = 101_376
REGS_PER_SM = 65_536

# what the PTX must hold (all of ``want``) and must not hold (any of ``avoid``)
NATIVE_AVOID = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",  # the bf16 fallback
                "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")  # plain (half-rate) fp8
WANT = {
    "nvfp4": ("kind::mxf4nvf4.block_scale.scale_vec::4X", "e2m1.e2m1.f32.ue4m3"),
    "mxfp4": ("kind::mxf4nvf4.block_scale.scale_vec::2X", "e2m1.e2m1.f32.ue8m0"),
    "e4m3": ("kind::mxf8f6f4.block_scale.scale_vec::1X", "e4m3.e4m3.f32.ue8m0"),
    "bf16": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",),
    "tf32": ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",),
}
PDL_WANT = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")


@dataclass
class Build:
    name: str  # "<fmt> <path> <row>[ split]"
    fmt: str
    path: str  # native | portable
    row: str  # the table row (decode / small / medium / large / prepass)
    kernel: str  # "module:attr" in kernels_triton
    tile: str
    num_warps: int
    num_stages: int
    want: tuple = ()
    avoid: tuple = ()
    types: dict = field(default_factory=dict)  # non-default pointer types
    constexprs: dict = field(default_factory=dict)


def _native_e4m3(fmt, kernel, kind, extra, row, cfg, split, types=None):
    c = dict(HAS_BIAS=True, ROUND_BF16=False, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
             GROUP_M=cfg.GROUP_M, **extra)
    return Build(f"{fmt}{'' if kind == fmt else ' ' + kind} native {row}{' split' if split else ''}", fmt, "native",
                 row, kernel, str(cfg), cfg.num_warps, cfg.num_stages, WANT["e4m3"], NATIVE_AVOID,
                 types or {}, c)


def builds() -> list[Build]:
    """Every build the SM12x tables can select (pure Python: nothing is compiled here)."""
    sys.path.insert(0, ROOT)
    from formats import FORMAT_NAMES, spec
    from kernels_triton import tuning  # the SM12x tile tables

    out = []
    for fmt in FORMAT_NAMES:
        s = spec(fmt)
        fp4 = s.element == "e2m1"
        e4m3_scales = s.scale.startswith("e4m3")
        native_kinds = ["e2m1"] if fp4 else (["fp8_block", "e4m3"] if fmt == "fp8_block" else ["e4m3"])
        for kind in native_kinds:
            for row, cfg in tuning.sm12x_entries(kind).items():
                for split in (False,):  # the SM12x tables do not split K
                    if fp4:
                        # each FP4 lesson has its own native kernel; swizzled weight scales only change
                        # its scale addresses, so both layouts are built for nvfp4 (e4m3) and linear for mxfp4
                        for swz in ((False, True) if e4m3_scales else (False,)):
                            c = dict(W_SWIZZLED=swz, HAS_BIAS=True, ROUND_BF16=False, BLOCK_M=cfg.BLOCK_M,
                                     BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M)
                            name = f"{fmt} native {row}{' swizzled' if swz else ''}"
                            out.append(Build(name, fmt, "native", row, f"{fmt}:_native_gemm_kernel", str(cfg),
                                             cfg.num_warps, cfg.num_stages, WANT[fmt], NATIVE_AVOID,
                                             {"gx_ptr": "*fp32", "gw_ptr": "*fp32"} if e4m3_scales else {}, c))
                    elif fmt == "fp8_block":
                        out.append(_native_e4m3(fmt, "fp8_block:_native_gemm_kernel", "ue8m0" if kind == "e4m3"
                                                else fmt, dict(UE8M0=kind == "e4m3"), row, cfg, split,
                                                {"sx_ptr": "*fp32", "sw_ptr": "*fp32"}))
                    elif fmt in ("fp8_tensor", "fp8_channel"):  # fp32 scales in the epilogue
                        out.append(_native_e4m3(fmt, f"{fmt}:_native_gemm_kernel", fmt, {}, row, cfg, split,
                                                {"sx_ptr": "*fp32", "sw_ptr": "*fp32"}))
                    else:
                        for swz in (False, True):
                            b = _native_e4m3(fmt, f"{fmt}:_native_gemm_kernel", fmt, dict(W_SWIZZLED=swz),
                                             row, cfg, split)
                            b.name += " swizzled" if swz else ""
                            out.append(b)
        if fmt == "mxfp8":
            # W8A16: the lesson's portable kernel (bf16 x, the weight decoded in registers) with the
            # SM12x "e4m3_portable" table, bf16 and fp16 (split into two bf16 dots) activations
            for row, cfg in tuning.sm12x_entries("e4m3_portable").items():
                for act in ("bf16", "fp16"):
                    c = dict(A16=True, SPLIT_A16=act == "fp16", HAS_BIAS=True, DOT_BF16=True, ROUND_BF16=False,
                             BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                             stride_xk=1, stride_wk=1, stride_sxk=1, stride_swk=1, stride_yn=1)
                    out.append(Build(f"{fmt} W8A16 {act} portable {row}", fmt, "portable", row,
                                     f"{fmt}:_portable_gemm_kernel", str(cfg), cfg.num_warps, cfg.num_stages,
                                     WANT["bf16"], (), {"x_ptr": f"*{act}"}, c))
        if not fp4:
            continue
        # W4A16: the lesson's portable kernel with the SM12x "e2m1_portable" table, bf16 and fp16
        # activations
        for row, cfg in tuning.sm12x_entries("e2m1_portable").items():
            for act in ("bf16", "fp16"):
                c = dict(A16=True, SPLIT_A16=act == "fp16", HAS_BIAS=True, DOT_DTYPE="bf16", ROUND_BF16=False,
                         BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                         stride_ak=1)
                out.append(Build(f"{fmt} W4A16 {act} portable {row}", fmt, "portable", row,
                                 f"{fmt}:_portable_gemm_kernel", str(cfg), cfg.num_warps, cfg.num_stages,
                                 WANT["bf16"], (),
                                 {"a_ptr": f"*{act}", **({"gx_ptr": "*fp32", "gw_ptr": "*fp32"} if e4m3_scales
                                                         else {})}, c))
    return out + chain_builds() + moe_builds()


def chain_builds() -> list[Build]:
    """The decode chain's kernels other than the GEMMs: none on SM12x, where the lessons run and
    launch without PDL (the PDL chains are kernels_triton.hopper's, sm_90 only). Kept so that a
    chain kernel added to a lesson is built here (PDL_WANT checked)."""
    return []


def moe_builds() -> list[Build]:
    """kernels_triton.moe as SM12x launches it with its default GPU tiles (top_k 8 of 128 experts;
    M = 64 tokens: BLOCK_M 16, 512: 32, 4096: 64): the grouped GEMM for W13 (gate and up, the
    activation in the epilogue) and W2 (router weights, scatter), natively for each format and
    portably (TF32) for the weight-only variants; the activation quantizer and the amax kernel."""
    sys.path.insert(0, ROOT)
    from formats import spec
    from kernels_triton import moe

    out = []
    for fmt, a16 in [(f, False) for f in moe.FORMATS] + [(f, True) for f in moe.A16_FORMATS]:
        path = "portable" if a16 else "native"
        fp32_scales = {"sa_ptr": "*fp32", "sw_ptr": "*fp32"} if fmt in ("fp8_block", "fp8_channel") else {}
        for M, gated in ((4096, True), (512, True), (64, True), (4096, False), (64, False)):  # BLOCK_M 64, 32, 16
            cfg = moe.tile_config(M, 128, 8, 4096, 1536, fmt, path, (12, 0))
            types = {"ta_ptr": "*fp32", "tw_ptr": "*fp32", "bias_ptr": "*fp32", "topk_w_ptr": "*fp32",
                     "slot_ptr": "*i32", "expert_ptr": "*i32", "alpha": "fp32", "limit": "fp32",
                     "out_ptr": "*bf16" if gated and a16 else "*fp32", **fp32_scales}
            if a16:
                types["a_ptr"] = "*bf16"
            c = dict(FMT=moe.FORMATS.index(fmt), VEC=(spec(fmt).activation_block or (1, 32))[1] or 1, NATIVE=not a16,
                     A16=a16, GATHER=a16 and gated, GATED=gated, ACT=1 if gated else 0, HAS_BIAS=True, TOP_K=8,
                     BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K)
            want = WANT["tf32"] if a16 else WANT["e4m3" if spec(fmt).element == "e4m3" else fmt]
            out.append(Build(f"moe {fmt}{' weight-only' if a16 else ''} {path} {'W13' if gated else 'W2'} M={M}", fmt,
                             path, "moe", "moe:_grouped_gemm_kernel", str(cfg), cfg.num_warps, cfg.num_stages,
                             want, () if a16 else NATIVE_AVOID, types, c))
        if a16:
            continue
        # the activation quantizer of each GEMM input (x gathered by token, or the fp32 intermediate),
        # with the per-expert amax reduction where the format has a dynamic per-tensor value
        for gather in (True, False):
            types = {"src_ptr": "*bf16" if gather else "*fp32", "slot_ptr": "*i32", "expert_ptr": "*i32",
                     "first_block_ptr": "*i32", "partial_ptr": "*fp32", "static_ptr": "*fp32", "t_ptr": "*fp32",
                     "s_ptr": "*fp32" if fmt in ("fp8_block", "fp8_channel") else "*u8"}
            dynamic = fmt in moe.DYNAMIC_AMAX
            c = dict(FMT=moe.FORMATS.index(fmt), VEC=(spec(fmt).activation_block or (1, 32))[1] or 1, RULE=0,
                     DYNAMIC=dynamic, GATHER=gather, TOP_K=8, BLOCK_M=cfg.BLOCK_M, BLOCK_K=128, BLOCK_P=16)
            out.append(Build(f"moe {fmt} quantize {'x' if gather else 'intermediate'}", fmt, "quantize", "moe",
                             "moe:_quantize_kernel", f"{cfg.BLOCK_M}x128", 4, 2, (), (), types, c))
            if fmt in ("fp8_tensor", "fp8_channel"):  # the amax kernel: per block, or per row (ROWS)
                rows = fmt == "fp8_channel"
                out.append(Build(f"moe amax{' rows' if rows else ''} {'x' if gather else 'intermediate'}", fmt,
                                 "quantize", "moe", "moe:_amax_kernel", f"{cfg.BLOCK_M}x128", 4, 2, (), (),
                                 {k: types[k] for k in ("src_ptr", "slot_ptr", "expert_ptr", "partial_ptr")},
                                 dict(ROWS=rows, GATHER=gather, TOP_K=8, BLOCK_M=cfg.BLOCK_M, BLOCK_K=128)))
    return out


def _signature(fn, b: Build) -> tuple[dict, dict, dict]:
    import triton.language as tl

    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in b.constexprs:
            v = b.constexprs[name]
            const[name] = tl.bfloat16 if v == "bf16" else v
            sig[name] = "constexpr"
            continue
        if name == "USE_PDL":  # SM12x launches the chain kernels with PDL (_pdl.pdl_enabled)
            const[name] = True
            sig[name] = "constexpr"
            continue
        if fn.params[i].is_constexpr and fn.params[i].has_default:
            const[name] = fn.params[i].default
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            default = "*bf16" if name in ("c_ptr", "y_ptr") else "*fp32" if name in ("ws_ptr", "bias_ptr") else "*u8"
            sig[name] = b.types.get(name, default)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = b.types.get(name, "i32")
            if name not in ("M", "n_slots") and sig[name] == "i32":  # n_slots = M * top_k, like M
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def compile_one(job: tuple[dict, int]) -> dict:
    """Compile one build for one arch in this (worker) process; returns the record."""
    bd, arch = job
    b = Build(**bd)
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, attr = b.kernel.split(":")
    fn = getattr(importlib.import_module(f"kernels_triton.{mod}"), attr)
    sig, const, attrs = _signature(fn, b)
    pdl = "USE_PDL" in fn.arg_names
    if pdl:
        b.want = tuple(dict.fromkeys(b.want + PDL_WANT))
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    rec = {**asdict(b), "arch": f"sm_{arch}a", "pdl": pdl}
    rec.pop("types")
    rec["constexprs"] = {k: str(v) for k, v in b.constexprs.items()}
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=b.num_warps, num_stages=b.num_stages, launch_pdl=pdl))
    except Exception as e:  # reported, and the test fails on it
        rec["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        return rec
    ptx, text = k.asm["ptx"], log.getvalue()

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    rec.update(
        mma=sorted(set(re.findall(r"mma\.sync\.aligned\.[\w.:]+", ptx))),
        target=re.search(r"\.target\s+(\S+)", ptx).group(1),
        registers=num(r"Used (\d+) registers"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        stack=num(r"(\d+) bytes stack frame"),
        shared=int(k.metadata.shared),
        threads=32 * b.num_warps,
    )
    rec["missing"] = [w for w in b.want if w not in ptx]
    if pdl:  # PDL's rule (kernels_triton.hopper._pdl): the wait comes before the first global access
        lines = ptx.splitlines()
        first = lambda pred: next((i for i, l in enumerate(lines) if pred(l.strip())), None)  # noqa: E731
        rec["pdl_wait_first"] = (first(lambda l: l.startswith("griddepcontrol.wait")) or 10**9) < (
            first(lambda l: re.match(r"(@!?%p\d+\s+)?(ld\.global|st\.global|cp\.async|atom\.global|red\.global)", l))
            or 10**9)
    rec["forbidden"] = [a for a in b.avoid if a in ptx]
    rec["fits"] = bool(rec["shared"] <= SMEM_LIMIT and rec["spill_stores"] == 0 and rec["spill_loads"] == 0
                       and rec["registers"] is not None and rec["registers"] * rec["threads"] <= REGS_PER_SM)
    return rec


def _worker_init(cache_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions (kernels_triton respects a set value)
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # fresh: ptxas must run to report
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, ROOT)


def run(arches=ARCHES, jobs: int = 2, only: str = "") -> list[dict]:
    todo = [(asdict(b), a) for a in arches for b in builds() if only in b.name]
    for bd, _ in todo:
        bd["want"], bd["avoid"] = tuple(bd["want"]), tuple(bd["avoid"])
    with tempfile.TemporaryDirectory(prefix="sm12x-triton-cache-") as cache:
        # spawn, not fork: a forked worker would inherit kernels already defined for the interpreter
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init,
                                 initargs=(cache,)) as ex:
            return list(ex.map(compile_one, todo, chunksize=4))


def markdown(records: list[dict]) -> str:
    """configuration -> registers / shared memory / spills, one column pair per arch; the MMA in the
    PTX; PDL "yes" where the kernel was built with USE_PDL and its PTX holds both griddepcontrol ops."""
    arches = sorted({r["arch"] for r in records})
    by = {}
    for r in records:
        by.setdefault((r["name"], r["tile"]), {})[r["arch"]] = r
    head = "| configuration | tile | " + " | ".join(f"{a} regs / smem B / spills" for a in arches) + " | MMA | PDL |"
    lines = [head, "|" + "---|" * (4 + len(arches))]
    for (name, tile), per in by.items():
        cells = []
        for a in arches:
            r = per.get(a)
            if r is None or "error" in r:
                cells.append("compile error" if r else "-")
            else:
                cells.append(f"{r['registers']} / {r['shared']} / {r['spill_stores']}" + ("" if r["fits"] else " (does not fit)"))
        any_r = next(iter(per.values()))
        mma = ", ".join(m.replace("mma.sync.aligned.", "") for m in any_r.get("mma", []))
        pdl = "yes" if any_r.get("pdl") and not any(w in any_r.get("missing", PDL_WANT) for w in PDL_WANT) else "-"
        lines.append(f"| {name} | {tile} | " + " | ".join(cells) + (f" | `{mma}` |" if mma else " | - |") + f" {pdl} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, action="append", choices=ARCHES, help="120 and/or 121 (default both)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile processes (default 2)")
    p.add_argument("--json", help="write the records to this file")
    p.add_argument("--only", default="", help="compile only the builds whose name contains this")
    args = p.parse_args(argv)
    records = run(tuple(args.arch or ARCHES), args.jobs, args.only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(markdown(records))
    bad = [r["name"] + " " + r["arch"] for r in records if "error" in r or r["missing"] or r["forbidden"] or not r["fits"]
           or not r.get("pdl_wait_first", True)]
    if bad:
        print(f"\n{len(bad)} builds failed a check: " + "; ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
