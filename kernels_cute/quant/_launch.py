"""What the CuTe DSL quantizers share on the host side: the compile cache, the target arch, pointers
and the stream, the row-wise quantizer's arguments and launch (fp8_block, mxfp8, mxfp4), the block
scale storage and scale rule (mxfp8, mxfp4, nvfp4), and the whole-tensor amax kernel (per-tensor FP8
and NVFP4's global scale).

Every kernel is a small class in the CUTLASS-example shape: ``__init__`` takes the knobs that change
code generation (the input dtype, the scale rule, the scale layout), ``@cute.jit __call__`` builds the
tensors from raw pointers, sizes and strides and launches, ``@cute.kernel kernel`` is the device code.
Sizes and strides are run-time arguments, so one compiled program serves every shape; the compile
cache key is (kernel class, knobs, target arch).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_stream, make_ptr

from formats._mx import SCALE_RULES
from formats.layout import swizzled_size

from ._codecs import abs_or_inf

THREADS = 128  # threads per CTA for every quantizer kernel
CHUNK = 128  # elements per thread in the amax / per-tensor kernels (K need not be a multiple)

TORCH_TO_CUTLASS = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
ARCHES = ("sm_90a", "sm_100a", "sm_120a", "sm_121a")


def cdiv(a, b):
    return (a + b - 1) // b


def arch_of(device: torch.device) -> str:
    """The CuTe DSL target name of a CUDA device: sm_90a on H100/H200, sm_120a on RTX PRO 6000, ..."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def compile_options(arch: str, keep_ptx: bool = False) -> str:
    """Compile options: the target and nothing else (no fast-math flag exists in the options we pass)."""
    return f"--gpu-arch {arch}" + (" --keep-ptx" if keep_ptx else "")


# ---------------------------------------------------------------------------------------------
# Arguments: typed placeholders for compiling, real pointers for launching
# ---------------------------------------------------------------------------------------------
def fake_ptr(dtype, align: int = 16):
    """A placeholder global-memory pointer of ``dtype`` for cute.compile (only the type matters)."""
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def ptr(t: torch.Tensor, dtype=None):
    """A cute global-memory pointer to ``t``'s first element (dtype from the tensor unless given)."""
    dt = dtype if dtype is not None else TORCH_TO_CUTLASS.get(t.dtype)
    if dt is None:
        dt = {torch.uint8: cutlass.Uint8, torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=t.element_size())


def current_stream(device: torch.device):
    """torch's current stream on ``device`` as a cuda.CUstream (kernels are ordered with torch's work)."""
    import cuda.bindings.driver as cuda  # a dependency of nvidia-cutlass-dsl

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


# ---------------------------------------------------------------------------------------------
# Compile cache
# ---------------------------------------------------------------------------------------------
_CACHE: dict = {}
_LOCK = threading.Lock()


def compiled(kernel_cls, knobs: tuple, arch: str, example_args: Callable[[], tuple], *, keep_ptx: bool = False):
    """The compiled program of ``kernel_cls(*knobs)`` for ``arch``, compiled once per process.

    ``example_args()`` gives the placeholder arguments (fake pointers, sizes, a fake stream).
    CUTE_DSL_ARCH is ignored: the target is always the explicit ``--gpu-arch`` option.
    """
    key = (kernel_cls.__name__, knobs, arch, keep_ptx)
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            fn = cute.compile(kernel_cls(*knobs), *example_args(), options=compile_options(arch, keep_ptx))
            _CACHE[key] = fn
    return fn


def fake_sizes(n: int) -> tuple:
    """n placeholder Int32 sizes."""
    return tuple(Int32(1) for _ in range(n))


def fake_strides(n: int) -> tuple:
    """n placeholder Int64 strides."""
    return tuple(Int64(1) for _ in range(n))


def fake_stream():
    return make_fake_stream()


# ---------------------------------------------------------------------------------------------
# Row-wise quantizers: __call__(pX, pQ, pS, M, K, stride_xm, stride_xk, stream)
# ---------------------------------------------------------------------------------------------
def rowwise_example_args(x_dtype, scale_dtype=cutlass.Uint8, scale_align: int = 1) -> tuple:
    """Placeholders for a row-wise quantizer: x (``x_dtype``), 1-byte codes, scales of ``scale_dtype``."""
    return (fake_ptr(x_dtype, 2), fake_ptr(cutlass.Uint8, 1), fake_ptr(scale_dtype, scale_align),
            *fake_sizes(2), *fake_strides(2), fake_stream())


