"""NVFP4 activation quantization for sm_90, bit for bit as the oracle: the lesson's quantizer
(kernels_triton.nvfp4) with PDL, a grid of amax partials sized for the GPU, and the variant that
writes the decode GEMM's activation planes (hopper._fp4_decode) instead of codes and scales.

What NVFP4 stores (formats/nvfp4.py is the spec and the oracle): e2m1 codes packed two per byte
along K (uint8 [rows, K/2], element 2i in the low nibble), one e4m3 scale per 16 elements
(float8_e4m3fn [rows, K/16], linear layout), and one float32 global scale g per tensor:

    g    = 2688 / max(amax(x), AMAX_FLOOR)       dynamic (2688 = 448 * 6), or a static global_scale
    s    = e4m3(div_rn(amax_block, 6) * g)        per 16-element block
    code = e2m1(div_rn(x * g, dequantize(s)))         code 0 where s == 0
    x   ~= e2m1_value(code) * dequantize(s) / g

Quantization (``quantize_activation``) runs two kernels:

    _amax_partial_kernel   (dynamic g only) a (Pm, Pk) grid of programs, each the max |x| over a
                           strided set of row and K tiles -> partial[Pm * Pk] (no atomics, so the
                           result does not depend on timing)
    _quantize_kernel       every program reduces partial[0:P] itself (P <= 256, a few hundred
                           bytes), forms g, then quantizes its [BLOCK_M, BLOCK_K] tile:
        xb    = x tile as [BLOCK_M, BLOCK_K/16, 16] float32
        s     = encode_e4m3(div_rn(max(max|xb|, FLOOR), 6) * g)          # [BLOCK_M, BLOCK_K/16]
        codes = encode_e2m1(div_rn(xb * g, dequantize_e4m3(s)))              # 0 where s == 0
        bytes = codes[..., 0::2] | codes[..., 1::2] << 4                 # low nibble = even element
Everything stays on the device (no .item()), so the call can be captured in a CUDA graph. Rounding
to e4m3/e2m1 uses the bit-arithmetic encoders of _common (never Triton's fp8 cast, which is wrong in
the interpreter) and IEEE division (tl.math.div_rn), so the codes equal the oracle's bit for bit.
"""

from __future__ import annotations

from typing import Union

import torch
import triton
import triton.language as tl

from formats import QuantizedTensor
from formats.constants import AMAX_FLOOR, NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR
from formats.validate import nan_unless_positive, static_global_scale

from .._codecs import (abs_or_inf, amax_or_nan, dequantize_e2m1, dequantize_e4m3, encode_e2m1, encode_e4m3,
                       nan_if_nonfinite)
from .._common import check_activation, interpreting, launch
from ..tuning import quant_config
from ._fp4_decode import PLANE_DTYPES, check_quantize_planes, store_planes
from ._pdl import pdl_launch, pdl_launch_dependents, pdl_wait

FMT = "nvfp4"
VEC_SIZE = NVFP4_BLOCK  # 16 elements share one e4m3 scale
MAX_PARTIALS = 256  # programs of the amax reduction (the quantize kernel reads all their results)

_FLOOR = tl.constexpr(AMAX_FLOOR)
_G_NUM = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)  # 2688.0
_TWO_POW_M14 = tl.constexpr(2.0**-14)  # the fp16 planes' factor (_fp4_decode, F16_DEQUANTIZE)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _global_scale_from_amax(amax):
    """g = 2688 / max(amax, AMAX_FLOOR), one IEEE division, as the oracle (formats.base.ieee_div)."""
    return tl.math.div_rn(tl.zeros_like(amax) + _G_NUM, amax_or_nan(amax, _FLOOR))  # NaN if +Inf: NaN/Inf in x


