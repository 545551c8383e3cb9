"""Device-side codecs for the CuTe DSL quantizers: float32 -> e4m3 / e2m1 codes, power-of-two
helpers, IEEE division and the 128x4 swizzle offset, as ``@cute.jit`` functions (inlined into the
kernels that call them).

They are ports of ``kernels_triton/_common.py``'s bit arithmetic, which is pinned bit for bit to the
``formats/codecs.py`` oracle. Only integer and round-to-nearest fp32 arithmetic is used (no fast-math,
no ``.ftz``, no approximate division), so the codes do not depend on the GPU generation: the same
kernels run on sm_90 (H200) and sm_120/121. ``tests/kernels_cute/test_cute_quant.py`` checks the PTX.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir_helpers.math import RoundingMode

from formats.constants import AMAX_FLOOR, SWIZZLE_TILE_BYTES

FLOOR = AMAX_FLOOR  # 2^-100: amax is clamped below to this before it divides anything
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000


# ---------------------------------------------------------------------------------------------
# The non-finite rule (docs/formats.md): a NaN/Inf makes its block's scale NaN. Tests on the bits,
# so that no float comparison's NaN ordering (ordered or not) matters.
# ---------------------------------------------------------------------------------------------
@cute.jit
def is_finite(x: Float32):
    """x is neither NaN nor +-Inf (exponent field not all ones)."""
    return (x.bitcast(Uint32) & Uint32(0x7FFFFFFF)) < Uint32(_INF_BITS)


@cute.jit
def not_finite(x: Float32):
    """x is NaN or +-Inf."""
    return (x.bitcast(Uint32) & Uint32(0x7FFFFFFF)) >= Uint32(_INF_BITS)


@cute.jit
def abs_or_inf(x: Float32) -> Float32:
    """|x| with NaN and +-Inf as +Inf, so a max over a block is +Inf exactly when it holds a
    non-finite value (PTX max.f32 drops a NaN operand)."""
    return Float32(cutlass.select_(is_finite(x), abs(x), Uint32(_INF_BITS).bitcast(Float32)))


@cute.jit
def amax_or_nan(amax: Float32, floor: Float32) -> Float32:
    """max(amax, floor) for an amax of abs_or_inf values; NaN where it is +Inf (a NaN/Inf inside)."""
    return Float32(cutlass.select_(is_finite(amax), fmax(amax, floor), Uint32(_NAN_BITS).bitcast(Float32)))


@cute.jit
def nan_if_nonfinite(x: Float32) -> Float32:
    """x with NaN and +-Inf as NaN (which encode_e4m3 writes as the NaN code 0x7F)."""
    return Float32(cutlass.select_(is_finite(x), x, Uint32(_NAN_BITS).bitcast(Float32)))


@cute.jit
def nan_value() -> Float32:
    return Uint32(_NAN_BITS).bitcast(Float32)


@cute.jit
def div_rn(a: Float32, b: Float32) -> Float32:
    """a / b correctly rounded (PTX ``div.rn.f32``), as ``formats.base.ieee_div`` and Triton's div_rn."""
    return Float32(cute.math.div(Float32(a), Float32(b), rounding=RoundingMode.NEAREST_EVEN))


@cute.jit
def fmax(a: Float32, b: Float32) -> Float32:
    """max(a, b) for non-NaN float32 (PTX ``max.f32``, no .ftz: subnormals are kept)."""
    return Float32(cutlass.select_(a > b, a, b))


@cute.jit
def encode_e4m3(x: Float32) -> Int32:
    """float32 -> e4m3fn code 0..255 (RNE, saturating to +-448, sign kept for zeros; NaN -> 0x7F).

    Normal range (|x| >= 2^-6): round the 23-bit fp32 mantissa to 3 bits, ties to even, by adding
    0x7FFFF plus the kept LSB (a carry ripples into the exponent), then rebias 127 -> 7. Subnormal
    range: |x| / 2^-9 rounded to an integer by one fp32 addition of 2^23 (the product |x| * 512 is
    exact, so a fused multiply-add gives the same bits).
    """
    sign = (x.bitcast(Uint32) >> Uint32(24)) & Uint32(0x80)
    a = Float32(cutlass.select_(abs(x) < Float32(448.0), abs(x), Float32(448.0)))
    abits = a.bitcast(Uint32)
    rounded = (abits + Uint32(0x7FFFF) + ((abits >> Uint32(20)) & Uint32(1))) >> Uint32(20)
    normal = rounded - Uint32((127 - 7) << 3)
    sub = (a * Float32(512.0) + Float32(8388608.0)).bitcast(Uint32) - Uint32(0x4B000000)
    code = Uint32(cutlass.select_(a < Float32(0.015625), sub, normal))
    is_nan = (x.bitcast(Uint32) & Uint32(0x7FFFFFFF)) > Uint32(_INF_BITS)
    return Int32(cutlass.select_(is_nan, Uint32(0x7F), code | sign))


