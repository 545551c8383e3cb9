"""The element codecs every Triton kernel here shares, as ``@triton.jit`` bit arithmetic, plus the
block-scale addressing and the grouped tile order of the GEMMs. ``dequantize_*`` turns codes into
values (e2m1, e4m3, E8M0), ``encode_*`` values into codes (RNE, saturating).

Why bit arithmetic: under TRITON_INTERPRET=1 Triton's fp32 -> float8e4nv cast rounds wrongly for
~13% of values and does not saturate. Integer and fp32 arithmetic is exact on every backend, so
these encoders reproduce the formats/ oracle bit for bit everywhere; division that must match it
uses tl.math.div_rn (IEEE; Triton's plain ``/`` may be approximate on GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl


# -- Dequantizers: code -> float32 ----------------------------------------------------------------
@triton.jit
def exp2_int(e):
    """2^e as float32 for an int32 e in [-127, 127], exactly, from the exponent bits (tl.exp2 may be
    approximate and flush subnormals; 2^-127 is the subnormal 0x00400000)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e == -127, tl.full(e.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True), normal)


@triton.jit
def dequantize_e2m1(nibble):
    """4-bit e2m1 code (any int type, 0..15) -> float32. Once per weight element, so cheap: the 3
    magnitude bits e e m go to fp32 bits 24..22 (the low 2 exponent bits and the top mantissa bit),
    which is exactly value * 2^-126 for every code, the subnormal 0.5 too (fp32's subnormal spacing
    matches); one multiply by 2^126 restores it (plain mul.f32, no .ftz: checked in the PTX)."""
    n = nibble.to(tl.uint32)
    bits = ((n & 0x7) << 22) | ((n & 0x8) << 28)  # magnitude at bits 24..22, sign at bit 31
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def dequantize_e4m3(code):
    """8-bit e4m3fn code -> float32, the NaN codes 0x7F/0xFF to NaN (docs/formats.md's non-finite
    rule). dequantize_e2m1's trick: the 7 magnitude bits go to fp32 bits 26..20, value * 2^-120 for
    every code; the NaN codes come out as +-480, which no other code gives, hence the select."""
    v = dequantize_e4m3_finite(code)
    return tl.where(tl.abs(v) == 480.0, float("nan"), v)


