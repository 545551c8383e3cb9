"""1x128 block FP8 activation quantizer in CuTe DSL (DeepSeek-V3 / DeepGEMM activations).

**Strategy.** One thread per 1x128 group (row m, K-block kb), a 1-D grid over M * K/128 groups:

    amax  = max |x[m, kb*128 : kb*128+128]|                          (pass 1; bf16/fp16 -> fp32 exact)
    scale = div_rn(max(amax, 2^-100), 448)                           (IEEE division, PTX div.rn.f32)
    ue8m0: scale = 2^clamp(ceil_log2(scale), -126, 127)              (exponent bits, exact)
    q     = encode_e4m3(div_rn(x, scale))                            (pass 2; bit arithmetic, RNE, saturating)
    store q[m, kb*128 + j] (e4m3 bytes) and scale[m, kb] (fp32, the oracle's linear [M, K/128])

**Capability.** Any CUDA GPU CuTe DSL targets (sm_90a H200, sm_100a, sm_120a / sm_121a): integer and
fp32 round-to-nearest arithmetic only, no SM120-only instruction.

**Shapes and limits.** x bf16/fp16 [M, K] with any strides, K % 128 == 0, M >= 0 (M = 0 launches
nothing). Outputs: e4m3 codes [M, K] contiguous, fp32 scales [M, K/128] contiguous (compact, the
layout b12x's ``mm_block_fp8`` takes). Indices are 64-bit in memory, 32-bit for the group count
(M * K/128 < 2^31).

**Notes.** Readable first: one thread reads its 128 elements twice (amax, then codes; the second
read hits the cache), one element per load, so a warp's loads are not coalesced into wide
transactions. Two dynamic loops (unrolled 8x) rather than 128 registers keep the compile fast. The codecs are ``kernels_cute/quant/_codecs.py``,
ports of ``kernels_triton/_common.py``.

**References.** formats/fp8_block.py is the source of truth for numerics (``quantize(..., role=
"activation")``); kernels_triton/fp8_block.py ``_quantize_kernel`` computes the same formula.
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from formats.constants import E4M3_MAX, FP8_BLOCK

from . import _launch as L
from ._codecs import FLOOR, abs_or_inf, amax_or_nan, ceil_log2, clamp_int, div_rn, encode_e4m3, exp2_int, fmax, is_finite

GROUP = FP8_BLOCK  # 128 elements of one row share a scale


class Fp8BlockQuantize:
    """CuTe DSL kernel: e4m3 codes + fp32 scale per 1x128 group. Knobs: x dtype, ue8m0."""

    def __init__(self, x_dtype, ue8m0: bool):
        self.x_dtype = x_dtype
        self.ue8m0 = ue8m0

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pS: cute.Pointer, M: Int32, K: Int32,
                 stride_xm: Int64, stride_xk: Int64, stream):
        num_kb = K // GROUP
        # (M, K) input through both strides; (M, K) codes and (M, K/128) scales, row-major
        mX_mk = cute.make_tensor(pX, cute.make_layout((M, K), stride=(stride_xm, stride_xk)))
        mQ_mk = cute.make_tensor(pQ, cute.make_layout((M, K), stride=(Int64(K), 1)))
        mS_mkb = cute.make_tensor(pS, cute.make_layout((M, num_kb), stride=(Int64(num_kb), 1)))
        groups = M * num_kb
        self.kernel(mX_mk, mQ_mk, mS_mkb, groups, num_kb).launch(
            grid=((groups + L.THREADS - 1) // L.THREADS, 1, 1), block=(L.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX_mk: cute.Tensor, mQ_mk: cute.Tensor, mS_mkb: cute.Tensor, groups: Int32, num_kb: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        g = bidx * L.THREADS + tidx
        if g < groups:
            m = g // num_kb
            kb = g % num_kb
            k0 = kb * GROUP
            # ----- pass 1: the group's amax
            amax = Float32(0.0)
            for j in cutlass.range(GROUP, unroll=8):
                amax = fmax(amax, abs_or_inf(mX_mk[m, k0 + j].to(Float32)))  # +Inf marks NaN/Inf
            # ----- the scale (IEEE division by 448; optionally rounded up to a power of two)
            scale = div_rn(amax_or_nan(amax, Float32(FLOOR)), Float32(E4M3_MAX))  # NaN: codes 0x7F
            if cutlass.const_expr(self.ue8m0):
                scale = Float32(cutlass.select_(is_finite(scale), exp2_int(clamp_int(ceil_log2(scale), -126, 127)), scale))
            mS_mkb[m, kb] = scale
            # ----- pass 2: the codes (the group is read again; it is in L1/L2 by now)
            for j in cutlass.range(GROUP, unroll=8):
                mQ_mk[m, k0 + j] = Uint8(encode_e4m3(div_rn(mX_mk[m, k0 + j].to(Float32), scale)))


def compile_for(arch: str, x_dtype=cutlass.BFloat16, *, ue8m0: bool = False, keep_ptx: bool = False):
    """The compiled quantizer for ``arch`` (used by the launcher and by the compile-only tests)."""
    return L.compiled(Fp8BlockQuantize, (x_dtype, bool(ue8m0)), arch,
                      lambda: L.rowwise_example_args(x_dtype, cutlass.Float32, 4), keep_ptx=keep_ptx)


def quantize(x2: torch.Tensor, *, ue8m0: bool = False):
    """x2 bf16/fp16 CUDA [M, K] (K % 128 == 0, any strides) -> (e4m3 codes [M, K], fp32 scales [M, K/128])."""
    M, K = x2.shape
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty((M, K // GROUP), dtype=torch.float32, device=x2.device)
    if M:
        fn = compile_for(L.arch_of(x2.device), L.TORCH_TO_CUTLASS[x2.dtype], ue8m0=ue8m0)
        L.launch_rowwise(fn, x2, data, scale)
    return data, scale
