"""Per-tensor FP8 activation quantizer in CuTe DSL: dynamic (amax) or static scale.

**Strategy.** Two launches, no host synchronization:

    1. TensorAmax (_launch.py): amax_word = bits of max |x|            (one atomic max per warp)
    2. Fp8TensorQuantize, one thread per (row m, 128-column chunk):
         dynamic: scale = div_rn(max(amax, 2^-100), 448)                (IEEE, PTX div.rn.f32)
                  thread 0 stores scale
         static:  scale = the given scale (read from the device, not written back)
         q[m, k] = encode_e4m3(div_rn(x[m, k], scale))                  (RNE, saturating to +-448)

Every program recomputes the same scale from the same amax word, so the codes and the stored scale
agree without a grid-wide barrier (as kernels_triton/fp8_tensor.py's stage 2).

**Capability.** Any CUDA GPU CuTe DSL targets (sm_90a H200, sm_120a / sm_121a): integer and fp32
round-to-nearest arithmetic plus a 32-bit integer atomic max; no SM120-only instruction.

**Shapes and limits.** x bf16/fp16 [M, K] with any strides, any K >= 1 (the last chunk of a row is
partial), M >= 0 (M = 0 launches nothing; the dynamic scale is then the oracle's 2^-100 / 448).
Outputs: e4m3 codes [M, K] contiguous and a 0-d fp32 scale.

**Notes.** The amax needs a zeroed int32 word (a torch.zeros launch) before stage 1. Non-negative
float32 values order as their int32 bit patterns, so an integer atomic max is an exact float max.

**References.** formats/fp8_tensor.py is the source of truth for numerics (``tensor_scale``,
``quantize``); kernels_triton/fp8_tensor.py computes the same formula with two-stage partial maxima.
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from formats.constants import E4M3_MAX

from . import _launch as L
from ._codecs import FLOOR, amax_or_nan, div_rn, encode_e4m3, nan_if_nonfinite


class Fp8TensorQuantize:
    """CuTe DSL kernel: e4m3 codes with one fp32 scale. Knobs: x dtype, dynamic (scale from the amax
    word) or static (scale read from pScale)."""

    def __init__(self, x_dtype, dynamic: bool):
        self.x_dtype = x_dtype
        self.dynamic = dynamic

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pScale: cute.Pointer, pAmax: cute.Pointer,
                 M: Int32, K: Int32, stride_xm: Int64, stride_xk: Int64, stream):
        # (M, K) input through both strides; (M, K) codes, row-major
        mX_mk = cute.make_tensor(pX, cute.make_layout((M, K), stride=(stride_xm, stride_xk)))
        mQ_mk = cute.make_tensor(pQ, cute.make_layout((M, K), stride=(Int64(K), 1)))
        num_chunks = (K + L.CHUNK - 1) // L.CHUNK
        total = M * num_chunks
        self.kernel(mX_mk, mQ_mk, pScale, pAmax, M, K, num_chunks).launch(
            grid=((total + L.THREADS - 1) // L.THREADS, 1, 1), block=(L.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX_mk: cute.Tensor, mQ_mk: cute.Tensor, pScale: cute.Pointer, pAmax: cute.Pointer,
               M: Int32, K: Int32, num_chunks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        idx = bidx * L.THREADS + tidx
        mScale = cute.make_tensor(pScale, cute.make_layout(1))
        # ----- the scale: every thread derives the same value
        scale = Float32(0.0)
        if cutlass.const_expr(self.dynamic):
            mAmax = cute.make_tensor(pAmax, cute.make_layout(1))
            amax = mAmax[0].bitcast(Float32)
            scale = div_rn(amax_or_nan(amax, Float32(FLOOR)), Float32(E4M3_MAX))  # NaN: x held NaN/Inf
            if idx == 0:
                mScale[0] = scale
        else:
            scale = mScale[0]
        # ----- the codes of one (row, chunk)
        if idx < M * num_chunks:
            m = idx // num_chunks
            k0 = (idx % num_chunks) * L.CHUNK
            n = cutlass.min(K - k0, L.CHUNK)
            for j in cutlass.range(n):
                # NaN/Inf (or any element under a NaN scale) -> the NaN code 0x7F
                mQ_mk[m, k0 + j] = Uint8(encode_e4m3(div_rn(nan_if_nonfinite(mX_mk[m, k0 + j].to(Float32)), scale)))


def example_args(x_dtype) -> tuple:
    return (L.fake_ptr(x_dtype, 2), L.fake_ptr(cutlass.Uint8, 1), L.fake_ptr(cutlass.Float32, 4),
            L.fake_ptr(cutlass.Int32, 4), *L.fake_sizes(2), *L.fake_strides(2), L.fake_stream())


def compile_for(arch: str, x_dtype=cutlass.BFloat16, *, dynamic: bool = True, keep_ptx: bool = False):
    """The compiled quantizer for ``arch`` (used by the launcher and by the compile-only tests)."""
    return L.compiled(Fp8TensorQuantize, (x_dtype, bool(dynamic)), arch, lambda: example_args(x_dtype),
                      keep_ptx=keep_ptx)


def quantize(x2: torch.Tensor, *, scale=None):
    """x2 bf16/fp16 CUDA [M, K] (any strides) -> (e4m3 codes [M, K], fp32 0-d scale).

    ``scale``: None (dynamic) or a checked positive float32 0-d tensor on x2's device (static; it is
    returned as the scale, as the oracle and kernels_triton do).
    """
    M, K = x2.shape
    device = x2.device
    data = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=device)
    dynamic = scale is None
    if dynamic:
        s = torch.empty((), dtype=torch.float32, device=device)
    else:
        s = scale.reshape(()).to(device=device, dtype=torch.float32)
    if M == 0:
        if dynamic:  # the oracle's scale of an empty tensor: the amax floor over 448
            from formats.base import ieee_div

            s = ieee_div(torch.full((), FLOOR, dtype=torch.float32, device=device), E4M3_MAX)
        return data, s
    arch = L.arch_of(device)
    stream = L.current_stream(device)
    # static: the amax pointer is never read; s's address stands in for it
    amax = L.ptr(L.launch_amax(x2, arch, stream)) if dynamic else L.ptr(s, cutlass.Int32)
    fn = compile_for(arch, L.TORCH_TO_CUTLASS[x2.dtype], dynamic=dynamic)
    fn(L.ptr(x2), L.ptr(data.view(torch.uint8)), L.ptr(s), amax, Int32(M), Int32(K),
       Int64(x2.stride(0)), Int64(x2.stride(1)), stream)
    return data, s