@triton.jit
def dequantize_e4m3_finite(code):
    """dequantize_e4m3 for codes known not to be NaN (they would read as +-480): weight scales, checked
    at load (formats.validate), in a kernel at its register limit (nvfp4 W4A16: a select spills)."""
    c = code.to(tl.uint32)
    bits = ((c & 0x7F) << 20) | ((c & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


@triton.jit
def dequantize_e8m0(code):
    """E8M0 byte b -> 2^(b - 127) as float32, exactly (0x00 -> 2^-127; 0xFF, the NaN byte, -> NaN)."""
    c = code.to(tl.int32)
    return tl.where(c == 0xFF, float("nan"), exp2_int(c - 127))


# -- The non-finite rule (docs/formats.md): a NaN/Inf makes its block's scale NaN -----------------
# [nonfinite]
@triton.jit
def abs_or_inf(x):
    """|x| with NaN and +-Inf as +Inf, so a max over a block is +Inf exactly when the block holds a
    non-finite value (a NaN inside a max depends on the backend: PTX max drops it, numpy keeps it)."""
    a = tl.abs(x)
    return tl.where(a <= 3.4028234663852886e38, a, float("inf"))


@triton.jit
def amax_or_nan(amax, floor):
    """max(amax, floor) for an amax of abs_or_inf values; NaN where it is +Inf (a NaN/Inf inside)."""
    return tl.where(amax <= 3.4028234663852886e38, tl.maximum(amax, floor), float("nan"))
# [/nonfinite]


@triton.jit
def nan_if_nonfinite(x):
    """x with NaN and +-Inf as NaN (which encode_e4m3 writes as the NaN code 0x7F)."""
    return tl.where(tl.abs(x) <= 3.4028234663852886e38, x, float("nan"))


@triton.jit
def global_alpha(gx, gw):
    """nvfp4's alpha = (1 / g_x) * (1 / g_w) (so g_x * g_w cannot overflow); NaN unless both are
    finite and > 0 (a global scale tensor is not checked on the host: that would synchronize)."""
    ok = (gx > 0) & (gx <= 3.4028234663852886e38) & (gw > 0) & (gw <= 3.4028234663852886e38)
    return tl.where(ok, tl.math.div_rn(1.0, gx) * tl.math.div_rn(1.0, gw), float("nan"))


# -- Encoders: float32 -> code (RNE, saturating), bit for bit equal to formats.codecs -------------
@triton.jit
def encode_e4m3(x):
    """float32 -> e4m3fn code as uint8 (RNE, saturating to +-448, sign kept for zeros; NaN -> 0x7F)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)
    abits = a.to(tl.uint32, bitcast=True)
    # Normal range (a >= 2^-6): round the 23-bit fp32 mantissa to 3 bits, ties to even, by adding
    # 0x7FFFF plus the kept LSB; a carry ripples into the exponent as it should. Then rebias the
    # exponent from 127 to 7.
    rounded = (abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20
    normal = rounded.to(tl.int32) - ((127 - 7) << 3)
    # Subnormal range (a < 2^-6): the code is a / 2^-9 rounded to an integer (0..8; 8 is 2^-6, the
    # smallest normal, whose code is also 8). Adding 2^23 rounds to an integer (RNE) in one fp32
    # addition; the integer is then read from the low mantissa bits.
    sub = ((a * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal) | sign.to(tl.int32)
    return tl.where(x != x, 0x7F, code).to(tl.uint8)


@triton.jit
def encode_e2m1(x):
    """float32 -> 4-bit e2m1 code in a uint8 (RNE, saturating to +-6): each midpoint between the
    magnitudes 0|.5|1|1.5|2|3|4|6 rounds up on a tie (>=) or down (>), so ties land on even codes."""
    a = tl.abs(x)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = ((x.to(tl.uint32, bitcast=True) >> 28) & 0x8).to(tl.int32)
    return (code | sign).to(tl.uint8)


@triton.jit
def ceil_log2(v):
    """ceil(log2(v)) for positive normal float32 v, exactly, as int32 (exponent bits + 1 unless a power of two)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def floor_log2(v):
    """floor(log2(v)) for positive normal float32 v, exactly, as int32."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def round_to_bf16_rne(x):
    """float32 -> the nearest bf16 value (RNE), still float32: add 0x7FFF plus the kept LSB to the 16
    dropped bits, then clear them; before a bf16 store under the interpreter, whose cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    # a GPU's NaN is 0x7FFFFFFF, which the add carries into the sign: -0.0; NaN stays NaN
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


# -- Block-scale addressing: linear [rows, K/VEC_SIZE] or swizzled 128x4 (formats.layout) ---------
# [scale-offsets]
@triton.jit
def scale_offsets(rows, cols, n_cols, stride_row, SWIZZLED: tl.constexpr):
    """Offsets [len(rows), len(cols)] of the block scales (rows, cols) of an ``n_cols``-column scale
    matrix. Linear: rows * stride_row + cols. Swizzled 128x4 (cuBLAS's and b12x's; formats.layout):
    512-byte tiles of 128 rows x 4 columns, row r at (r % 32) * 16 + ((r // 32) % 4) * 4 in its tile."""
    r = rows.to(tl.int64)[:, None]
    c = cols[None, :]
    if SWIZZLED:
        tiles_per_row = (n_cols + 3) // 4
        return ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
    return r * stride_row + c
# [/scale-offsets]


# -- Program order of a GEMM grid -----------------------------------------------------------------
@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), walking GROUP_M row tiles per weight column tile (the "grouped
    ordering" of Triton's matmul tutorial: consecutive programs reuse the same weight columns from L2)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n
