"""NVFP4 activation quantizer in CuTe DSL, at any M: packed e2m1 codes, an e4m3 scale per 16
elements and an fp32 global scale (dynamic from the tensor amax, or static).

**Strategy.** Two launches, no host synchronization:

    1. dynamic only: TensorAmax (_launch.py) -> amax_word = bits of max |x|
    2. Nvfp4Quantize, one thread per 16-element block (row m, K-block kb):
         g     = div_rn(2688, max(amax, 2^-100))        dynamic (IEEE division, PTX div.rn.f32)
                 the given g                            static
         thread 0 stores g
         load the block into 16 fp32 registers; amax_b = max(max |x|, 2^-100)
         s     = encode_e4m3(div_rn(amax_b, 6) * g)     (e4m3 byte, RNE, saturating)
         code  = encode_e2m1(div_rn(x * g, decode(s)))  (0 where decode(s) == 0)
         byte_i = code_2i | code_2i+1 << 4              (element 2i in the low nibble)
         s stored at [m, kb] (linear) or at the 128x4 swizzled offset (swizzled=True)

**Capability.** Any CUDA GPU CuTe DSL targets (sm_90a H200, sm_120a / sm_121a): no ``cvt`` to e2m1
or e4m3 (SM100+/SM89+ instructions); the codes come from the bit-arithmetic codecs.

**Shapes and limits.** x bf16/fp16 [M, K] with any strides, K % 16 == 0, any M >= 0 (b12x's CuTe
``quantization.nvfp4`` needs M % 128 and K % 128). Outputs: uint8 codes [M, K/2]; e4m3 scale bytes
[M, K/16] (linear) or flat ``swizzled_size(M, K/16)`` bytes with zero padding; g float32 [1].

**Notes.** The block scale is ``div_rn(amax_b, 6) * g`` as the oracle, not b12x's
``amax * (1/6) * g``, which differs in the last bit for some inputs (docs/cute.md).

**References.** formats/nvfp4.py is the source of truth for numerics (``global_scale_from_amax``,
``quantize``); kernels_triton/nvfp4.py computes the same formula; formats/layout.py for the swizzle.
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from formats.constants import E2M1_MAX, NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR
from formats.validate import nan_unless_positive

from . import _launch as L
from ._codecs import (FLOOR, abs_or_inf, amax_or_nan, decode_e4m3, div_rn, encode_e2m1, encode_e4m3, fmax,
                      nan_if_nonfinite, nan_value, swizzled_offset)


class Nvfp4Quantize:
    """CuTe DSL kernel: packed e2m1 codes + e4m3 scale per 16 + global scale. Knobs: x dtype,
    dynamic (g from the amax word) or static (g read from pG), swizzled scale layout."""

    def __init__(self, x_dtype, dynamic: bool, swizzled: bool):
        self.x_dtype = x_dtype
        self.dynamic = dynamic
        self.swizzled = swizzled

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pS: cute.Pointer, pG: cute.Pointer,
                 pGout: cute.Pointer, pAmax: cute.Pointer, M: Int32, K: Int32,
                 stride_xm: Int64, stride_xk: Int64, stream):
        num_kb = K // NVFP4_BLOCK
        # (M, K) input through both strides; (M, K/2) packed codes, row-major
        mX_mk = cute.make_tensor(pX, cute.make_layout((M, K), stride=(stride_xm, stride_xk)))
        mQ_mkp = cute.make_tensor(pQ, cute.make_layout((M, K // 2), stride=(Int64(K // 2), 1)))
        blocks = M * num_kb
        self.kernel(mX_mk, mQ_mkp, pS, pG, pGout, pAmax, blocks, num_kb).launch(
            grid=((blocks + L.THREADS - 1) // L.THREADS, 1, 1), block=(L.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX_mk: cute.Tensor, mQ_mkp: cute.Tensor, pS: cute.Pointer, pG: cute.Pointer,
               pGout: cute.Pointer, pAmax: cute.Pointer, blocks: Int32, num_kb: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        b = bidx * L.THREADS + tidx
        # ----- the global scale g: every thread derives the same value
        g = Float32(0.0)
        if cutlass.const_expr(self.dynamic):
            amax = cute.make_tensor(pAmax, cute.make_layout(1))[0].bitcast(Float32)
            g = div_rn(Float32(NVFP4_GLOBAL_NUMERATOR), amax_or_nan(amax, Float32(FLOOR)))  # NaN: x held NaN/Inf
        else:
            # a static g tensor is not checked on the host (a sync): a bad one (<= 0, Inf, NaN)
            # becomes NaN, so the codes, g_out and the GEMM's alpha are NaN, never zeros
            g_in = cute.make_tensor(pG, cute.make_layout(1))[0]
            g = nan_if_nonfinite(Float32(cutlass.select_(g_in > Float32(0.0), g_in, nan_value())))
        if b == 0:
            cute.make_tensor(pGout, cute.make_layout(1))[0] = g
        if b < blocks:
            m = b // num_kb
            kb = b % num_kb
            k0 = kb * NVFP4_BLOCK
            # ----- the block in registers, and its amax
            rX = cute.make_rmem_tensor((NVFP4_BLOCK,), Float32)
            amax_b = Float32(0.0)
            for j in cutlass.range_constexpr(NVFP4_BLOCK):
                v = mX_mk[m, k0 + j].to(Float32)
                rX[j] = v
                amax_b = fmax(amax_b, abs_or_inf(v))  # +Inf marks a NaN/Inf in the block
            # ----- the e4m3 block scale and its value
            s_code = encode_e4m3(div_rn(amax_or_nan(amax_b, Float32(FLOOR)), Float32(E2M1_MAX)) * g)
            s_val = decode_e4m3(s_code)
            # codes 0 where the scale is 0 or NaN (0x7F: the block, or the tensor for dynamic g, held
            # a NaN/Inf); the NaN test is on the code, independent of how a NaN compares
            nonzero = (Int32(s_val > Float32(0.0)) * Int32((s_code & Int32(0x7F)) != Int32(0x7F))) != Int32(0)
            safe_s = Float32(cutlass.select_(nonzero, s_val, Float32(1.0)))
            # ----- codes, two per byte (element 2i in the low nibble); 0 where the scale is 0
            for i in cutlass.range_constexpr(NVFP4_BLOCK // 2):
                lo = encode_e2m1(div_rn(rX[2 * i] * g, safe_s))
                hi = encode_e2m1(div_rn(rX[2 * i + 1] * g, safe_s))
                byte = Int32(cutlass.select_(nonzero, lo | (hi << Int32(4)), Int32(0)))
                mQ_mkp[m, kb * (NVFP4_BLOCK // 2) + i] = Uint8(byte)
            # ----- the scale byte
            off = m * num_kb + kb
            if cutlass.const_expr(self.swizzled):
                off = swizzled_offset(m, kb, num_kb)
            mS = cute.make_tensor(pS, cute.make_layout(off + 1))
            mS[off] = Uint8(s_code)


def example_args(x_dtype) -> tuple:
    return (L.fake_ptr(x_dtype, 2), L.fake_ptr(cutlass.Uint8, 1), L.fake_ptr(cutlass.Uint8, 1),
            L.fake_ptr(cutlass.Float32, 4), L.fake_ptr(cutlass.Float32, 4), L.fake_ptr(cutlass.Int32, 4),
            *L.fake_sizes(2), *L.fake_strides(2), L.fake_stream())


def compile_for(arch: str, x_dtype=cutlass.BFloat16, *, dynamic: bool = True, swizzled: bool = False,
                keep_ptx: bool = False):
    """The compiled quantizer for ``arch`` (used by the launcher and by the compile-only tests)."""
    return L.compiled(Nvfp4Quantize, (x_dtype, bool(dynamic), bool(swizzled)), arch,
                      lambda: example_args(x_dtype), keep_ptx=keep_ptx)


def quantize(x2: torch.Tensor, *, global_scale=None, swizzled: bool = False):
    """x2 bf16/fp16 CUDA [M, K] (K % 16 == 0, any strides) -> (uint8 codes [M, K/2], e4m3 scales
    [M, K/16] or flat swizzled, float32 0-d g).

    ``global_scale``: None (dynamic) or a float32 one-element tensor on x2's device (static; a value
    that is not finite and > 0 becomes NaN in the kernel).
    """
    M, K = x2.shape
    device = x2.device
    dynamic = global_scale is None
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=device)
    scale = L.block_scale_bytes(M, K // NVFP4_BLOCK, swizzled, device)
    if M == 0:  # no launch; the oracle's g for an empty tensor is 2688 / AMAX_FLOOR
        if dynamic:
            g = torch.full((), NVFP4_GLOBAL_NUMERATOR / FLOOR, dtype=torch.float32, device=device)  # exact
        else:
            g = nan_unless_positive(global_scale.reshape(()).to(device=device, dtype=torch.float32))  # as the kernel
        return data, scale.view(torch.float8_e4m3fn), g
    arch = L.arch_of(device)
    stream = L.current_stream(device)
    g_out = torch.empty(1, dtype=torch.float32, device=device)
    if dynamic:
        amax = L.ptr(L.launch_amax(x2, arch, stream))
        g_in = L.ptr(g_out)  # never read
    else:
        g_in_t = global_scale.reshape(1).to(device=device, dtype=torch.float32)
        amax = L.ptr(g_out, cutlass.Int32)  # never read
        g_in = L.ptr(g_in_t)
    fn = compile_for(arch, L.TORCH_TO_CUTLASS[x2.dtype], dynamic=dynamic, swizzled=swizzled)
    fn(L.ptr(x2), L.ptr(data), L.ptr(scale), g_in, L.ptr(g_out), amax, Int32(M), Int32(K),
       Int64(x2.stride(0)), Int64(x2.stride(1)), stream)
    return data, scale.view(torch.float8_e4m3fn), g_out.reshape(())
