"""Element codecs shared by every format: e4m3fn, e2m1 (packed two per byte), E8M0, UE8M0.

All encoders round to nearest, ties to even (RNE) and saturate to the largest finite value; they
take float32 input. They are the oracle: written with torch operations whose behaviour is pinned
by the exhaustive tests in tests/formats/test_codecs.py, independently of the Triton and CuTe
kernels (which use explicit bit arithmetic).

Sources: OCP MX v1.0 sections 5.3.2 (E4M3), 5.3.3 (E2M1), 5.4.1 (E8M0).
"""

from __future__ import annotations

import torch

from .constants import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_NAN,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    E8M0_NAN,
)

__all__ = [
    "encode_e4m3",
    "decode_e4m3",
    "encode_e2m1",
    "decode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "encode_e8m0",
    "decode_e8m0",
    "floor_log2",
    "ceil_log2",
    "pow2_ceil",
]


def _require_float32(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a float32 tensor, got {got}")


# ----------------------------------------------------------------------------------------------
# e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; subnormals down to 2^-9; no inf.
# ----------------------------------------------------------------------------------------------
def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to e4m3fn (RNE, saturating to +-448).

    Args:
        x: float32 tensor, any shape.
    Returns:
        torch.float8_e4m3fn tensor of x's shape. Values beyond +-448 (+-Inf too) saturate to +-448;
        the sign of values that round to zero is kept (-0.0 encodes as byte 0x80); NaN (of either
        sign) encodes as 0x7F.
    Raises:
        ValueError: if x is not float32.
    Source: OCP MX v1.0 5.3.2 (E4M3 with saturation, "satfinite" conversion as in PTX cvt.rn.satfinite).
    """
    _require_float32(x, "x")
    # torch's float -> float8_e4m3fn cast is RNE (normals and subnormals). Since torch 2.12
    # (pytorch/pytorch#178817) it saturates out-of-range values, Inf included (2.13 here); torch 2.11
    # and older (the H200 machine's) turn |x| > 464 into NaN. Clamping first gives saturation on
    # every version (any |x| >= 448 rounds to 448 anyway); NaN is restored below.
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(x), torch.full_like(codes, E4M3_NAN), codes).view(torch.float8_e4m3fn)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """Decode e4m3fn bytes (dtype float8_e4m3fn or uint8) to float32; 0x7F/0xFF decode to NaN."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes must be float8_e4m3fn or uint8, got {codes.dtype}")
    return codes.to(torch.float32)


# ----------------------------------------------------------------------------------------------
# e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa bit. Codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6.
# ----------------------------------------------------------------------------------------------
# Midpoints between neighbouring magnitudes, and whether a tie there rounds up. RNE ties go to the
# even code: the tie at 0.25 (codes 0|1) goes down to code 0, the tie at 0.75 (codes 1|2) goes up
# to code 2, and so on, alternating.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to e2m1 codes (RNE with ties to the even code, saturating to +-6).

    Args:
        x: float32 tensor, any shape, finite values.
    Returns:
        uint8 tensor of x's shape holding one 4-bit code per element (bit 3 = sign, copied from the
        float32 sign bit, so -0.0 and negative values that round to zero encode as 0x8).
    Raises:
        ValueError: if x is not float32.
    Source: OCP MX v1.0 5.3.3 (FP4 E2M1); PTX cvt.rn.satfinite.e2m1x2.f32 behaves the same way.
    """
    _require_float32(x, "x")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP):
        passed = (a >= mid) if tie_up else (a > mid)
        code += passed.to(torch.uint8)
    # values above 6 stay at code 7 (saturation): the loop never passes more than 7 midpoints
    return code | (torch.signbit(x).to(torch.uint8) << 3)


_E2M1_TABLE = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit e2m1 codes (uint8, one code per element, values 0..15) to float32."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    return _E2M1_TABLE.to(codes.device)[(codes & 0xF).long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes two per byte along the last dimension: element 2i in the low nibble.

    Args:
        codes: uint8 [..., K] with K even, each value < 16.
    Returns:
        uint8 [..., K/2].
    Raises:
        ValueError: if K is odd or dtype is not uint8.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"codes last dimension must be even to pack two per byte, got {codes.shape[-1]}")
    lo = codes[..., 0::2] & 0xF
    hi = codes[..., 1::2] & 0xF
    return lo | (hi << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_e2m1: uint8 [..., K/2] -> uint8 codes [..., K] (low nibble = even element)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------
# Powers of two: E8M0 and UE8M0 scales.
# ----------------------------------------------------------------------------------------------
def _exponent_and_mantissa(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = v.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF), (bits & 0x7FFFFF)


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2(v)) for positive normal float32 v, exactly, from the exponent bits (int32)."""
    _require_float32(v, "v")
    exp, _ = _exponent_and_mantissa(v)
    return exp - 127


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) for positive normal float32 v, exactly: floor, plus one unless v is a power of two."""
    _require_float32(v, "v")
    exp, man = _exponent_and_mantissa(v)
    return exp - 127 + (man != 0).to(torch.int32)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) as float32 for positive normal float32 v (the UE8M0 rounding of a scale)."""
    e = ceil_log2(v).clamp(E8M0_MIN_EXP + 1, E8M0_MAX_EXP)  # stay a normal float32
    return torch.ldexp(torch.ones_like(v), e.to(torch.float32))


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """E8M0 byte for an integer exponent e (value 2^e), clamped to [-127, 127]; returns uint8."""
    if exponent.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"exponent must be an int32/int64 tensor, got {exponent.dtype}")
    return (exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes (uint8 or float8_e8m0fnu) to float32: 2^(b-127); 0x00 is 2^-127, 0xFF is NaN."""
    if hasattr(torch, "float8_e8m0fnu") and codes.dtype == torch.float8_e8m0fnu:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 (E8M0 bytes), got {codes.dtype}")
    e = codes.to(torch.float64) - E8M0_BIAS  # 2^-127 is subnormal in float32 but exact
    out = torch.pow(2.0, e).to(torch.float32)
    return torch.where(codes == E8M0_NAN, torch.full_like(out, float("nan")), out)


assert E2M1_MAX == E2M1_VALUES[-1]
