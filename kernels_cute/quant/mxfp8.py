"""MXFP8 activation quantizer in CuTe DSL: e4m3 codes + one E8M0 scale per 32 elements.

**Strategy.** One thread per 32-element block (row m, K-block kb), a 1-D grid over M * K/32 blocks:

    load the block into 32 fp32 registers; amax = max(max |x|, 2^-100)
    e = ceil_log2(div_rn(amax, 448))        scale_rule="ceil" (default; IEEE division, div.rn.f32)
        floor_log2(amax) - 8                scale_rule="floor" (OCP MX v1.0 section 6.3)
    e = clamp(e, -127, 127)
    code_j = encode_e4m3(x_j * 2^-e)        (a power-of-two product: exact, or one correctly
                                            rounded subnormal as the oracle's float64 ldexp cast)
    scale  = e + 127                        (E8M0 byte) at [m, kb] (linear) or at the 128x4
                                            swizzled offset (swizzled=True, b12x's layout)

An all-zero block has amax = 2^-100, so e = ceil_log2(2^-100 / 448) = -108 and the byte is 19 with
zero codes, as the oracle (formats/_mx.py); b12x's own MXFP8 quantizer writes byte 0 there
(docs/cute.md), which is why this one exists.

**Capability.** Any CUDA GPU CuTe DSL targets (sm_90a H200, sm_120a / sm_121a): the e4m3 codes come
from the bit-arithmetic codec, not SM89+ ``cvt.rn.satfinite.e4m3x2``.

**Shapes and limits.** x bf16/fp16 [M, K] with any strides, K % 32 == 0, M >= 0. Outputs: e4m3 codes
[M, K] contiguous; uint8 E8M0 scales [M, K/32] (linear) or flat ``swizzled_size(M, K/32)`` bytes
whose padding is zero (as ``formats.swizzle_128x4`` with pad_value=0).

**Notes.** The multiply by 2^-e must keep subnormals (no ``.ftz``): the compile tests check the PTX.

**References.** formats/mxfp8.py and formats/_mx.py are the source of truth for numerics;
kernels_triton/mxfp8.py computes the same formula; kernels_cute/quant/mxfp4.py is the same kernel
with e2m1 codes; formats/layout.py for the swizzle.
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from formats.constants import E4M3_EMAX, E4M3_MAX, MX_BLOCK

from . import _launch as L
from ._codecs import (FLOOR, abs_or_inf, ceil_log2, clamp_int, div_rn, encode_e4m3, exp2_int, floor_log2, fmax,
                      nan_value, not_finite, swizzled_offset)

SCALE_RULES = L.SCALE_RULES


class Mxfp8Quantize:
    """CuTe DSL kernel: e4m3 codes + E8M0 bytes per 32. Knobs: x dtype, ceil rule, swizzled."""

    def __init__(self, x_dtype, ceil_rule: bool, swizzled: bool):
        self.x_dtype = x_dtype
        self.ceil_rule = ceil_rule
        self.swizzled = swizzled

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pS: cute.Pointer, M: Int32, K: Int32,
                 stride_xm: Int64, stride_xk: Int64, stream):
        num_kb = K // MX_BLOCK
        # (M, K) input through both strides; (M, K) codes, row-major
        mX_mk = cute.make_tensor(pX, cute.make_layout((M, K), stride=(stride_xm, stride_xk)))
        mQ_mk = cute.make_tensor(pQ, cute.make_layout((M, K), stride=(Int64(K), 1)))
        blocks = M * num_kb
        self.kernel(mX_mk, mQ_mk, pS, blocks, num_kb).launch(
            grid=((blocks + L.THREADS - 1) // L.THREADS, 1, 1), block=(L.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX_mk: cute.Tensor, mQ_mk: cute.Tensor, pS: cute.Pointer, blocks: Int32, num_kb: Int32):
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
                e = ceil_log2(div_rn(amax, Float32(E4M3_MAX)))
            else:
                e = floor_log2(amax) - Int32(E4M3_EMAX)
            e = clamp_int(e, -127, 127)
            inv = Float32(cutlass.select_(bad, nan_value(), exp2_int(-e)))  # bad block: codes 0x7F
            # ----- codes
            for j in cutlass.range_constexpr(MX_BLOCK):
                mQ_mk[m, k0 + j] = Uint8(encode_e4m3(rX[j] * inv))
            # ----- the E8M0 byte
            off = m * num_kb + kb
            if cutlass.const_expr(self.swizzled):
                off = swizzled_offset(m, kb, num_kb)
            mS = cute.make_tensor(pS, cute.make_layout(off + 1))
            mS[off] = Uint8(cutlass.select_(bad, Int32(0xFF), e + Int32(127)))  # 0xFF: NaN byte


def compile_for(arch: str, x_dtype=cutlass.BFloat16, *, scale_rule: str = "ceil", swizzled: bool = False,
                keep_ptx: bool = False):
    """The compiled quantizer for ``arch`` (used by the launcher and by the compile-only tests)."""
    return L.compiled(Mxfp8Quantize, (x_dtype, L.ceil_rule(scale_rule), bool(swizzled)), arch,
                      lambda: L.rowwise_example_args(x_dtype), keep_ptx=keep_ptx)


def quantize(x2: torch.Tensor, *, scale_rule: str = "ceil", swizzled: bool = False):
    """x2 bf16/fp16 CUDA [M, K] (K % 32 == 0, any strides) -> (float8_e4m3fn codes [M, K], uint8 E8M0
    scales [M, K/32], or flat swizzled bytes when ``swizzled``)."""
    M, K = x2.shape
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
    scale = L.block_scale_bytes(M, K // MX_BLOCK, swizzled, x2.device)
    if M:
        fn = compile_for(L.arch_of(x2.device), L.TORCH_TO_CUTLASS[x2.dtype], scale_rule=scale_rule, swizzled=swizzled)
        L.launch_rowwise(fn, x2, data, scale)
    return data, scale
