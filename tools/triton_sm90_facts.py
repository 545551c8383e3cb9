"""What this Triton does with kernel shapes the FP8 kernels would need on sm_90 (compile only; with
``--time`` on an sm_90 GPU also a timing). docs/perf_notes.md, "Issue 13, fourth session", cites it.

1. Warp specialization of an fp8 wgmma K loop (`tl.range(..., warp_specialize=True)`): the
   producer / consumer split that the prefill kernels would build on (cuBLAS and DeepGEMM overlap
   the fp32 promotion of one warpgroup with the MMAs of another). Checked with TMA tensor
   descriptors and with pointer loads, at 4 and 8 warps; "partitioned" means the TTGIR holds a
   ``ttg.warp_specialize`` region (the number of partitions and the total warps are printed).
2. A block-scaled K loop whose per-step partial is scaled one step late (part_k is issued, then
   acc += part_{k-1} * s_{k-1}), the form that would overlap fp8_block's scale FMA with the next
   wgmma. Reported: the largest ``wgmma.wait_group`` pending count in the PTX (0 = every wgmma is
   waited for before the next one is issued).
3. ``--time`` (sm_90 GPU): the descriptor kernel of 1 at M = N = K = 8192 (tiles of 128 or 64 rows),
   fp32 promotion every 128 products as fp8_tensor's kernel does, with and without warp_specialize, against
   torch._scaled_mm (use_fast_accum=False) in the same process; do_bench medians (L2 flushed).

    python3 tools/triton_sm90_facts.py [--time]
"""

from __future__ import annotations

import argparse
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
TILE = dict(BM=128, BN=128, BK=128)


@triton.jit
def _descriptor_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       WS: tl.constexpr = True):
    om = (tl.program_id(0) % (M // BM)) * BM
    on = (tl.program_id(0) // (M // BM)) * BN
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WS):
        acc = tl.dot(a_desc.load([om, k0]), tl.trans(b_desc.load([on, k0])), acc, max_num_imprecise_acc=BK)
    offs_m = om + tl.arange(0, BM)
    offs_n = on + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _pointer_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    offs_m = (tl.program_id(0) % (M // BM)) * BM + tl.arange(0, BM)
    offs_n = (tl.program_id(0) // (M // BM)) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=True):
        offs_k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
        b = tl.load(b_ptr + offs_n[:, None] * K + offs_k[None, :])
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BK)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _late_scale_kernel(a_ptr, b_ptr, s_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    offs_m = (tl.program_id(0) % (M // BM)) * BM + tl.arange(0, BM)
    offs_n = (tl.program_id(0) // (M // BM)) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    prev = tl.zeros((BM, BN), tl.float32)
    s_prev = tl.zeros((BM, 1), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
        b = tl.load(b_ptr + offs_n[:, None] * K + offs_k[None, :])
        part = tl.dot(a, tl.trans(b))  # a fresh partial per scale block
        acc += prev * s_prev  # the previous step's partial, while this step's wgmma could run
        prev = part
        s_prev = tl.load(s_ptr + offs_m * (K // BK) + k0 // BK)[:, None]
    acc += prev * s_prev
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


def _compile(fn, num_warps, extra_ptrs=(), **constexprs):
    constexprs = {**TILE, **constexprs}
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", **{p: "*fp32" for p in extra_ptrs}, "c_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", **{k: "constexpr" for k in constexprs}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=SM90,
                          options=dict(num_warps=num_warps, num_stages=3))


def _ws_answer(fn, num_warps, **constexprs) -> str:
    try:
        k = _compile(fn, num_warps, **constexprs)
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return f"fails to compile ({type(e).__name__}: {(lines[0] if lines else '')[:70]})"
    ttgir = k.asm["ttgir"]
    if "ttg.warp_specialize" not in ttgir:
        return "compiles, not partitioned (the hint is dropped)"
    parts = len(set(re.findall(r"partition(\d+)", ttgir)))
    return f"partitioned: {parts} partitions, {k.metadata.num_warps} warps in all"


def facts() -> list[tuple[str, str]]:
    """[(question, answer)] for this Triton (see the module docstring)."""
    rows = []
    for name, fn, extra in (("TMA descriptors", _descriptor_kernel, {"WS": True}), ("pointer loads", _pointer_kernel, {})):
        for nw in (4, 8):
            rows.append((f"warp_specialize, fp8 wgmma loop, {name}, {nw} warps", _ws_answer(fn, nw, **extra)))
    ptx = _compile(_late_scale_kernel, 8, ("s_ptr",)).asm["ptx"]
    pend = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]
    rows.append(("scale one step late: largest wgmma.wait_group pending", str(max(pend, default=-1))))
    return rows


def timings(n: int = 8192):
    """Yields (kernel, 'us (TF/s), rel. diff') at M = N = K = n on the current GPU (module docstring,
    3), one row at a time (a compiler abort then loses only the rows after it)."""
    import torch  # noqa: PLC0415 (only for --time)
    from triton.testing import do_bench  # noqa: PLC0415

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(n, n, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, n, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ref = a.float() @ b.float().T  # fp32 (torch leaves TF32 off for fp32 matmuls by default)

    def row(name, fn):
        try:
            y = fn()
            us = do_bench(fn) * 1e3
            rel = float((y.float() - ref).norm() / ref.norm())
            return name, f"{us:8.1f} us ({2 * n ** 3 / us * 1e-6:6.0f} TF/s), rel. diff vs fp32 {rel:.1e}"
        except Exception as e:  # noqa: BLE001 - a row says why
            return name, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:90] if str(e).strip() else ''}"

    yield row("torch._scaled_mm, use_fast_accum=False", lambda: torch._scaled_mm(
        a, b.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False))
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    # a 128 x 128 fp32 accumulator and its promotion buffer are 256 registers per thread of one
    # warpgroup, so the 4-warp rows also try 64 rows per tile
    for ws in (False, True):
        for bm, nw, st in ((128, 4, 3), (128, 4, 4), (128, 8, 3), (64, 4, 4), (64, 4, 6)):
            tile = dict(TILE, BM=bm)
            grid = ((n // bm) * (n // tile["BN"]),)
            yield row(f"descriptor kernel {bm}x128x128, warp_specialize={ws}, {nw} warps, {st} stages",
                      lambda ws=ws, nw=nw, st=st, tile=tile, grid=grid: (_descriptor_kernel[grid](
                          a, b, c, n, n, n, **tile, WS=ws, num_warps=nw, num_stages=st), c)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time", action="store_true", help="also time the descriptor kernel on this sm_90 GPU")
    args = p.parse_args()
    print(f"Triton {triton.__version__}, target sm_90")
    for q, a in facts():
        print(f"  {q:62s} {a}", flush=True)
    if args.time:
        for q, a in timings():
            print(f"  {q:62s} {a}", flush=True)


if __name__ == "__main__":
    main()
