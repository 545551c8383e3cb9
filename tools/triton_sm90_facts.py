"""What this Triton does with two sm_90 kernel shapes that the FP8 kernels would need (compile only,
no GPU needed; docs/perf_notes.md, "Issue 13, fourth session", cites its output).

1. Warp specialization of an fp8 wgmma K loop (`tl.range(..., warp_specialize=True)`), the
   producer / consumer split that a ping-pong prefill kernel (one warpgroup promotes while the other
   issues MMAs, as cuBLAS and DeepGEMM do) is built on. Checked with TMA tensor descriptors and with
   pointer loads; "partitioned" means the TTGIR holds a ``ttg.warp_specialize`` region.
2. A block-scaled K loop whose per-step partial is scaled one step late (part_k is issued, then
   acc += part_{k-1} * s_{k-1}), the form that would overlap fp8_block's scale FMA with the next
   wgmma. Reported: the largest ``wgmma.wait_group`` pending count in the PTX (0 = every wgmma is
   waited for before the next one is issued).

    python3 tools/triton_sm90_facts.py
"""

from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
TILE = dict(BM=128, BN=128, BK=128)


@triton.jit
def _ws_descriptor_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    om = (tl.program_id(0) % (M // BM)) * BM
    on = (tl.program_id(0) // (M // BM)) * BN
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=True):
        acc = tl.dot(a_desc.load([om, k0]), tl.trans(b_desc.load([on, k0])), acc, max_num_imprecise_acc=BK)
    offs_m = om + tl.arange(0, BM)
    offs_n = on + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _ws_pointer_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
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


def _compile(fn, extra_ptrs=()):
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", **{p: "*fp32" for p in extra_ptrs}, "c_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", **{k: "constexpr" for k in TILE}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(TILE)), target=SM90,
                          options=dict(num_warps=8, num_stages=3))


def facts() -> list[tuple[str, str]]:
    """[(question, answer)] for this Triton (see the module docstring)."""
    rows = []
    for name, fn in (("TMA descriptors", _ws_descriptor_kernel), ("pointer loads", _ws_pointer_kernel)):
        try:
            ttgir = _compile(fn).asm["ttgir"]
            done = "ttg.warp_specialize" in ttgir
            rows.append((f"warp_specialize, fp8 wgmma loop, {name}",
                         "partitioned" if done else "compiles, not partitioned (the hint is dropped)"))
        except Exception as e:  # noqa: BLE001 - the failure is the answer
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            rows.append((f"warp_specialize, fp8 wgmma loop, {name}", f"fails to compile: {msg[:90]}"))
    ptx = _compile(_late_scale_kernel, ("s_ptr",)).asm["ptx"]
    pend = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]
    rows.append(("scale one step late: largest wgmma.wait_group pending", str(max(pend, default=-1))))
    return rows


def main() -> None:
    print(f"Triton {triton.__version__}, target sm_90")
    for q, a in facts():
        print(f"  {q:58s} {a}")


if __name__ == "__main__":
    main()
