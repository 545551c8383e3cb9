"""MXFP4 activation quantizer in CuTe DSL: packed e2m1 codes + one E8M0 scale per 32 elements.

**Strategy.** One thread per 32-element block (row m, K-block kb), a 1-D grid over M * K/32 blocks:

    load the block into 32 fp32 registers; amax = max(max |x|, 2^-100)
    e = ceil_log2(div_rn(amax, 6))          scale_rule="ceil" (default; IEEE division, div.rn.f32)
        floor_log2(amax) - 2                scale_rule="floor" (OCP MX v1.0 section 6.3)
    e = clamp(e, -127, 127)
    code_j = encode_e2m1(x_j * 2^-e)        (a power-of-two product: exact, or one correctly
                                            rounded subnormal as the oracle's float64 ldexp cast)
    byte_i = code_2i | code_2i+1 << 4       (element 2i in the low nibble), 16 bytes per block
    scale  = e + 127                        (E8M0 byte) at [m, kb] (linear) or at the 128x4
                                            swizzled offset (swizzled=True, b12x's layout)

**Capability.** Any CUDA GPU CuTe DSL targets (sm_90a H200, sm_120a / sm_121a). The e2m1 codes are
computed with comparisons, not SM100+/SM120 ``cvt.rn.satfinite.e2m1x2``.

**Shapes and limits.** x bf16/fp16 [M, K] with any strides, K % 32 == 0, M >= 0. Outputs: uint8 codes
[M, K/2] contiguous; uint8 E8M0 scales [M, K/32] (linear) or flat ``swizzled_size(M, K/32)`` bytes
whose padding is zero (as ``formats.swizzle_128x4`` with pad_value=0).

**Notes.** The multiply by 2^-e must keep subnormals (no ``.ftz``): the compile tests check the PTX.

**References.** formats/mxfp4.py and formats/_mx.py are the source of truth for numerics;
kernels_triton/mxfp4.py ``_quantize_kernel`` computes the same formula; formats/layout.py for the
swizzle.
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from formats.constants import E2M1_EMAX, E2M1_MAX, MX_BLOCK

from . import _launch as L
from ._codecs import (FLOOR, abs_or_inf, ceil_log2, clamp_int, div_rn, encode_e2m1, exp2_int, floor_log2, fmax,
                      not_finite, swizzled_offset)

SCALE_RULES = L.SCALE_RULES


class Mxfp4Quantize:
    """CuTe DSL kernel: packed e2m1 codes + E8M0 bytes per 32. Knobs: x dtype, ceil rule, swizzled."""

    def __init__(self, x_dtype, ceil_rule: bool, swizzled: bool):
        self.x_dtype = x_dtype
        self.ceil_rule = ceil_rule
        self.swizzled = swizzled

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pS: cute.Pointer, M: Int32, K: Int32,
                 stride_xm: Int64, stride_xk: Int64, stream):
        num_kb = K // MX_BLOCK
        # (M, K) input through both strides; (M, K/2) packed codes, row-major
        mX_mk = cute.make_tensor(pX, cute.make_layout((M, K), stride=(stride_xm, stride_xk)))
        mQ_mkp = cute.make_tensor(pQ, cute.make_layout((M, K // 2), stride=(Int64(K // 2), 1)))
        blocks = M * num_kb
        self.kernel(mX_mk, mQ_mkp, pS, blocks, num_kb).launch(
            grid=((blocks + L.THREADS - 1) // L.THREADS, 1, 1), block=(L.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX_mk: cute.Tensor, mQ_mkp: cute.Tensor, pS: cute.Pointer, blocks: Int32, num_kb: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        b = bidx * L.THREADS + tidx
        if b < blocks:
            m = b // num_kb
            kb = b % num_kb
            k0 = kb * MX_BLOCK
            # ----- the block in registers, and its amax
            rX = cute.make_rmem_tensor((MX_BLOCK,), Float32)
            amax = Float32(0.0)
            for j in cutlass.range_constexpr(MX_BLOCK):
                v = mX_mk[m, k0 + j].to(Float32)
                rX[j] = v
                amax = fmax(amax, abs_or_inf(v))  # +Inf marks a NaN/Inf in the block
            bad = not_finite(amax)
            amax = fmax(amax, Float32(FLOOR))
            # ----- the shared exponent e (scale 2^e)
            e = Int32(0)
            if cutlass.const_expr(self.ceil_rule):
                e = ceil_log2(div_rn(amax, Float32(E2M1_MAX)))
            else:
                e = floor_log2(amax) - Int32(E2M1_EMAX)
            e = clamp_int(e, -127, 127)
            inv = exp2_int(-e)
            # ----- codes, two per byte (element 2i in the low nibble)
            for i in cutlass.range_constexpr(MX_BLOCK // 2):
                lo = encode_e2m1(rX[2 * i] * inv)
                hi = encode_e2m1(rX[2 * i + 1] * inv)
                # a bad block (NaN byte 0xFF) has all-zero codes: e2m1 has no NaN
                mQ_mkp[m, kb * (MX_BLOCK // 2) + i] = Uint8(cutlass.select_(bad, Int32(0), lo | (hi << Int32(4))))
            # ----- the E8M0 byte
            off = m * num_kb + kb
            if cutlass.const_expr(self.swizzled):
                off = swizzled_offset(m, kb, num_kb)
            mS = cute.make_tensor(pS, cute.make_layout(off + 1))
            mS[off] = Uint8(cutlass.select_(bad, Int32(0xFF), e + Int32(127)))  # 0xFF: NaN byte


def compile_for(arch: str, x_dtype=cutlass.BFloat16, *, scale_rule: str = "ceil", swizzled: bool = False,
                keep_ptx: bool = False):
    """The compiled quantizer for ``arch`` (used by the launcher and by the compile-only tests)."""
    return L.compiled(Mxfp4Quantize, (x_dtype, L.ceil_rule(scale_rule), bool(swizzled)), arch,
                      lambda: L.rowwise_example_args(x_dtype), keep_ptx=keep_ptx)


def quantize(x2: torch.Tensor, *, scale_rule: str = "ceil", swizzled: bool = False):
    """x2 bf16/fp16 CUDA [M, K] (K % 32 == 0, any strides) -> (uint8 codes [M, K/2], uint8 E8M0
    scales [M, K/32], or flat swizzled bytes when ``swizzled``)."""
    M, K = x2.shape
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=x2.device)
    scale = L.block_scale_bytes(M, K // MX_BLOCK, swizzled, x2.device)
    if M:
        fn = compile_for(L.arch_of(x2.device), L.TORCH_TO_CUTLASS[x2.dtype], scale_rule=scale_rule, swizzled=swizzled)
        L.launch_rowwise(fn, x2, data, scale)
    return data, scale
