"""Named numbers of the five formats, each with its source.

Sources: OCP Microscaling Formats (MX) Specification v1.0 (2023-09), sections 5.3 (E8M0),
5.3.3 (FP4 E2M1), 5.3.2 (FP8 E4M3); NVIDIA's NVFP4 recipe (TensorRT-LLM / Transformer Engine:
16-element blocks, E4M3 block scale, FP32 global scale); DeepSeek-V3 / DeepGEMM block FP8
(1x128 activation groups, 128x128 weight blocks, FP32 scales).
"""

E4M3_MAX = 448.0  # largest finite e4m3fn value: 1.75 * 2^8 (S.1111.110); 0x7F/0xFF are NaN, no inf
E4M3_NAN = 0x7F  # the NaN code the formats write (0xFF, the negative NaN, decodes as NaN too)
E4M3_EMAX = 8  # exponent of E4M3_MAX, used by the OCP floor scale rule
E4M3_MIN_SUBNORMAL = 2.0**-9  # 0x01
E4M3_EXP_BIAS = 7

E2M1_MAX = 6.0  # largest e2m1 value: 1.5 * 2^2 (S.11.1)
E2M1_EMAX = 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative

E8M0_BIAS = 127  # E8M0 byte b encodes 2^(b - 127)
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127  # byte 0x00 = 2^-127 (not zero)
E8M0_MAX_EXP = 127  # byte 0xFE = 2^127

MX_BLOCK = 32  # OCP MX block size (elements sharing one E8M0 scale)
NVFP4_BLOCK = 16  # NVFP4 block size (elements sharing one e4m3 scale)
FP8_BLOCK = 128  # block FP8: 1x128 activation groups, 128x128 weight blocks

# NVFP4 global scale numerator: g = E4M3_MAX * E2M1_MAX / amax, so that the largest block scale
# amax/6 * g lands exactly at 448.
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688.0

# amax is clamped from below to this value before it divides anything, so that an all-zero (or
# denormal-only) tensor or block gives a finite positive scale and zero codes, never NaN or Inf.
AMAX_FLOOR = 2.0**-100

# Swizzled 128x4 block-scale layout (cuBLAS "VEC16/VEC32 block scaling factors", b12x F8_128x4):
SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
SWIZZLE_TILE_BYTES = 512