@triton.jit
def _amax_partial_kernel(
    x_ptr, partial_ptr,
    M, K,
    stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
):
    """partial[pid_m * Pk + pid_k] = max |x| over the row tiles pid_m, pid_m + Pm, ... and the K tiles
    pid_k, pid_k + Pk, ... of a (Pm, Pk) grid. The grid spans K too: one program walking all of K
    would issue its loads one after another (at decode, 64 dependent steps for K = 8192)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pm = tl.num_programs(0)
    num_pk = tl.num_programs(1)
    amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    pdl_wait(USE_PDL)  # x is the previous kernel's output
    for m0 in range(pid_m * BLOCK_M, M, num_pm * BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        for k0 in range(pid_k * BLOCK_K, K, num_pk * BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, abs_or_inf(x))  # +Inf marks a NaN/Inf
    pdl_launch_dependents(USE_PDL)
    tl.store(partial_ptr + pid_m * num_pk + pid_k, tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr,  # bf16/fp16 [M, K], any strides
    partial_ptr,  # float32 [num_partials] (dynamic) or the static g (float32 [1])
    q_ptr, s_ptr,  # out: packed uint8 [M, K/2], e4m3 scale bytes uint8 [M, K/16]
    g_out_ptr,  # out: float32 [1], the global scale used
    p_ptr,  # PLANE_K > 0, out instead of q and s: the decode GEMM's activation planes [M, K_PAD] (store_planes)
    # dimensions
    M, K, num_partials, K_PAD,
    # strides
    stride_xm, stride_xk, stride_qm, stride_sm, stride_pm,
    # meta-parameters
    DYNAMIC: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (_pdl)
    PLANE_K: tl.constexpr = 0,  # 0: codes and scales; else the planes of the sm_90 decode GEMM's BLOCK_K
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_wait(USE_PDL)  # the partials (and x) come from earlier kernels

    # ----- global scale: reduce the partial amaxes (dynamic) or read the static g
    if DYNAMIC:
        offs_p = tl.arange(0, BLOCK_P)
        partial = tl.load(partial_ptr + offs_p, mask=offs_p < num_partials, other=0.0)
        g = _global_scale_from_amax(tl.max(partial, axis=0))
    else:
        # a static g given as a tensor is not checked on the host (that would sync): a bad one
        # (<= 0, Inf, NaN) becomes NaN here, so every consumer of g_out yields NaN, never zeros
        g = tl.load(partial_ptr)
        g = nan_if_nonfinite(tl.where(g > 0, g, float("nan")))
    tl.store(g_out_ptr, g, mask=(pid_m == 0) & (pid_k == 0))

    # ----- x tile [BLOCK_M, BLOCK_K] as float32 (exact for bf16/fp16)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)
    m_mask = offs_m < M
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k.to(tl.int64)[None, :] * stride_xk,
                mask=mask, other=0.0).to(tl.float32)

    # ----- per-16 block scale s = e4m3(amax_b / 6 * g): [BLOCK_M, BLOCK_K / 16]
    xb = x.reshape(BLOCK_M, BLOCK_K // 16, 16)
    amax_b = amax_or_nan(tl.max(abs_or_inf(xb), axis=2), _FLOOR)  # NaN for a block with NaN/Inf
    s_code = encode_e4m3(tl.math.div_rn(amax_b, 6.0) * g)
    s_val = dequantize_e4m3(s_code)[:, :, None]

    # ----- element codes: e2m1(x * g / s), 0 where s == 0 (the quotient would be NaN or inf) or
    # s is NaN (0x7F: the block, or with dynamic g the tensor, held a NaN/Inf; the non-finite rule)
    safe_s = tl.where(s_val > 0, s_val, 1.0)
    codes = encode_e2m1(tl.math.div_rn(xb * g, safe_s))
    codes = tl.where(s_val > 0, codes, 0).to(tl.uint8).reshape(BLOCK_M, BLOCK_K)

    if PLANE_K:  # the decode linear: e2m1 * s * 2^-14, exact in fp16 (_fp4_decode's docstring)
        v = dequantize_e2m1(codes).reshape(BLOCK_M, BLOCK_K // 16, 16) * s_val * _TWO_POW_M14
        pdl_launch_dependents(USE_PDL)
        store_planes(p_ptr, v.reshape(BLOCK_M, BLOCK_K), offs_m, m_mask, pid_k * BLOCK_K, K, K_PAD, stride_pm,
                     BLOCK_M, BLOCK_K, PLANE_K)
        return

    # ----- pack two codes per byte, element 2j in the low nibble: [BLOCK_M, BLOCK_K / 2]
    even, odd = tl.split(codes.reshape(BLOCK_M, BLOCK_K // 2, 2))
    packed = even | (odd << 4)
    pdl_launch_dependents(USE_PDL)
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_kb[None, :], packed,
             mask=m_mask[:, None] & (offs_kb[None, :] < K // 2))
    offs_ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(s_ptr + rows[:, None] * stride_sm + offs_ks[None, :], s_code,
             mask=m_mask[:, None] & (offs_ks[None, :] < K // 16))


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------
def _quantize_tiles(M: int, K: int, interp: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the quantize kernels: whole small problems in the interpreter (each
    program costs milliseconds there); on GPU the tiles of every activation quantizer
    (tuning.quant_config: 32 x 128, one row 1024 wide per program at decode)."""
    if interp:
        return triton.next_power_of_2(min(max(M, 1), 256)), triton.next_power_of_2(min(K, 512))
    return quant_config(M, K, False, group=VEC_SIZE)