def launch_rowwise(fn, x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Run a compiled row-wise quantizer on x2 [M, K] (M >= 1, any strides) on torch's current stream,
    writing ``codes`` (1-byte elements, e.g. float8_e4m3fn or uint8) and ``scale``."""
    M, K = x2.shape
    fn(ptr(x2), ptr(codes.view(torch.uint8)), ptr(scale), Int32(M), Int32(K),
       Int64(x2.stride(0)), Int64(x2.stride(1)), current_stream(x2.device))


def ceil_rule(scale_rule: str) -> bool:
    """The MX scale-rule knob: True for "ceil", False for "floor" (formats._mx.SCALE_RULES);
    ValueError naming anything else."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    return scale_rule == "ceil"


def block_scale_bytes(M: int, num_kb: int, swizzled: bool, device: torch.device) -> torch.Tensor:
    """uint8 storage for the [M, num_kb] 1-byte block scales: that matrix (linear), or flat
    ``swizzled_size(M, num_kb)`` bytes zeroed first (swizzled; the padding stays zero, as
    ``formats.swizzle_128x4`` with pad_value=0)."""
    if swizzled:
        return torch.zeros(swizzled_size(M, num_kb), dtype=torch.uint8, device=device)
    return torch.empty((M, num_kb), dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# Whole-tensor amax: one atomic max per warp into a zeroed int32 word
# ---------------------------------------------------------------------------------------------
class TensorAmax:
    """amax_word = max over x of |x|, as the int32 bit pattern of a non-negative float32.

    **Strategy.** One thread per (row, CHUNK-column chunk): it reduces its chunk (K need not be a
    multiple of CHUNK), the warp reduces the bit patterns (non-negative floats order as int32), and
    lane 0 does one ``atom.global.max.s32`` into ``amax_word``, which the caller zeroes first. A max is
    exact in any order, so the result does not depend on scheduling.

    **Shapes.** x [M, K] with any strides (Int64), M >= 1, K >= 1; amax_word int32 [1].
    """

    def __init__(self, x_dtype):
        self.x_dtype = x_dtype

    @cute.jit
    def __call__(self, pX: cute.Pointer, pAmax: cute.Pointer, M: Int32, K: Int32,
                 stride_xm: Int64, stride_xk: Int64, stream):
        # (M, K) view of x through both strides
        mX_mk = cute.make_tensor(pX, cute.make_layout((M, K), stride=(stride_xm, stride_xk)))
        num_chunks = (K + CHUNK - 1) // CHUNK
        total = M * num_chunks
        self.kernel(mX_mk, pAmax, M, K, num_chunks).launch(
            grid=((total + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX_mk: cute.Tensor, pAmax: cute.Pointer, M: Int32, K: Int32, num_chunks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        idx = bidx * THREADS + tidx
        amax_bits = Int32(0)  # threads past the end contribute +0.0
        if idx < M * num_chunks:
            m = idx // num_chunks
            k0 = (idx % num_chunks) * CHUNK
            n = cutlass.min(K - k0, CHUNK)
            amax = cutlass.Float32(0.0)
            for j in cutlass.range(n):
                # NaN/Inf count as +Inf (the non-finite rule: the consumer's scale becomes NaN)
                amax = cutlass.max(amax, abs_or_inf(mX_mk[m, k0 + j].to(cutlass.Float32)))
            amax_bits = amax.bitcast(Int32)
        # every lane takes part in the shuffle reduction, then one atomic per warp
        amax_bits = cute.arch.warp_reduction_max(amax_bits)
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_max(pAmax, amax_bits)


def amax_example_args(x_dtype):
    return (fake_ptr(x_dtype, 2), fake_ptr(cutlass.Int32, 4), *fake_sizes(2), *fake_strides(2), fake_stream())


def launch_amax(x2: torch.Tensor, arch: str, stream) -> torch.Tensor:
    """int32 [1] holding the bits of max |x2| (x2 [M, K], M >= 1), computed by TensorAmax."""
    x_dtype = TORCH_TO_CUTLASS[x2.dtype]
    fn = compiled(TensorAmax, (x_dtype,), arch, lambda: amax_example_args(x_dtype))
    word = torch.zeros(1, dtype=torch.int32, device=x2.device)
    M, K = x2.shape
    fn(ptr(x2), ptr(word), Int32(M), Int32(K), Int64(x2.stride(0)), Int64(x2.stride(1)), stream)
    return word