@cute.jit
def decode_e4m3(code: Int32) -> Float32:
    """e4m3fn code (0..255) -> float32, exactly: the 7 magnitude bits go to fp32 bits 26..20, which
    is value * 2^-120 for every code (subnormals too), and one exact multiply by 2^120 restores it;
    the NaN codes 0x7F/0xFF decode to NaN."""
    c = Uint32(code)
    bits = ((c & Uint32(0x7F)) << Uint32(20)) | ((c & Uint32(0x80)) << Uint32(24))
    v = bits.bitcast(Float32) * Float32(1.329227995784916e36)  # 2^120
    return Float32(cutlass.select_((c & Uint32(0x7F)) == Uint32(0x7F), nan_value(), v))


@cute.jit
def encode_e2m1(x: Float32) -> Int32:
    """float32 -> 4-bit e2m1 code 0..15 (RNE ties to the even code, saturating to +-6, sign kept for zeros).

    Each midpoint between neighbouring magnitudes (0|.5|1|1.5|2|3|4|6) rounds up on a tie (>=) or down
    (>), alternating so that ties land on the even code (formats.codecs.encode_e2m1).
    """
    a = abs(x)
    code = (
        Int32(a > Float32(0.25))
        + Int32(a >= Float32(0.75))
        + Int32(a > Float32(1.25))
        + Int32(a >= Float32(1.75))
        + Int32(a > Float32(2.5))
        + Int32(a >= Float32(3.5))
        + Int32(a > Float32(5.0))
    )
    sign = Int32((x.bitcast(Uint32) >> Uint32(28)) & Uint32(0x8))
    return code | sign


@cute.jit
def ceil_log2(v: Float32) -> Int32:
    """ceil(log2(v)) for positive normal float32 v, exactly: exponent bits, plus one unless a power of two."""
    bits = v.bitcast(Uint32)
    e = Int32((bits >> Uint32(23)) & Uint32(0xFF)) - Int32(127)
    return e + Int32((bits & Uint32(0x7FFFFF)) != Uint32(0))


@cute.jit
def floor_log2(v: Float32) -> Int32:
    """floor(log2(v)) for positive normal float32 v, exactly."""
    return Int32((v.bitcast(Uint32) >> Uint32(23)) & Uint32(0xFF)) - Int32(127)


@cute.jit
def exp2_int(e: Int32) -> Float32:
    """2^e as float32 for an int32 e in [-127, 127], exactly, from the exponent bits (2^-127 is the
    subnormal 0x00400000)."""
    normal = Uint32((e + Int32(127)) << Int32(23))
    return Uint32(cutlass.select_(e == Int32(-127), Uint32(0x00400000), normal)).bitcast(Float32)


@cute.jit
def clamp_int(v: Int32, lo: int, hi: int) -> Int32:
    """min(max(v, lo), hi)."""
    v = Int32(cutlass.select_(v < Int32(lo), Int32(lo), v))
    return Int32(cutlass.select_(v > Int32(hi), Int32(hi), v))


@cute.jit
def swizzled_offset(r: Int32, c: Int32, cols: Int32) -> Int32:
    """Byte offset of scale (r, c) in the 128x4 swizzled layout of an [rows, cols] scale matrix
    (formats.layout.swizzled_offset; b12x swizzle_block_scale)."""
    tiles_per_row = (cols + Int32(3)) // Int32(4)
    tile = (r // Int32(128)) * tiles_per_row + c // Int32(4)
    return (tile * Int32(SWIZZLE_TILE_BYTES) + (r % Int32(32)) * Int32(16)
            + ((r // Int32(32)) % Int32(4)) * Int32(4) + c % Int32(4))