def quantize_activation(x: torch.Tensor, *, global_scale: Union[None, float, torch.Tensor] = None) -> QuantizedTensor:
    """Quantize activations to NVFP4 with the Triton kernels, bit for bit as
    ``formats.quantize(x, "nvfp4", role="activation", global_scale=global_scale)``.

    Args:
        x: bfloat16/float16 [..., K], K % 16 == 0, any leading dims and strides; NaN/Inf follow the non-finite rule (docs/formats.md).
        global_scale: static g (e.g. a calibrated input_global_scale = 2688 / amax), a Python number
            or a one-element float tensor; None = dynamic, 2688 / max(amax(x), 2^-100).
    Returns:
        QuantizedTensor(fmt="nvfp4", role="activation", data=uint8 [M, K/2],
        scale=float8_e4m3fn [M, K/16], global_scale=float32 0-d, shape=(M, K)), M = prod(x.shape[:-1]).
    Raises:
        ValueError: x not a bf16/fp16 tensor, K not a positive multiple of 16, or a bad global_scale.
    """
    check_activation(x, None, VEC_SIZE, FMT)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)  # a view when the strides allow; the kernels take both strides
    M = x2.shape[0]
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((M, K // VEC_SIZE), dtype=torch.uint8, device=x.device)
    g = _launch(x2, global_scale, data, scale, None, 0)
    return QuantizedTensor(FMT, "activation", data, scale.view(torch.float8_e4m3fn), g.reshape(()),
                           (1, VEC_SIZE), (M, K))


def quantize_planes(x2: torch.Tensor, planes: torch.Tensor, plane_k: int, *,
                    global_scale: Union[None, float, torch.Tensor] = None) -> torch.Tensor:
    """The sm_90 decode linear's activation quantizer: x2 quantized as quantize_activation does (the
    same codes, scales and g), but written as the decode GEMM's fp16 planes (value * 2^-14, exact;
    float32 under the interpreter) instead of codes and scales: a launch less than quantize then
    _fp4_decode.act_planes_kernel.

    Args:
        x2: bfloat16/float16 [M, K] (any strides), K a positive multiple of 16.
        planes: out, _fp4_decode.plane_layout's [M, K_pad] tensor (K_pad = K rounded up to plane_k;
            fp16 / float32, K stride 1, on x2's device).
        plane_k: plane_layout's PLANE_K (the GEMM's BLOCK_K), a power of two >= 64.
        global_scale: as quantize_activation (a bad tensor one gives NaN planes and a NaN g).
    Returns:
        g, float32 [1] on x2's device (the global scale used; the GEMM's gx); 0-d when M = 0.
    Raises:
        ValueError: as quantize_activation; x2 not 2-D; plane_k not a power of two >= 64; planes
            not that tensor (_fp4_decode.check_planes: 2-D, shape, dtype, K stride 1, device).
    """
    check_activation(x2, None, VEC_SIZE, FMT)
    check_quantize_planes(x2, planes, plane_k, 4 * VEC_SIZE, PLANE_DTYPES[FMT])
    return _launch(x2, global_scale, planes, planes, planes, plane_k)


def amax_partials(M: int, K: int, plane_k: int, interp: bool) -> int:
    """How many partial amaxes the dynamic global scale is reduced from for x [M, K] quantized in
    tiles of at least ``plane_k`` columns (0: codes, no planes): the amax kernel's grid (row tiles
    times K tiles, within MAX_PARTIALS; one K tile under the interpreter), the quantize kernel's
    ``num_partials`` / ``BLOCK_P``."""
    block_m, block_k = _quantize_tiles(M, K, interp)
    block_k = max(block_k, plane_k)
    pm = min(triton.cdiv(M, block_m), 4 if interp else MAX_PARTIALS)
    pk = min(triton.cdiv(K, block_k), 1 if interp else max(1, MAX_PARTIALS // pm))
    return pm * pk


def _launch(x2, global_scale, data, scale, planes, plane_k: int) -> torch.Tensor:
    """The amax and quantize kernels over x2 [M, K] into data and scale (plane_k 0) or planes; the g
    tensor (float32 [1], or 0-d without a launch)."""
    M, K = x2.shape
    device = x2.device
    dynamic = global_scale is None
    g_in = None if dynamic else static_global_scale(global_scale, device)
    if M == 0:  # no launch; the oracle's g for an empty tensor is 2688 / AMAX_FLOOR
        return (torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=torch.float32, device=device)
                / torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=device)) if dynamic else nan_unless_positive(g_in)
    interp = interpreting()
    block_m, block_k = _quantize_tiles(M, K, interp)
    block_k = max(block_k, plane_k)  # whole plane tiles per program (both powers of two)
    g = torch.empty((1,), dtype=torch.float32, device=device)
    num_partials = 1
    if dynamic:
        num_partials = amax_partials(M, K, plane_k, interp)
        pm = min(triton.cdiv(M, block_m), 4 if interp else MAX_PARTIALS)
        pk = num_partials // pm
        g_in = torch.empty((num_partials,), dtype=torch.float32, device=device)
        launch(
            _amax_partial_kernel, (pm, pk), x2, g_in, M, K, x2.stride(0), x2.stride(1), BLOCK_M=block_m, BLOCK_K=block_k, **pdl_launch(device))
    p = planes if plane_k else g
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    launch(
        _quantize_kernel, grid, x2, g_in, data, scale, g, p,
        M, K, num_partials, planes.shape[1] if plane_k else 0,
        x2.stride(0), x2.stride(1), data.stride(0), scale.stride(0), planes.stride(0) if plane_k else 0,
        DYNAMIC=dynamic, BLOCK_P=max(16, triton.next_power_of_2(num_partials)),
        BLOCK_M=block_m, BLOCK_K=block_k, PLANE_K=plane_k, **pdl_launch(device),
    )
    return g
